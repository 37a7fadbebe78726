"""What priced Stage 2 buys, replayed on a finished run's trees under each way of counting worth.

    python benchmarks/replay_pricing.py outputs/real_task/hard_trace_head_gate0_seed0
    python benchmarks/replay_pricing.py <run_dir> --worth leaves tokens --confidence 0 1 --out replay.json

No model and no sampling: it reads the trees a run saved every iteration (`<run_dir>/artifacts/trees/
iteration_*.json`, written by the trees callback), and for each `allocator.pricing.worth` (and each
`allocator.pricing.confidence` and `growth`) walks them in
order as the collector does: price the iteration's bare prefixes on the flip table learned so far
(`FlipRates.candidates`), solve the iteration's m * N continuations (`pricing.solve_priced`) against the
roots' exchange rate, then teach the table what the run's own continuations and roots did
(`FlipRates.observe`). Per iteration it prints what each rule would have bought, by bucket (turns left
after the prefix, the bare rollout's outcome), beside what the run did.

It answers "where would the budget have gone" on a real model's own rollouts at no sampling cost. The
table learns from the run's continuations, not from the ones a rule would have bought, so only the
first iteration a rule departs from the run is a clean counterfactual; later rows show the prices the
run's own measurements imply. The probe's uniform continuations are left out (they are the same under
every rule) and budgets are m * N over the bare rollouts the saved trees hold (given-back groups
included, so a steered iteration's budget can read a little higher than the run's). The saved trees do
not say whether the skill gate was open: an iteration the run spent wholly on GRPO's groups (no
continuation, not even the probe's) ran closed, and no rule would have bought anything there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trace_lightning.pricing import WORTH, FlipRates, Pricing, continuation_outcomes
from trace_lightning.tree import RolloutTree


def replay(iterations: list[dict[str, Any]], pricing: Pricing, expansion: int) -> list[dict[str, Any]]:
    """One row per saved iteration: what Stage 2 priced by `pricing` buys there, and what the run did."""
    rates = FlipRates(pricing)
    rows = []
    for saved in iterations:
        trees = [RolloutTree.from_dict(t) for t in saved["trees"]]
        bare_tokens = int(saved["ledger"]["tokens"]["bare"])
        cands = [c for t in trees for c in rates.candidates(t)]
        bare = sum(1 for t in trees for n in t.nodes if n.stage == "bare" and n.reward is not None)
        signal = rates.signal(trees)
        rate = rates.root_rate(signal, bare_tokens)
        counts = rates.buy(cands, bare * expansion, rate)
        buckets: dict[str, int] = {}
        for c, k in zip(cands, counts, strict=True):
            if k:
                key = f"{c.bucket[0]} left, {'won' if c.bucket[1] else 'lost'}"
                buckets[key] = buckets.get(key, 0) + int(k)
        outcomes = [o for t in trees for o in continuation_outcomes(t)]
        rows.append(
            {
                "iteration": int(saved["iteration"]),
                "budget": bare * expansion,
                "bought": int(counts.sum()),
                "bought_by_bucket": buckets,
                "rate": rate,
                "run_continuations": len(outcomes),
                "run_flips": sum(int(o[3]) for o in outcomes),
            }
        )
        rates.observe(trees, signal, bare_tokens)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "run_dir", type=Path, help="a run directory whose artifacts/trees hold iteration_*.json"
    )
    parser.add_argument("--worth", nargs="+", choices=WORTH, default=list(WORTH))
    parser.add_argument(
        "--expansion", type=int, default=2, help="N: continuations per bare rollout (default 2)"
    )
    parser.add_argument(
        "--confidence", type=float, nargs="+", default=[0.0], help="allocator.pricing.confidence values"
    )
    parser.add_argument(
        "--growth", type=float, nargs="+", default=[-1.0], help="allocator.pricing.growth values (-1: none)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    paths = sorted((args.run_dir / "artifacts" / "trees").glob("iteration_*.json"))
    if not paths:
        raise SystemExit(
            f"no saved trees under {args.run_dir / 'artifacts' / 'trees'}: replay needs a run made with the "
            "trees callback (callbacks=default) and the path of its run directory"
        )
    iterations = [json.loads(p.read_text()) for p in paths]
    result = {  # keyed by the rule: "leaves", "tokens", "leaves z=1" with a confidence, " growth=1" ...
        w + (f" z={z:g}" if z else "") + (f" growth={g:g}" if g >= 0 else ""): replay(
            iterations, Pricing(worth=w, confidence=z, growth=g if g >= 0 else None), args.expansion
        )
        for w in args.worth
        for z in args.confidence
        for g in args.growth
    }
    for w, rows in result.items():
        print(f"\nworth={w}: continuations bought of m * N, by bucket; the run's continuations and flips")
        for r in rows:
            rate = "-" if r["rate"] is None else f"{r['rate']:.4f}"
            bought = f"bought {r['bought']:3d} / {r['budget']:3d}"
            run = f"run {r['run_continuations']:3d} cont. {r['run_flips']:3d} flips"
            where = f"iteration {r['iteration']:3d}  rate {rate:>7}"
            print(f"  {where}  {bought}  {run}  {r['bought_by_bucket']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"run_dir": str(args.run_dir), "rows": result}, indent=1))


if __name__ == "__main__":
    main()
