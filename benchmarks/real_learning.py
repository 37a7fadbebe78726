"""Learning benchmark: `trace` vs `uniform` WITH policy updates, SmolLM2-135M-Instruct + LoRA on
search_qa (FanOutQA sub-questions, BM25 over 10k Wikipedia summaries), at the same leaf budget.

    python benchmarks/real_learning.py            # defaults below: ~15-25 min on 2 shared cores
    python benchmarks/real_learning.py --quick    # tiny random model on `chain`, seconds (the test suite)

1. The tasks are split once (seeded): `--held-out` tasks are never trained on; the rest form the pool.
2. Held-out success of the initial policy: `--eval-samples` episodes per held-out task.
3. Shared warm-up: `--warmup` iterations of `uniform` sampling without policy updates; the predictor
   head is fitted on their tree targets, so `trace` does not start from an untrained head.
4. Each method then starts from that same state (LoRA weights, head, fresh optimizer, same RNG seed,
   so the same first candidate pool) and runs `--iterations` iterations of: build the iteration
   (the library's RolloutDataModule path), then one optimizer step per micro-batch (policy loss +
   predictor MSE, as TraceModule.training_step computes it). Per iteration: effective ratio (share
   of sampled prompts with mixed outcomes), leaves, generated tokens, loss, seconds, phase split.
5. Held-out success after training, with the same sampling seed as before (paired by task).

A few iterations on a 135M model with a handful of leaves cannot show much learning: read the
held-out numbers with their standard errors. Sizes are flags and are written into the JSON.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    PhaseClock,
    TaskSubset,
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
from real_contrast import fit_head, iteration_row, make_data, sampling_of

from trace_lightning import allocation as alloc
from trace_lightning.allocation import Budget, BudgetLedger
from trace_lightning.engines.hf import HFEngine
from trace_lightning.iteration import Branch
from trace_lightning.module import TraceModule
from trace_lightning.runner import EpisodeLimits, ReActRunner

QUICK = {  # tiny random model on `chain`: exercises every step in seconds, learns nothing
    "model": "tiny",
    "leaves": 12,
    "pool": 8,
    "iterations": 2,
    "warmup": 1,
    "held_out": 8,
    "eval_samples": 2,
    "max_turns": 3,
    "max_new_tokens": 12,
    "max_episode_tokens": 96,
    "head_steps": 20,
    "lr": 1e-3,
}


def build(args: argparse.Namespace, tmp: str) -> tuple[TraceModule, Any]:
    """(module, environment) for `--model`: SmolLM2 on search_qa, or the tiny model on chain."""
    if args.model == "tiny":
        from trace_lightning.envs.chain import ChainEnv

        module = tiny_module(tmp, lr=args.lr, seed=args.seed, sampling=sampling_of(args))
        return module, ChainEnv(n_tasks=64, turns=3, seed=args.seed)
    from trace_lightning.envs.search_qa import SearchQAEnv
    from trace_lightning.models import prepare_smollm2

    lora = lora_config(args.lora_rank, ("q_proj", "k_proj", "v_proj", "o_proj"))
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    module = bench_module(prepare_smollm2(), optimizer, sampling_of(args), adapter=lora, width=64)
    # As in real_contrast.py: SmolLM2-135M rarely writes tags, so an untagged reply is its answer.
    return module, SearchQAEnv(split="answerable", reward="contains", untagged_reply="answer")


def split_tasks(env: Any, held_out: int, seed: int) -> tuple[set[int], set[int]]:
    ids = np.array(sorted(t.task_id for t in env.tasks()))
    if not 0 < held_out < len(ids):
        raise ValueError(f"--held-out {held_out} must be between 1 and {len(ids) - 1} ({len(ids)} tasks)")
    perm = np.random.default_rng(seed + 7).permutation(ids)
    return {int(i) for i in perm[held_out:]}, {int(i) for i in perm[:held_out]}


def held_out_success(module: TraceModule, env: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`eval_samples` episodes per held-out task, same sampling seed every time (paired comparison)."""
    engine = HFEngine(module.policy, module.tokenizer, max_batch_size=args.gen_batch)
    limits = EpisodeLimits(args.max_turns, args.max_episode_tokens)
    runner = ReActRunner(engine, module.tokenizer, env, sampling_of(args), limits)
    trees = [runner.new_tree(t) for t in sorted(runner.tasks)]
    ledger = BudgetLedger(Budget(len(trees) * args.eval_samples))
    ledger.reserve_leaves(len(trees) * args.eval_samples, "bare")
    start, rng_state = time.perf_counter(), torch.get_rng_state()
    torch.manual_seed(args.seed + 1)
    runner([Branch(t, 0, args.eval_samples, "bare") for t in trees], ledger, np.random.default_rng(0))
    torch.set_rng_state(rng_state)
    per_task = [float(np.mean([t.nodes[leaf].reward >= 0.5 for leaf in t.leaves()])) for t in trees]
    return {
        "success": float(np.mean(per_task)),
        "stderr": float(np.std(per_task, ddof=1) / np.sqrt(len(per_task))),
        "per_task": per_task,
        "generated_tokens": ledger.tokens_used,
        "seconds": time.perf_counter() - start,
    }


