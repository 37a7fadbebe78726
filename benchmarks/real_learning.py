"""Learning with a real model on the search agent: `trace` vs `uniform` through the product's own
training loop (`experiment=search_qa`), from the supervised warm start (SmolLM2-135M-Instruct + LoRA
on search_qa, the default token-F1 reward). The default job's task, math_tool, is
`benchmarks/real_task.py`'s.

    python -m trace_lightning.warmstart run_dir=outputs/warm_start/smollm2-search_qa  # make run
    python benchmarks/real_learning.py --warm-start outputs/warm_start/smollm2-search_qa/model
    python benchmarks/real_learning.py --quick    # tiny random model on `chain`, seconds (the test suite)

1. The config is the CLI's own: Hydra composes `conf/train.yaml` with a few overrides (allocator, sizes,
   `model.warm_start`, no logger and no callbacks), and `trace_lightning.trainer.build` returns the
   TraceModule, RolloutDataModule and Lightning Trainer that `python -m trace_lightning.trainer` fits.
2. The tasks are split with the warm start's rule (`warmstart.split_tasks`, same seed, `--held-out`
   tasks): the held-out tasks were never demonstrated and are never sampled for training here.
3. Held-out success of the start: `--eval-samples` episodes per held-out task at the training
   temperature, with a torch seed used nowhere else, restored afterwards.
4. Each method is built afresh from the same config but its allocator (same seed: same LoRA init, same
   first candidate pool) and fitted for `--iterations` epochs (one epoch = one TRACE iteration, the
   predictor's cold start and refit included). Per iteration, a callback reads `datamodule.report`
   through `metrics.rollout_metrics`, the function the product logs with.
5. Held-out success after, with the same sampling seed as before: paired by task, so the standard
   error of the gain is that of the per-task differences.
Every size is a flag and is written into the JSON; so are the figures per iteration.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from common import TaskSubset, peak_rss_gib
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from trace_lightning import config, model_folder
from trace_lightning import warmstart as ws
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.engines.hf import HFEngine
from trace_lightning.iteration import Branch
from trace_lightning.metrics import BUDGET_UNITS, budget_row, rollout_metrics, running_sums
from trace_lightning.module import TraceModule
from trace_lightning.runner import ReActRunner
from trace_lightning.trainer import build
from trace_lightning.tree import SUCCESS

QUICK = {  # tiny random model on `chain`: every step of the protocol in seconds; it learns nothing
    "quick": True,
    "warm_start": None,
    "leaves": 12,
    "pool": 8,
    "iterations": 2,
    "held_out": 8,
    "eval_samples": 2,
    "max_new_tokens": 12,
    "max_episode_tokens": 96,
}


def split_tasks(env: Any, held_out: int, seed: int) -> tuple[set[int], set[int]]:
    """(training ids, held-out ids), the warm start's split: a warm start made with the same seed and
    `held_out` never saw these held-out tasks."""
    if held_out < 1:
        raise ValueError(f"--held-out {held_out} must be >= 1: the benchmark measures held-out success")
    return ws.split_tasks([t.task_id for t in env.tasks()], held_out, seed)


def overrides(args: argparse.Namespace, allocator: str, run_dir: str) -> list[str]:
    """The command-line overrides that turn the default job into this benchmark's run of `allocator`."""
    out = [
        f"allocator={allocator}",
        f"run_dir={run_dir}",
        f"seed={args.seed}",
        f"engine={args.engine}",
        "logger=none",
        "callbacks=none",  # the benchmark's Recorder reads each iteration; no checkpoints, no artifacts
        f"trainer.max_epochs={args.iterations}",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false",
        "++trainer.enable_checkpointing=false",
        f"budget.leaves={args.leaves}",
        f"data.pool_size={args.pool}",
        f"data.held_out={args.held_out}",  # the collector's split: the same seeded rule as split_tasks below
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"data.max_episode_tokens={args.max_episode_tokens}",
    ]
    if args.lr is not None:
        out.append(f"optimizer.lr={args.lr}")
    if args.quick:  # as debug=fast: a random 2-layer model on the chain task, full weights
        tiny = f"model.out_dir={Path(run_dir).parent}/tiny_model"  # one folder: every method, same start
        return [*out, "model=tiny", tiny, "env=chain", "adapter=none"]
    out.insert(0, "experiment=search_qa")  # the search agent's job (the default job was it when measured)
    if args.warm_start is not None:
        out.append(f"model.warm_start={Path(args.warm_start).resolve()}")
    return out


def compose_config(args: argparse.Namespace, allocator: str, run_dir: str) -> DictConfig:
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides(args, allocator, run_dir))


