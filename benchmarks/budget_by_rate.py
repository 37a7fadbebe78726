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

And, where the tasks have attributes (the testbed's `DecisiveEnv.attributes`: errors allowed, shift,
keys), how widely each probed iteration's rollouts spread over the attribute cells at each depth: the
share of the rollouts on the most funded cell, and the effective number of cells (exp of the entropy of
the rollouts' cell shares).

A method that spends on r = 0 or 1 buys groups that cannot be mixed; one that spends on r near 0.5 buys
the most contrast per rollout; one that spends on few cells trains each iteration on a narrow slice of
the task. Only what the probe saw is reported: a bin holds candidates whose rate
was measured from 2 x `half` episodes, so "exactly 0" includes rates too small to show in them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trace_lightning.envs.decisive import DecisiveEnv
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


def cell_spread(probes: list[dict[str, Any]], cell_of: Callable[[int], tuple[str, ...]]) -> dict[str, float]:
    """Mean over probes of the most funded cell's share of the bare rollouts and of the effective number
    of cells, exp(-sum s log s) over the cells' shares s."""
    top, effective = [], []
    for p in probes:
        spent: dict[tuple[str, ...], float] = {}
        for t, c in zip(p["task_ids"], p["counts"], strict=True):
            spent[cell_of(t)] = spent.get(cell_of(t), 0.0) + c
        shares = np.array([v for v in spent.values() if v > 0]) / sum(spent.values())
        top.append(float(shares.max()))
        effective.append(float(np.exp(-(shares * np.log(shares)).sum())))
    return {"top_cell_share": float(np.mean(top)), "effective_cells": float(np.mean(effective))}


def testbed_cells(config: dict[str, Any]) -> Callable[[int], tuple[str, ...]]:
    """A training task's attributes on the testbed a learning.py result ran on."""
    env = DecisiveEnv(config["tasks"], config["heldout_tasks"], "train", config["task_seed"])
    by_id = {t.task_id: t for t in env.tasks()}
    return lambda task_id: env.attributes(by_id[task_id])


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
    out = {m: method_table(p) for m, p in by_method.items()}
    if "config" in result:  # a testbed run: its tasks' attributes, at every depth
        attributes = testbed_cells(result["config"])
        for m, probes in by_method.items():
            depths = len(attributes(probes[0]["task_ids"][0])) if probes else 0
            out[m]["cells"] = {
                str(d): cell_spread(probes, lambda t, d=d: attributes(t)[:d]) for d in range(1, depths + 1)
            }
    return out


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


def print_cells(out: dict[str, dict[str, Any]]) -> None:
    depths = sorted({d for t in out.values() for d in t.get("cells", {})}, key=int)
    if not depths:
        return
    print("\nrollouts by attribute cell: the most funded cell's share / effective cells, per depth")
    print(f"{'method':16s}" + "".join(f"{'depth ' + d:>16s}" for d in depths))
    for m, t in out.items():
        cells = t.get("cells", {})
        print(
            f"{m:16s}"
            + "".join(
                f"{cells[d]['top_cell_share']:8.3f} / {cells[d]['effective_cells']:5.2f}"
                if d in cells
                else " " * 16
                for d in depths
            )
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a benchmarks/learning.py JSON written with --probe-rates")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here as JSON")
    args = p.parse_args(argv)
    out = tables(json.loads(args.result.read_text()))
    print_tables(out)
    print_cells(out)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
