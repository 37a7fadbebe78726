"""Where each method's Stage 1 budget went, by the candidates' true success rates.

    python benchmarks/learning.py --methods uniform trace trace_ungated true_v --seeds 0 1 \
        --tokens 914 --probe-rates --out benchmarks/results/learning_budget_by_rate.json
    python benchmarks/budget_by_rate.py benchmarks/results/learning_budget_by_rate.json

No training here: it reads a `benchmarks/learning.py` JSON written with `--probe-rates`, where every
probe played each candidate of the iteration's pool 2 x `half` times under the current policy (outside the
budget) and kept the bare rollouts Stage 1 had given it. Pooled over seeds and probes, per method:

- by rate bin (the probe's rate r: exactly 0, (0, 1/4], (1/4, 1/2], (1/2, 3/4], (3/4, 1), exactly 1):
  the share of the pool's candidates in the bin and the share of the bare rollouts spent on them;
- the rollout-weighted mean of r and of r (1 - r), the Bernoulli variance a rollout's reward carries;
- expected mixed groups per 100 bare rollouts (`gauges.expected_mixed` on the probe's episodes).

A method that spends on r = 0 or 1 buys groups that cannot be mixed; one that spends on r near 0.5 buys
the most contrast per rollout. Only what the probe saw is reported: a bin holds candidates whose rate
was measured from 2 x `half` episodes, so "exactly 0" includes rates too small to show in them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from trace_lightning.gauges import expected_mixed

EDGES = (0.25, 0.5, 0.75)  # inner bin edges; 0 and 1 are bins of their own
BINS = ("0", "(0, .25]", "(.25, .5]", "(.5, .75]", "(.75, 1)", "1")


def bin_of(rate: float) -> int:
    """The bin index of a probed rate: 0 for exactly 0, 5 for exactly 1, else by `EDGES` (right-closed)."""
    if rate <= 0.0:
        return 0
    if rate >= 1.0:
        return len(BINS) - 1
    return 1 + int(np.searchsorted(EDGES, rate, side="left"))


def method_table(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures above for one method's probes (any number of seeds' `probe_rates` rows)."""
    pool = np.zeros(len(BINS))
    spent = np.zeros(len(BINS))
    weighted_rate = weighted_var = mixed = rollouts = 0.0
    for p in probes:
        wins = np.asarray(p["half_a"]) + np.asarray(p["half_b"])  # [P] successes of `episodes`
        episodes = np.full(len(wins), p["episodes"])
        counts = np.asarray(p["counts"], dtype=np.float64)  # [P] bare rollouts Stage 1 gave each
        rates = wins / episodes
        for r, c in zip(rates, counts, strict=True):
            pool[bin_of(r)] += 1
            spent[bin_of(r)] += c
        weighted_rate += float((counts * rates).sum())
        weighted_var += float((counts * rates * (1 - rates)).sum())
        mixed += expected_mixed(counts.astype(np.int64), wins, episodes)
        rollouts += float(counts.sum())
    return {
        "probes": len(probes),
        "candidates": int(pool.sum()),
        "bare_rollouts": rollouts,
        "pool_share": dict(zip(BINS, (pool / max(pool.sum(), 1)).tolist(), strict=True)),
        "budget_share": dict(zip(BINS, (spent / max(rollouts, 1)).tolist(), strict=True)),
        "mean_rate": weighted_rate / rollouts if rollouts else float("nan"),
        "mean_variance": weighted_var / rollouts if rollouts else float("nan"),
        "mixed_per_100": 100 * mixed / rollouts if rollouts else float("nan"),
    }


def tables(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method, its table over every seed of a learning.py result."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for seed in result["seeds"]:
        for run in seed["runs"]:
            if "probe_rates" not in run:
                raise SystemExit(
                    f"{run['method']} (seed {run['seed']}) has no probe_rates: rerun benchmarks/learning.py "
                    "with --probe-rates"
                )
            by_method.setdefault(run["method"], []).extend(run["probe_rates"])
    return {m: method_table(p) for m, p in by_method.items()}


def print_tables(out: dict[str, dict[str, Any]]) -> None:
    print("share of the pool's candidates by probed success rate (each method's own pools)")
    print(f"{'method':16s}" + "".join(f"{b:>11s}" for b in BINS))
    for m, t in out.items():
        print(f"{m:16s}" + "".join(f"{t['pool_share'][b]:11.3f}" for b in BINS))
    print("\nshare of Stage 1's bare rollouts by probed success rate")
    print(f"{'method':16s}" + "".join(f"{b:>11s}" for b in BINS) + "   mean r  mean r(1-r)  mixed/100")
    for m, t in out.items():
        print(
            f"{m:16s}"
            + "".join(f"{t['budget_share'][b]:11.3f}" for b in BINS)
            + f"   {t['mean_rate']:6.3f}  {t['mean_variance']:11.3f}  {t['mixed_per_100']:9.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a benchmarks/learning.py JSON written with --probe-rates")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here as JSON")
    args = p.parse_args(argv)
    out = tables(json.loads(args.result.read_text()))
    print_tables(out)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