class Recorder(L.Callback):
    """One row per iteration from `datamodule.report` (the figures the product logs) and the step loss."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._last = time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last = time.perf_counter()  # before the first iteration is sampled

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()  # the iteration's sampling is done: training starts

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        report = trainer.datamodule.report  # type: ignore[attr-defined]
        m = rollout_metrics(report)
        loss = trainer.callback_metrics.get("train/loss")
        now = time.perf_counter()  # an epoch end to the next: sampling, refit and training
        self.rows.append(
            {
                "iteration": report.iteration,
                "leaves": int(m["budget/leaves"]),
                "tokens": int(m["budget/tokens"]),
                "prompts": int(m["rollout/prompts"]),
                "success_rate": m["rollout/success_rate"],
                "turns_mean": m["rollout/turns_mean"],
                "effective_ratio": m["rollout/effective_ratio"],
                "root_mixed_per_100": m["rollout/mixed_root_per_100_leaves"],
                "prefix_mixed_per_100": m["rollout/mixed_prefix_per_100_leaves"],
                "loss": float(loss) if loss is not None else None,
                "sample_seconds": report.sample_seconds,
                "iteration_seconds": now - self._last,
                "task_ids": sorted({t.task_id for t in report.result.trees}),
                # every budget unit: prefill tokens, tool calls, seconds by phase
                **budget_row(report, now - self._epoch_start),
            }
        )
        self._last = now
        r = self.rows[-1]
        print(
            f"  iteration {r['iteration']}: success {r['success_rate']:.3f}, turns {r['turns_mean']:.2f}, "
            f"eff {r['effective_ratio']:.3f}, prefix-mixed/100 {r['prefix_mixed_per_100']:.1f}, "
            f"{r['iteration_seconds']:.0f} s",
            flush=True,
        )


def held_out_success(
    module: TraceModule, env: Any, collector: Any, samples: int, seed: int
) -> dict[str, Any]:
    """`samples` episodes per held-out task with the run's own sampling settings and episode limits (the
    collector's) and a torch seed of its own (the caller's RNG state is restored), so that before and
    after differ only through the policy."""
    engine = HFEngine(module.policy, module.tokenizer, max_batch_size=32)
    runner = ReActRunner(engine, module.tokenizer, env, collector.sampling, collector.limits)
    trees = [runner.new_tree(t) for t in sorted(runner.tasks)]
    ledger = BudgetLedger(Budget(len(trees) * samples))
    ledger.reserve_leaves(len(trees) * samples, "bare")
    start, state = time.perf_counter(), torch.get_rng_state()
    torch.manual_seed(1_000_000 + seed)
    runner([Branch(t, 0, samples, "bare") for t in trees], ledger, np.random.default_rng(seed))
    torch.set_rng_state(state)
    per_task = [float(np.mean([t.nodes[x].reward >= SUCCESS for x in t.leaves()])) for t in trees]
    turns = [t.nodes[x].depth for t in trees for x in t.leaves()]
    return {
        "success": float(np.mean(per_task)),
        "stderr": float(np.std(per_task, ddof=1) / np.sqrt(len(per_task))),
        "per_task": per_task,
        "task_ids": [t.task_id for t in trees],
        "mean_turns": float(np.mean(turns)),
        "seconds": time.perf_counter() - start,
    }


def trainable_sum(module: TraceModule) -> float:
    """A fingerprint of the start: every method must begin from the same weights for the pairing."""
    return float(sum(p.detach().double().sum() for p in module.policy.parameters() if p.requires_grad))


def run_method(name: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Build the product's module, DataModule and Trainer for allocator `name` and fit it, with the
    held-out tasks taken out of the training environment; held-out success before and after."""
    cfg = compose_config(args, name, f"{tmp}/{name}")
    module, data, trainer = build(cfg)
    collector = data.collector  # it builds its runner from `env` when the fit starts
    env = collector.env
    train_ids, held_ids = split_tasks(env, args.held_out, args.seed)
    collector.env, held_env = TaskSubset(env, train_ids), TaskSubset(env, held_ids)
    start = trainable_sum(module)
    before = held_out_success(module, held_env, collector, args.eval_samples, args.seed)
    print(f"  held-out success before: {before['success']:.3f} +-{before['stderr']:.3f}", flush=True)
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    clock = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_seconds = time.perf_counter() - clock
    after = held_out_success(module, held_env, collector, args.eval_samples, args.seed)
    print(f"  held-out success after: {after['success']:.3f} +-{after['stderr']:.3f}", flush=True)
    return {
        "iterations": running_sums(recorder.rows),
        "held_out_before": before,
        "held_out_after": after,
        "start_fingerprint": start,
        "train_tasks": len(train_ids),
        "fit_seconds": fit_seconds,
    }


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures for one method: means over iterations, the paired held-out gain with its s.e."""
    rows, before, after = run["iterations"], run["held_out_before"], run["held_out_after"]
    diff = np.array(after["per_task"]) - np.array(before["per_task"])  # [held-out tasks]
    leaves = sum(r["leaves"] for r in rows)
    return {
        "mean_turns": float(np.mean([r["turns_mean"] for r in rows])),
        # mixed nodes at depth >= 1 per 100 leaves over the whole run (the per-iteration rates, leaf-weighted)
        "prefix_mixed_per_100": float(sum(r["prefix_mixed_per_100"] * r["leaves"] for r in rows) / leaves),
        "root_mixed_per_100": float(sum(r["root_mixed_per_100"] * r["leaves"] for r in rows) / leaves),
        "effective_ratio": float(np.mean([r["effective_ratio"] for r in rows])),
        "train_success": [r["success_rate"] for r in rows],
        "heldout_before": before["success"],
        "heldout_after": after["success"],
        "heldout_delta": float(diff.mean()),
        "heldout_delta_se": float(diff.std(ddof=1) / np.sqrt(len(diff))),
        "leaves_per_iteration": [r["leaves"] for r in rows],
        "tokens": int(sum(r["tokens"] for r in rows)),
        "totals": {unit: rows[-1][f"{unit}_cum"] for unit in BUDGET_UNITS},  # the budget in every unit
        "seconds_per_iteration": float(np.mean([r["iteration_seconds"] for r in rows])),
        "fit_seconds": run["fit_seconds"],
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'method':8s} {'turns':>5s} {'eff':>5s} {'prefix/100':>10s} {'root/100':>8s} {'tokens':>6s} "
        f"{'s/it':>5s} {'held-out before':>15s} {'after':>5s} {'delta +- se':>14s}  train success"
    )
    for name, s in results.items():
        curve = " ".join(f"{x:.2f}" for x in s["train_success"])
        print(
            f"{name:8s} {s['mean_turns']:5.2f} {s['effective_ratio']:5.3f} {s['prefix_mixed_per_100']:10.1f} "
            f"{s['root_mixed_per_100']:8.1f} {s['tokens']:6d} {s['seconds_per_iteration']:5.0f} "
            f"{s['heldout_before']:15.3f} {s['heldout_after']:5.3f} "
            f"{s['heldout_delta']:+7.3f} +-{s['heldout_delta_se']:.3f}  {curve}"
        )


def verdicts(results: dict[str, dict[str, Any]]) -> list[str]:
    if not {"trace", "uniform"} <= set(results):
        return []
    t, u = results["trace"], results["uniform"]
    lines = [
        (
            t["heldout_delta"] >= u["heldout_delta"],
            f"trace's held-out gain {t['heldout_delta']:+.3f} +-{t['heldout_delta_se']:.3f} vs uniform's "
            f"{u['heldout_delta']:+.3f} +-{u['heldout_delta_se']:.3f} (target: trace's >= uniform's)",
        ),
        (
            t["prefix_mixed_per_100"] > 0,
            f"trace's mixed nodes at depth >= 1: {t['prefix_mixed_per_100']:.1f} per 100 leaves (target > 0)",
        ),
    ]
    return [f"{'MET' if ok else 'MISSED'}: {text}" for ok, text in lines]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on chain, tiny sizes (overrides sizes)")
    p.add_argument(
        "--warm-start", default="outputs/warm_start/smollm2-search_qa/model", help="model folder, or none"
    )
    p.add_argument("--methods", default="trace,uniform", help="comma-separated allocator config names")
    p.add_argument("--leaves", type=int, default=12, help="leaves per iteration, the same for every method")
    p.add_argument("--pool", type=int, default=12, help="candidate prompts per iteration")
    p.add_argument("--iterations", type=int, default=6, help="training iterations (epochs) per method")
    p.add_argument("--held-out", type=int, default=8, help="held-out tasks (the warm start's held_out)")
    p.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out task")
    p.add_argument("--max-new-tokens", type=int, default=48, help="sampling.max_new_tokens")
    p.add_argument("--max-episode-tokens", type=int, default=768, help="data.max_episode_tokens")
    p.add_argument("--lr", type=float, default=None, help="optimizer.lr (default: the product's)")
    p.add_argument("--engine", default="hf", help="engine config of the training iterations (hf, vllm, auto)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/real_learning_search_qa.json"))
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    elif args.warm_start.lower() == "none":
        args.warm_start = None  # SmolLM2 as shipped (the slow test; it answers closed-book in one turn)
    elif not (Path(args.warm_start) / model_folder.MARKER).is_file():
        p.error(f"--warm-start {args.warm_start} is not a finished warm start: run the command in --help")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config.register()
    clock = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods.split(","):
            print(f"{name}:", flush=True)
            runs[name] = run_method(name, args, tmp)
    if len({r["start_fingerprint"] for r in runs.values()}) != 1:
        raise RuntimeError("the methods started from different weights: the held-out pairing is void")
    results = {name: summary(run) for name, run in runs.items()}
    print_table(results)
    lines = verdicts(results)
    print("\n" + "\n".join(lines))
    seconds = time.perf_counter() - clock
    print(f"total {seconds:.0f} s; peak RSS {peak_rss_gib():.2f} GiB; JSON {args.out}")
    first = next(iter(runs.values()))
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg |= {"train_tasks": first["train_tasks"], "held_out_tasks": first["held_out_before"]["task_ids"]}
    out = {
        "config": cfg,
        "overrides": {name: overrides(args, name, "<tmp>") for name in runs},
        "results": results,
        "verdicts": lines,
        "runs": runs,
        "seconds": seconds,
        "peak_rss_gib": peak_rss_gib(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