def trainable_state(module: TraceModule) -> dict[str, torch.Tensor]:
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k in names}


def update_norm(module: TraceModule, start: dict[str, torch.Tensor]) -> float:
    """L2 distance of the policy's trainable (LoRA) weights from where the method started."""
    now = trainable_state(module)
    return float(sum(((now[k] - start[k]) ** 2).sum() for k in now if not k.startswith("head.")) ** 0.5)


def warm_up(module: TraceModule, env: Any, args: argparse.Namespace) -> float | None:
    """Uniform iterations without policy updates; fit the head on their targets. Returns its MSE."""
    if args.warmup == 0:
        return None
    data = make_data(args, alloc.uniform(4), env, functools.partial(HFEngine, max_batch_size=args.gen_batch))
    data.collector.rng = np.random.default_rng(
        args.seed + 10_000
    )  # warm-up pools differ from the measured ones
    batches = [b for _ in range(args.warmup) for b in data.build_iteration(module)]
    return fit_head(module, batches, args.head_steps)


def run_method(module: TraceModule, allocator: Any, env: Any, args: argparse.Namespace) -> dict[str, Any]:
    clock = PhaseClock()
    instrument_module(module, clock)
    engines = TimedEngineFactory(args.engine, clock, args.gen_batch)
    data = make_data(args, TimedAllocator(allocator, clock), TimedEnv(env, clock), engines)
    optimizer = module.configure_optimizers()
    torch.manual_seed(args.seed)
    rows = []
    for _ in range(args.iterations):
        clock.reset()
        start = time.perf_counter()
        batches = data.build_iteration(module)
        row = iteration_row(data, time.perf_counter() - start)
        losses = train_iteration(module, optimizer, batches, clock, engines.engine)
        total = time.perf_counter() - start
        rows.append({**row, "loss": float(np.mean(losses)) if losses else None, "iteration_seconds": total})
        rows[-1]["phase_seconds"] = clock.split(total)
        rows[-1]["task_ids"] = [t.task_id for t in data.report.result.trees]
        print(f"  {allocator.name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    return {"iterations": rows, "phase_overlaps": clock.overlaps}


def summary(result: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    rows, after = result["iterations"], result["held_out_after"]
    diff = np.array(after["per_task"]) - np.array(before["per_task"])
    return {
        "effective_ratio": float(np.mean([r["effective_ratio"] for r in rows])),
        "mixed_per_100_leaves": float(
            np.mean([r["root_mixed_per_100"] + r["prefix_mixed_per_100"] for r in rows])
        ),
        "train_success": float(np.mean([r["success_rate"] for r in rows])),
        "leaves_per_iteration": [r["leaves"] for r in rows],
        "generated_tokens": float(np.sum([r["generated_tokens"] for r in rows])),
        "seconds_per_iteration": float(np.mean([r["iteration_seconds"] for r in rows])),
        "held_out_before": before["success"],
        "held_out_after": after["success"],
        "held_out_delta": float(diff.mean()),
        "held_out_delta_stderr": float(diff.std(ddof=1) / np.sqrt(len(diff))),
        "policy_update_norm": result["policy_update_norm"],
    }


COLUMNS = (  # (header, width, format, summary key)
    ("eff.ratio", 9, ".3f", "effective_ratio"),
    ("mixed/100", 9, ".1f", "mixed_per_100_leaves"),
    ("train succ", 10, ".3f", "train_success"),
    ("tokens", 7, ".0f", "generated_tokens"),
    ("s/iter", 7, ".1f", "seconds_per_iteration"),
    ("held-out before", 15, ".3f", "held_out_before"),
    ("after", 6, ".3f", "held_out_after"),
)


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    head = " ".join(f"{h:>{w}s}" for h, w, _, _ in COLUMNS)
    print(f"\n{'method':8s} {'leaves/it':>9s} {head} {'delta (+-se)':>15s} {'|dW|':>7s}")
    for name, s in summaries.items():
        leaves = "/".join(str(n) for n in sorted(set(s["leaves_per_iteration"])))
        cells = " ".join(f"{s[key]:{w}{fmt}}" for _, w, fmt, key in COLUMNS)
        delta = f"{s['held_out_delta']:+.3f} +-{s['held_out_delta_stderr']:.3f}"
        print(f"{name:8s} {leaves:>9s} {cells} {delta:>15s} {s['policy_update_norm']:7.3f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on chain, tiny sizes (overrides sizes)")
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2", help="tiny: random, on chain")
    p.add_argument("--methods", default="trace,uniform", help="comma-separated allocators")
    p.add_argument("--leaves", type=int, default=12, help="leaves per iteration, the same for every method")
    p.add_argument("--pool", type=int, default=12, help="candidate prompts per iteration")
    p.add_argument("--iterations", type=int, default=4, help="training iterations per method")
    p.add_argument("--warmup", type=int, default=1, help="shared uniform iterations that fit the head")
    p.add_argument("--held-out", type=int, default=16, help="tasks never trained on")
    p.add_argument("--eval-samples", type=int, default=2, help="episodes per held-out task")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-episode-tokens", type=int, default=768)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--lr", type=float, default=1e-4, help="policy (LoRA) learning rate; the head uses 1e-3")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--head-steps", type=int, default=200, help="head fitting steps after the warm-up")
    p.add_argument("--gen-batch", type=int, default=24)
    p.add_argument("--engine", default="hf", help="engine of the training iterations (eval: HFEngine)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/real_learning.json"))
    args = p.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        module, env = build(args, tmp)
    train_ids, held_ids = split_tasks(env, args.held_out, args.seed)
    train_env, held_env = TaskSubset(env, train_ids), TaskSubset(env, held_ids)
    print(f"{args.model} ready in {time.perf_counter() - t0:.1f} s; held-out before ...", flush=True)
    before = held_out_success(module, held_env, args)
    print(f"held-out success before: {before['success']:.3f} +-{before['stderr']:.3f}", flush=True)
    head_mse = warm_up(module, train_env, args)
    start_state = trainable_state(module)
    results, summaries = {}, {}
    for name in args.methods.split(","):
        allocator = {"trace": alloc.trace(2, max_per_prompt=4), "uniform": alloc.uniform(4)}[name]
        module.load_state_dict(copy.deepcopy(start_state), strict=False)
        results[name] = run_method(module, allocator, train_env, args)
        results[name]["policy_update_norm"] = update_norm(module, start_state)
        results[name]["held_out_after"] = held_out_success(module, held_env, args)
        summaries[name] = summary(results[name], before)
    print_table(summaries)
    wall = time.perf_counter() - t0
    print(f"\nwarm-up head MSE {head_mse}; total {wall:.0f} s; peak RSS {peak_rss_gib():.2f} GiB")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(train_tasks=len(train_ids), held_out_tasks=sorted(held_ids))
    out = {
        "config": config,
        "held_out_before": before,
        "warmup_head_mse": head_mse,
        "summary": summaries,
        "results": results,
        "wall_seconds": wall,
        "peak_rss_gib": peak_rss_gib(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
