"""Real-model contrast benchmark: SmolLM2-135M-Instruct + LoRA on search_qa (FanOutQA sub-questions,
BM25 over 10k Wikipedia summaries), every allocator at the same leaf budget, measured in one run.

    python benchmarks/real_contrast.py                      # defaults below, ~20 min on 2 cores
    python benchmarks/real_contrast.py --iterations 1 --warmup 1 --leaves 12   # a quick look

1. Warm-up: `--warmup` iterations with `uniform` allocation; the predictor head is fitted on their
   tree targets (V̂, leaf-count weights). The policy is not trained in this benchmark, so every
   allocator samples from the same policy and the comparison isolates allocation.
2. Each allocator then runs `--iterations` iterations from the same RNG seed (the same candidate
   pools), starting from the warm-up head and refitting it online after each iteration.
3. A LoRA training step over the last `trace` batch measures the memory of a full iteration.

Reported per allocator: effective ratio, mixed anchors per 100 leaves (root / prefix), success rate,
generated tokens, seconds per iteration; process peak RSS. JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import resource
import time
from pathlib import Path

import numpy as np
import torch
from common import bench_module
from peft import LoraConfig

from trace_lightning import allocation as alloc
from trace_lightning.batching import RolloutBatch
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.search_qa import SearchQAEnv
from trace_lightning.losses import predictor_mse
from trace_lightning.models import prepare_smollm2
from trace_lightning.module import TraceModule
from trace_lightning.tree import tree_stats


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def make_data(args, allocator: alloc.TreeAllocator, env: SearchQAEnv, engine=None) -> RolloutDataModule:
    """The DataModule both real-model benchmarks sample with; `engine` defaults to the HF engine."""
    return RolloutDataModule(
        env=env,
        allocator=allocator,
        engine=engine or functools.partial(HFEngine, max_batch_size=args.gen_batch),
        sampling=sampling_of(args),
        budget=Budget(args.leaves),
        settings=DataSettings(
            pool_size=args.pool,
            micro_batch_size=4,
            micro_batch_tokens=None,
            max_turns=args.max_turns,
            max_episode_tokens=args.max_episode_tokens,
            steps_per_iteration=None,  # its own loop: one step over the iteration's micro-batches
        ),
        seed=args.seed,
    )


def sampling_of(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0)


def fit_head(module: TraceModule, batches: list[RolloutBatch], steps: int) -> float:
    """Predictor-only updates on fixed targets; returns the final weighted MSE."""
    hidden = []
    with torch.no_grad():
        for b in batches:
            if b.pred_targets.numel():
                h = module._forward(module.policy, b.input_ids, b.attention_mask)[1]
                hidden.append((h[b.pred_rows, b.pred_cols], b.pred_targets, b.pred_weights))
    x, y, w = (torch.cat(parts) for parts in zip(*hidden, strict=True))
    opt = torch.optim.Adam(module.head.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = predictor_mse(torch.sigmoid(module.head(x)), y, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def iteration_row(data: RolloutDataModule, seconds: float) -> dict[str, float]:
    res = data.report.result
    stats = [tree_stats(t) for t in res.trees]
    leaves = res.ledger.leaves_used
    rewards = [t.nodes[leaf].reward for t in res.trees for leaf in t.leaves()]
    return {
        "effective_ratio": float(np.mean([s.mixed for s in stats])),
        "root_mixed_per_100": 100 * sum(s.mixed_by_depth[0] for s in stats) / leaves,
        "prefix_mixed_per_100": 100 * sum(sum(s.mixed_by_depth[1:]) for s in stats) / leaves,
        "success_rate": float(np.mean(rewards)),
        "prompts": len(res.trees),
        "leaves": leaves,
        "generated_tokens": res.ledger.tokens_used,
        "seconds": seconds,
    }


def run_allocator(args, module, env, allocator, head_state) -> tuple[dict[str, float], list[RolloutBatch]]:
    module.head.load_state_dict(head_state)
    data = make_data(args, allocator, env)
    torch.manual_seed(args.seed)
    rows, batches = [], []
    for _ in range(args.iterations):
        start = time.perf_counter()
        batches = data.build_iteration(module)
        rows.append(iteration_row(data, time.perf_counter() - start))
        fit_head(module, batches, args.head_steps)
        print(f"  {allocator.name}: {rows[-1]}", flush=True)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return mean, batches


def training_step_memory(module: TraceModule, batches: list[RolloutBatch]) -> tuple[float, float]:
    """One LoRA optimizer step over an iteration's micro-batches: (seconds, peak RSS GiB)."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)
    start = time.perf_counter()
    for b in batches:
        module.training_step(b, 0).backward()
    opt.step()
    return time.perf_counter() - start, peak_rss_gib()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leaves", type=int, default=24, help="leaves per iteration for every allocator")
    p.add_argument("--pool", type=int, default=24, help="candidate prompts per iteration")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-episode-tokens", type=int, default=768)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--gen-batch", type=int, default=24)
    p.add_argument("--head-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/real_contrast.json"))
    args = p.parse_args()
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    lora = LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-5)
    module = bench_module(prepare_smollm2(), optimizer, sampling_of(args), adapter=lora, width=64)
    # SmolLM2-135M rarely writes action tags: a reply without one is its final answer, scored by whether
    # it contains the gold answer (EM on a sentence would always be 0). See docs/search-qa.md.
    env = SearchQAEnv(split="answerable", reward="contains", untagged_reply="answer")
    print(f"model + env ready in {time.perf_counter() - t0:.1f} s; warm-up ...", flush=True)
    warm = make_data(args, alloc.uniform(4), env)
    warm.collector.rng = np.random.default_rng(
        args.seed + 10_000
    )  # warm-up pools differ from the measured ones
    batches = [b for _ in range(args.warmup) for b in warm.build_iteration(module)]
    print(f"warm-up head MSE {fit_head(module, batches, args.head_steps * 2):.4f}", flush=True)
    head_state = copy.deepcopy(module.head.state_dict())
    allocators = [alloc.uniform(4), alloc.pcl(4), alloc.random_expand(2, 2), alloc.trace(2, max_per_prompt=4)]
    results, last = {}, []
    for allocator in allocators:
        results[allocator.name], last = run_allocator(args, module, env, allocator, head_state)
    step_s, step_peak = training_step_memory(module, last)
    base = results["uniform"]["effective_ratio"]
    print(
        f"\n{'allocator':15s} {'eff.ratio':>9s} {'x uniform':>9s} {'root/100':>8s} {'prefix/100':>10s} "
        f"{'success':>7s} {'tokens':>7s} {'s/iter':>7s}"
    )
    for name, r in results.items():
        ratio = r["effective_ratio"] / base if base else float("nan")
        print(
            f"{name:15s} {r['effective_ratio']:9.3f} {ratio:9.2f} {r['root_mixed_per_100']:8.1f} "
            f"{r['prefix_mixed_per_100']:10.1f} {r['success_rate']:7.3f} {r['generated_tokens']:7.0f} "
            f"{r['seconds']:7.1f}"
        )
    print(
        f"\nLoRA training step over the last trace batch: {step_s:.1f} s; "
        f"process peak RSS {step_peak:.2f} GiB"
    )
    print(f"total {time.perf_counter() - t0:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {"config": config, "results": results, "train_step_seconds": step_s, "peak_rss_gib": step_peak}
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
