"""One iteration of the default job with each engine, side by side in one process.

    .venv-vllm/bin/python benchmarks/engine_iteration.py --warm-start outputs/warm_start/<run>/model
    .venv-vllm/bin/python benchmarks/engine_iteration.py --quick    # tiny random model on chain, seconds

The job is the CLI's own: `conf/train.yaml` composed as `python -m trace_lightning.trainer` composes it
(SmolLM2-135M + LoRA, search_qa, trace, 12 leaves, the predictor refit, ...), built by `trainer.build`,
with `engine=auto`'s two alternatives built from their own config groups (`engine.vllm`, `engine.hf`).
One collector and one module serve both: every timed iteration starts from the same saved state
(weights, optimizer, collector RNGs, prior, refit replay) after one untimed iteration (the cold start),
so both engines sample the same second iteration of the job. Per iteration: the collector's whole
`collect` (engine weight sync, root and prefix scoring, generation, environment, refit, old log-probs)
and one optimizer step per micro-batch, as the Trainer runs them (benchmarks/common.py
`train_iteration`). The engines alternate over `--reps` rounds, so background load hits both alike;
each round samples with a seed of its own (the same for both engines), since the two engines draw
different tokens, and with them different episode lengths, from one seed.

Printed: seconds per iteration and per phase for each engine, and vLLM / transformers (target <= 0.8).
JSON in benchmarks/results/engine_iteration.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import PhaseClock, TimedEngine, TimedEnv, instrument_module, peak_rss_gib, train_iteration
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from trace_lightning import config
from trace_lightning import trainer as cli
from trace_lightning.engines.vllm import _quiet_partial_reload
from trace_lightning.runner import ReActRunner

ENGINES = ("hf", "vllm")
TARGET = 0.8  # a vLLM iteration at most this share of a transformers one
EXTRA = ("refit",)  # timed here besides common.PHASES


def job_config(args: argparse.Namespace, run_dir: Path) -> Any:
    overrides = [f"run_dir={run_dir}", "logger=none", "callbacks=none", *args.override]
    if args.quick:
        overrides += ["debug=fast", "budget.leaves=12", "data.pool_size=8"]
    elif args.warm_start:
        overrides.append(f"model.warm_start={args.warm_start}")
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


class Arm:
    """One engine's runner over the shared collector."""

    def __init__(self, name: str, collector: Any, module: Any, factory: Any, clock: PhaseClock) -> None:
        engine = TimedEngine(factory(model=module.rollout_policy, tokenizer=module.tokenizer), clock)
        self.name, tokenizer = name, module.tokenizer
        self.runner = ReActRunner(engine, tokenizer, collector.env, collector.sampling, collector.limits)

    def collect(self, collector: Any, module: Any) -> list[Any]:
        """The collector's iteration with this engine. The engine is treated as stale, as it is at every
        iteration of the job (the previous one trained the policy), so each iteration pays its sync."""
        collector.runner, collector._engine_version = self.runner, math.nan
        return collector.collect(module)


def snapshot(module: Any, optimizer: Any, collector: Any) -> dict[str, Any]:
    return copy.deepcopy(
        {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "data": collector.state_dict()}
    )


def restore(state: dict[str, Any], module: Any, optimizer: Any, collector: Any) -> None:
    state = copy.deepcopy(state)
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    collector.load_state_dict(state["data"])


def timed_iteration(arm: Arm, module: Any, optimizer: Any, collector: Any, clock: PhaseClock) -> dict:
    clock.reset()
    start = time.perf_counter()
    batches = arm.collect(collector, module)
    train_iteration(module, optimizer, batches, clock, engine=None)
    total = time.perf_counter() - start
    report = collector.report
    seconds = clock.split(total)
    for name in EXTRA:
        seconds[name] = clock.seconds.get(name, 0.0)
        seconds["other"] -= seconds[name]
    return {
        "total": total,
        "seconds": seconds,
        "calls": dict(clock.calls),
        "leaves": report.result.ledger.leaves_used,
        "generated_tokens": report.result.ledger.tokens_used,
        "turns": report.counters.turns,
        "batches": len(batches),
        "sync_seconds": report.sync_seconds,
        "logprob_mismatch": report.logprob_mismatch,
    }


