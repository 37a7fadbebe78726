"""Cost profile of one TRACE training iteration: where the time goes, and how that grows with the leaf
budget L (M = L / (1 + N) bare rollouts), the continuation multiplier N and the turn count.

    python benchmarks/cost_profile.py            # tiny-model sweep on `chain` + one SmolLM2 search_qa point
    python benchmarks/cost_profile.py --no-smollm2   # the sweep alone (about a minute)
    python benchmarks/cost_profile.py --quick        # a few small points (the test suite runs this)

Each point runs full iterations of the library's own path, `RolloutDataModule.build_iteration` (trace
allocator) followed by one optimizer step per micro-batch and the engine's weight sync, with the
engine, environment, allocator and the module's scorer and pi_old pass wrapped in timing proxies
(benchmarks/common.py lists the phases). `other` is the iteration's wall time minus the named phases.
The target: allocation + predictor under 5% of the iteration.

The sweep uses a 2-layer random Qwen3 (hidden 64), whose generation is cheap, so its shares are an
upper bound for allocation (whose cost does not depend on the model) and a lower bound for
generation; the SmolLM2 point shows a real model on a real tool environment.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    PHASES,
    PhaseClock,
    TimedAllocator,
    TimedEngineFactory,
    TimedEnv,
    bench_module,
    instrument_module,
    lora_config,
    peak_rss_gib,
    tiny_module,
    train_iteration,
)

from trace_lightning import allocation as alloc
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.metrics import budget_spend
from trace_lightning.module import TraceModule

TARGET_SHARE = 0.05  # allocation + predictor, as a share of the iteration


@dataclass(frozen=True)
class Point:
    sweep: str  # which knob this point varies: budget, expansion, turns or pool
    model: str  # tiny or smollm2
    leaves: int
    expansion: int
    turns: int
    pool: int  # candidate prompts scored for Stage 1


def sweep_points(quick: bool, pool: int) -> list[Point]:
    """One knob at a time around a base point, each point listed once (the base belongs to `budget`).
    The N sweep keeps M = L / (1 + N) fixed, so L grows with N."""
    leaves, n, turns = (12, 2, 3) if quick else (24, 2, 4)
    budgets, expansions, turn_counts = (
        ([12, 24], [1], [2]) if quick else ([12, 24, 48, 96], [1, 3, 5], [2, 6])
    )
    pools = [] if quick else [8, 128]
    pts = [Point("budget", "tiny", b, n, turns, pool) for b in budgets]
    pts += [Point("expansion", "tiny", leaves * (1 + e) // (1 + n), e, turns, pool) for e in expansions]
    pts += [Point("turns", "tiny", leaves, n, t, pool) for t in turn_counts]
    return pts + [Point("pool", "tiny", leaves, n, turns, p) for p in pools]


def run_point(
    point: Point, module: TraceModule, env: Any, sampling: SamplingParams, args: argparse.Namespace
) -> dict[str, Any]:
    clock = PhaseClock()
    instrument_module(module, clock)
    engines = TimedEngineFactory(args.engine, clock, args.gen_batch)
    data = RolloutDataModule(
        env=TimedEnv(env, clock),
        allocator=TimedAllocator(alloc.trace(point.expansion, max_per_prompt=4), clock),  # type: ignore[arg-type]
        engine=engines,
        sampling=sampling,
        budget=Budget(point.leaves),
        settings=DataSettings(
            pool_size=point.pool,
            micro_batch_size=4,
            micro_batch_tokens=None,
            max_turns=point.turns,
            max_episode_tokens=args.max_episode_tokens if point.model == "tiny" else 768,
            steps_per_iteration=None,  # one optimizer step per micro-batch, as train_iteration runs them
        ),
        seed=args.seed,
    )
    optimizer = module.configure_optimizers()
    torch.manual_seed(args.seed)
    iters = []
    for i in range(args.warmup_iterations + args.iterations):
        clock.reset()
        start = time.perf_counter()
        batches = data.build_iteration(module)
        train_iteration(module, optimizer, batches, clock, engines.engine)
        total = time.perf_counter() - start
        if i >= args.warmup_iterations:  # the first iteration pays one-off costs (index build, caches)
            rep = data.report
            iters.append(
                {
                    "seconds": clock.split(total),
                    "total": total,
                    "leaves": rep.result.ledger.leaves_used,
                    "generated_tokens": rep.result.ledger.tokens_used,
                    # the other budget units; its seconds by phase are the PhaseClock's
                    "prefill_tokens": budget_spend(rep)["budget/prefill_tokens"],
                    "tool_calls": budget_spend(rep)["budget/tool_calls"],
                    "turns": rep.counters.turns,
                    "env_steps": clock.calls["env"],
                    "sync_calls": clock.calls["sync"],
                    "details": dict(clock.details),
                }
            )
    return summarise(point, iters, clock.overlaps)


def summarise(point: Point, iters: list[dict[str, Any]], overlaps: int) -> dict[str, Any]:
    total = float(np.mean([it["total"] for it in iters]))
    seconds = {k: float(np.mean([it["seconds"][k] for it in iters])) for k in (*PHASES, "other")}
    shares = {k: v / total for k, v in seconds.items()}
    details = {k: float(np.mean([it["details"].get(k, 0.0) for it in iters])) for k in iters[0]["details"]}
    control = shares["allocation"] + shares["predictor"]
    return {
        **vars(point),
        "bare_rollouts": point.leaves // (1 + point.expansion),
        "iterations": len(iters),
        "seconds_per_iteration": total,
        "seconds": seconds,
        "shares": shares,
        "predictor_split_seconds": details,
        "alloc_plus_predictor_share": control,
        "target_met": bool(control < TARGET_SHARE),
        "leaves_per_iteration": [it["leaves"] for it in iters],
        "generated_tokens": float(np.mean([it["generated_tokens"] for it in iters])),
        "prefill_tokens": float(np.mean([it["prefill_tokens"] for it in iters])),
        "tool_calls": float(np.mean([it["tool_calls"] for it in iters])),
        "policy_turns": float(np.mean([it["turns"] for it in iters])),
        "sync_calls": [it["sync_calls"] for it in iters],
        "phase_overlaps": overlaps,
    }


def tiny_sweep(args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    rows = []
    for k, point in enumerate(sweep_points(args.quick, args.pool)):
        module = tiny_module(f"{tmp}/tiny{k}", lr=1e-3, seed=args.seed, sampling=sampling)
        env = ChainEnv(n_tasks=max(256, point.pool), turns=point.turns, seed=args.seed)
        rows.append(run_point(point, module, env, sampling, args))
        print_row(rows[-1])
    return rows


def smollm2_point(args: argparse.Namespace) -> dict[str, Any]:
    import functools

    from trace_lightning.envs.search_qa import SearchQAEnv
    from trace_lightning.models import prepare_smollm2

    lora = lora_config(16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-5)
    sampling = SamplingParams(max_new_tokens=48, temperature=0.8, top_p=1.0)
    module = bench_module(prepare_smollm2(), optimizer, sampling, adapter=lora, width=64)
    env = SearchQAEnv(split="answerable", reward="contains", untagged_reply="answer")
    point = Point("real", "smollm2", args.smollm2_leaves, 2, 3, args.smollm2_pool)
    row = run_point(point, module, env, sampling, args)
    print_row(row)
    return row


HEADER = (
    f"{'point':32s} {'M':>3s} {'s/iter':>7s} "
    + " ".join(f"{p[:8]:>8s}" for p in (*PHASES, "other"))
    + f" {'alloc+pred':>10s} target {'pred:roots':>10s}"
)


def label(r: dict[str, Any]) -> str:
    return f"{r['model']} L={r['leaves']} N={r['expansion']} T={r['turns']} P={r['pool']}"


def print_row(r: dict[str, Any]) -> None:
    shares = " ".join(f"{100 * r['shares'][p]:7.2f}%" for p in (*PHASES, "other"))
    verdict = "PASS" if r["target_met"] else "MISS"
    pred = r["seconds"]["predictor"]
    roots = r["predictor_split_seconds"].get("predictor_roots", 0.0) / pred if pred > 0 else float("nan")
    print(
        f"{label(r):32s} {r['bare_rollouts']:3d} {r['seconds_per_iteration']:7.2f} {shares} "
        f"{100 * r['alloc_plus_predictor_share']:9.2f}% {verdict:6s} {100 * roots:9.0f}%",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    left = np.zeros(len(rows))
    # allocation and predictor first, so their sum reads directly against the dotted 5% line
    order = ("allocation", "predictor", *(p for p in PHASES if p not in ("allocation", "predictor")), "other")
    for phase in order:
        share = np.array([100 * r["shares"][phase] for r in rows])
        ax.barh(labels, share, left=left, label=phase)
        left += share
    ax.axvline(100 * TARGET_SHARE, color="k", lw=0.8, ls=":")
    ax.set_xlabel("share of iteration wall time (%)")
    ax.invert_yaxis()
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.set_title("TRACE iteration cost profile (dotted: 5%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few small tiny-model points, one iteration each")
    p.add_argument("--iterations", type=int, default=None, help="measured iterations per point (3; quick 1)")
    p.add_argument("--warmup-iterations", type=int, default=None, help="unmeasured first ones (1; quick 0)")
    p.add_argument("--pool", type=int, default=32, help="candidate prompts per iteration (tiny sweep base)")
    p.add_argument("--max-episode-tokens", type=int, default=256, help="tiny sweep")
    p.add_argument("--gen-batch", type=int, default=24, help="engine max_batch_size")
    p.add_argument("--engine", default="hf", help="generation engine (benchmarks/common.py ENGINES)")
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=None, help="(full: on)")
    p.add_argument("--smollm2-leaves", type=int, default=12)
    p.add_argument("--smollm2-pool", type=int, default=12)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cost_profile.json"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/cost_profile.png"))
    args = p.parse_args()
    args.iterations = args.iterations or (1 if args.quick else 3)
    if args.warmup_iterations is None:
        args.warmup_iterations = 0 if args.quick else 1
    args.smollm2 = (not args.quick) if args.smollm2 is None else args.smollm2
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        rows = tiny_sweep(args, tmp)
    if args.smollm2:
        rows.append(smollm2_point(args))
    passed = sum(r["target_met"] for r in rows)
    print(f"\nallocation + predictor < {100 * TARGET_SHARE:.0f}% of the iteration: {passed}/{len(rows)} PASS")
    wall = time.perf_counter() - t0
    print(f"total {wall:.0f} s; peak RSS {peak_rss_gib():.2f} GiB")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {"config": config, "rows": rows, "wall_seconds": wall, "peak_rss_gib": peak_rss_gib()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(rows, args.plot)


if __name__ == "__main__":
    main()