def time_refit(collector: Any, clock: PhaseClock) -> None:
    fit = collector.predictor_fit
    if fit is not None:
        fit.fit = clock.wrap("refit", fit.fit)  # type: ignore[method-assign]


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The timed iterations of each engine, and the vLLM engine's sync split."""
    cfg = job_config(args, run_dir)
    module, data, _ = cli.build(cfg)
    collector, clock = data.collector, PhaseClock()
    collector.env = TimedEnv(collector.env, clock)
    instrument_module(module, clock)
    time_refit(collector, clock)
    optimizer = module.configure_optimizers()
    arms = {name: Arm(name, collector, module, instantiate(cfg.engine[name]), clock) for name in ENGINES}
    start_state = snapshot(module, optimizer, collector)
    for name in ENGINES:  # the cold-start iteration, untimed: warms each engine up
        restore(start_state, module, optimizer, collector)
        timed_iteration(arms[name], module, optimizer, collector, clock)
    state = snapshot(module, optimizer, collector)  # after iteration 0 (with the last engine's samples)
    rows: dict[str, list[dict]] = {name: [] for name in ENGINES}
    for rep in range(args.reps):
        # Each repetition samples with its own seed (both engines the same one): the engines draw
        # different tokens from the same seed, so it takes several draws to compare like with like.
        rep_state = {
            **state,
            "data": {**state["data"], "torch_rng": torch.Generator().manual_seed(rep).get_state()},
        }
        for name in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            restore(rep_state, module, optimizer, collector)
            rows[name].append(timed_iteration(arms[name], module, optimizer, collector, clock))
            total, tokens = rows[name][-1]["total"], rows[name][-1]["generated_tokens"]
            print(f"  rep {rep} {name:4s}: {total:6.1f} s, {tokens} tokens", flush=True)
    vllm = arms["vllm"].runner.engine.inner
    return {"rows": rows, "sync": sync_split(vllm, 3) if vllm.is_lora and vllm.lora_sync == "merged" else {}}


def sync_split(engine: Any, reps: int) -> dict[str, list[float]]:
    """Seconds to push the merged policy into vLLM: every weight (what each sync once did)
    against the modules that hold LoRA layers only (what a sync after the first does now), alternating."""
    seconds: dict[str, list[float]] = {"all_weights": [], "adapted_only": []}
    for rep in range(reps):
        for name in ("all_weights", "adapted_only") if rep % 2 == 0 else ("adapted_only", "all_weights"):
            start, engine.last_sync_tensors = time.perf_counter(), 0
            weights = engine._full_weights(adapted_only=name == "adapted_only")
            with _quiet_partial_reload():
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            seconds[name].append(time.perf_counter() - start)
            seconds[f"{name}_tensors"] = [engine.last_sync_tensors]
    return seconds


def summary(rows: dict[str, list[dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, its in rows.items():
        phases = its[0]["seconds"].keys()
        out[name] = {
            "seconds_per_iteration": float(np.mean([it["total"] for it in its])),
            "median_seconds": float(np.median([it["total"] for it in its])),
            "phases": {p: float(np.mean([it["seconds"][p] for it in its])) for p in phases},
            "generated_tokens": float(np.mean([it["generated_tokens"] for it in its])),
            "turns": float(np.mean([it["turns"] for it in its])),
        }
    out["vllm_over_hf"] = out["vllm"]["seconds_per_iteration"] / out["hf"]["seconds_per_iteration"]
    out["vllm_over_hf_median"] = out["vllm"]["median_seconds"] / out["hf"]["median_seconds"]
    return out


def print_table(result: dict[str, Any]) -> None:
    phases = list(result["hf"]["phases"])
    print(f"\n{'phase':14s} {'hf s':>8s} {'vllm s':>8s} {'vllm/hf':>8s}")
    for p in [*phases, "iteration"]:
        hf = result["hf"]["phases"].get(p, result["hf"]["seconds_per_iteration"])
        vl = result["vllm"]["phases"].get(p, result["vllm"]["seconds_per_iteration"])
        ratio = f"{vl / hf:8.2f}" if hf > 0 else f"{'-':>8s}"
        print(f"{p:14s} {hf:8.2f} {vl:8.2f} {ratio}")
    for name in ("hf", "vllm"):
        its = [f"{it['total']:.1f}" for it in result["iterations"][name]]
        print(f"{name} iterations (s): {', '.join(its)}; median {result[name]['median_seconds']:.1f}")
    split = result["sync_split"]
    if split:
        print(
            f"vLLM sync, merged LoRA: all weights {np.mean(split['all_weights']):.2f} s "
            f"({split['all_weights_tensors'][0]} tensors), adapted modules only "
            f"{np.mean(split['adapted_only']):.2f} s ({split['adapted_only_tensors'][0]} tensors)"
        )
    ratio, verdict = result["vllm_over_hf"], "PASS" if result["vllm_over_hf"] <= TARGET else "MISS"
    print(f"vLLM / transformers iteration time: {ratio:.2f}x (target <= {TARGET}: {verdict})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm-start", default=None, help="model.warm_start of the job (else SmolLM2 as shipped)")
    p.add_argument("--reps", type=int, default=6, help="timed iterations per engine, alternating")
    p.add_argument("--quick", action="store_true", help="tiny random model on the chain task (debug=fast)")
    p.add_argument("--override", nargs="*", default=[], help="more key=value overrides of the job")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_iteration.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.manual_seed(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        measured = run(args, Path(tmp) / "run")
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **summary(measured["rows"]),
        "iterations": measured["rows"],
        "sync_split": measured["sync"],
        "peak_rss_gib": peak_rss_gib(),
        "wall_seconds": time.perf_counter() - start,
    }
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
