"""BFCL v4 multi-turn with a real model, through the product's own code paths.

    python benchmarks/bfcl.py --model smollm2          # hours on 2 shared cores; into results/bfcl.json
    python benchmarks/bfcl.py --model gemma3_270m      # needs `make data-gemma`
    python benchmarks/bfcl.py --quick                  # tiny random model, tiny sizes: the test suite

1. Prompt tokens per entry, all four subsets, at the run's `env.max_doc_chars` and at the env's default:
   which doc level (full, compact, signatures) each entry gets, i.e. what was cut.
2. Held-out success of the model as shipped, on the `--eval-entries` shortest held-out entries of each
   subset (fewest ground-truth calls, then turns; the held-out 40 of 200 are the 80/20 split with the
   run's seed), `--eval-samples` episodes each at `--eval-temperature` (the training one by default; 0
   decodes greedily, as BFCL's own leaderboard does, with one episode per entry) with a seed of their own.
   Also policy turns, calls and user turns reached per episode, from the episodes' final env states.
3. The warm start (`trace_lightning.warmstart.run`, the CLI's function) on the Base training entries'
   ground truth: at most `--demos` demonstrations of at most `--demo-tokens` tokens; held-out success
   again.
4. RL from the warm start: `trace` and `uniform` at equal leaves, each built by `trainer.build` from
   `experiment=bfcl` with this run's sizes, for `--iterations` iterations on the `--train-entries`
   shortest Base training entries (same seed: same LoRA init and first pool); per iteration the
   product's rollout metrics, mixed nodes by tree depth and seconds; held-out Base success after.
5. A tree PNG of the trace run: the tree with the most mixed nodes at depth >= 2, then below the root.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from common import peak_rss_gib
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from trace_lightning import config, model_folder, warmstart
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.engines.base import SamplingParams
from trace_lightning.envs.base import split_tasks
from trace_lightning.envs.bfcl import BFCLEnv
from trace_lightning.envs.bfcl.data import SUBSETS, Entry
from trace_lightning.evaluation import EvalSettings
from trace_lightning.iteration import Branch
from trace_lightning.metrics import rollout_metrics
from trace_lightning.models import build_policy, build_tiny_model, prepare_gemma3, prepare_smollm2
from trace_lightning.plots import draw_tree
from trace_lightning.runner import EpisodeLimits, ReActRunner
from trace_lightning.trainer import build
from trace_lightning.tree import SUCCESS, RolloutTree, tree_stats

SHIPPED = {"smollm2": prepare_smollm2, "gemma3_270m": prepare_gemma3}
QUICK = {  # a tiny random model: every step of the protocol in about a minute; it learns nothing
    "eval_entries": 2,
    "eval_samples": 1,
    "demos": 2,
    "demo_tokens": None,
    "epochs": 1,
    "train_entries": 4,
    "leaves": 4,
    "pool": 2,
    "iterations": 1,
    "max_new_tokens": 16,
    "max_turns": 6,
    "engine": "hf",
}


def size(entry: Entry) -> tuple[int, int]:
    """How long a conversation is: (ground-truth calls, user turns)."""
    return sum(len(t) for t in entry.ground_truth), len(entry.turns)


def shortest(env: BFCLEnv, ids: set[int], n: int) -> list[int]:
    return sorted(ids, key=lambda i: (size(env.entries[i]), i))[:n]


def prompt_tokens(tokenizer: Any, max_doc_chars: int) -> dict[str, Any]:
    """Per subset: prompt tokens per entry (mean, median, max) and the doc level each entry got."""
    out = {}
    for subset in SUBSETS:
        env = BFCLEnv(subset, max_doc_chars=max_doc_chars)
        counts = [len(env.prompt_ids(t, tokenizer)) for t in env.tasks()]
        levels = {
            lvl: sum(v == lvl for v in env.levels.values()) for lvl in ("full", "compact", "signatures")
        }
        out[subset] = {
            "mean": float(np.mean(counts)),
            "median": float(np.median(counts)),
            "max": int(max(counts)),
            "levels": levels,
        }
    return out


def make_engine(args: Any, policy: Any, tokenizer: Any) -> Any:
    """The run's engine group (`--engine`) on `policy`, synced to its current weights."""
    engine = instantiate(compose_train(args, "uniform", "unused").engine)(model=policy, tokenizer=tokenizer)
    engine.sync_weights()  # a vLLM engine loads the folder's weights; the policy may have trained since
    return engine


def release(engine: Any) -> None:
    if hasattr(engine, "close"):
        engine.close()
    gc.collect()


def episodes(engine: Any, tokenizer: Any, env: BFCLEnv, ids: list[int], samples: int, args: Any) -> dict:
    """`samples` episodes of each entry in `ids`, sampled as training samples (the `sampling` group's
    defaults but max_new_tokens, at `--eval-temperature` when given), cut by the same episode limits, with
    a torch seed of their own."""
    params = eval_settings(args).sampling(SamplingParams(max_new_tokens=args.max_new_tokens))
    limits = EpisodeLimits(args.max_turns, args.max_episode_tokens)
    runner = ReActRunner(engine, tokenizer, env, params, limits)
    trees = [runner.new_tree(i) for i in ids]
    ledger = BudgetLedger(Budget(len(trees) * samples))
    ledger.reserve_leaves(len(trees) * samples, "bare")
    start, state = time.perf_counter(), torch.get_rng_state()
    torch.manual_seed(1_000_000 + args.seed)
    try:
        runner([Branch(t, 0, samples, "bare") for t in trees], ledger, np.random.default_rng(args.seed))
    finally:
        torch.set_rng_state(state)
    out = summarise(env, trees, time.perf_counter() - start)
    first = trees[0]
    out["example_turns"] = [  # what the policy wrote in the first episode of the first entry
        tokenizer.decode(first.nodes[n].action_ids, skip_special_tokens=True)
        for n in first.path(first.leaves()[0])
        if n != 0
    ]
    return out


def eval_settings(args: Any) -> EvalSettings:
    """The held-out episodes as the product's `eval` group would play them (it checks the values)."""
    return EvalSettings(samples=args.eval_samples, temperature=args.eval_temperature)


def summarise(env: BFCLEnv, trees: list[RolloutTree], seconds: float) -> dict[str, Any]:
    """Success per entry (mean over its episodes), its standard error over entries, and per-episode
    figures read from each episode's final env state (BFCLEnv.diagnostics)."""
    per_entry = [float(np.mean([(t.nodes[x].reward or 0.0) >= SUCCESS for x in t.leaves()])) for t in trees]
    tasks = {t.task_id: t for t in env.tasks()}
    diag = [env.diagnostics(tasks[t.task_id], _final_state(t, x)) for t in trees for x in t.leaves()]
    stops = [t.nodes[x].stop_reason for t in trees for x in t.leaves()]
    return {
        "entries": [t.task_id for t in trees],
        "success": float(np.mean(per_entry)),
        "stderr": float(np.std(per_entry, ddof=1) / np.sqrt(len(per_entry))) if len(per_entry) > 1 else 0.0,
        "per_entry": per_entry,
        "policy_turns": float(np.mean([t.nodes[x].depth for t in trees for x in t.leaves()])),
        "calls": float(np.mean([d["calls"] for d in diag])),
        "user_turns_reached": float(np.mean([d["turns_reached"] for d in diag])),
        "user_turns": float(np.mean([d["turns"] for d in diag])),
        "turns_passed": float(np.mean([d["turns_passed"] for d in diag])),
        "state_score": float(np.mean([d["state_score"] for d in diag])),
        "call_overlap": float(np.mean([d["call_overlap"] for d in diag])),
        "stop_reasons": {r: stops.count(r) for r in sorted(set(stops), key=str)},
        "seconds": seconds,
    }


def _final_state(tree: RolloutTree, leaf: int) -> Any:
    """The env state at a leaf: its own, or its nearest ancestor's (a fault leaves none)."""
    node = leaf
    while node not in tree.env_states:
        node = tree.nodes[node].parent
    return tree.env_states[node]


def eval_env(subset: str, args: Any) -> tuple[BFCLEnv, list[int]]:
    """The subset's env as the run configures it, and its `--eval-entries` shortest held-out entries."""
    env = BFCLEnv(subset, max_doc_chars=args.max_doc_chars, max_calls_per_turn=args.max_calls)
    return env, shortest(env, held_out_ids(env, args.seed), args.eval_entries)


def held_out_ids(env: BFCLEnv, seed: int) -> set[int]:
    """The entries the warm start and the trainer hold out (`env.held_out` of them, split by `seed`)."""
    return split_tasks([t.task_id for t in env.tasks()], env.held_out, seed)[1]


def held_out(policy: Any, tokenizer: Any, args: Any, subsets: tuple[str, ...]) -> dict[str, Any]:
    """Held-out success per subset, one engine for all of them (a vLLM engine is not freed in-process)."""
    engine, out = make_engine(args, policy, tokenizer), {}
    try:
        for subset in subsets:
            env, ids = eval_env(subset, args)
            out[subset] = r = episodes(engine, tokenizer, env, ids, args.eval_samples, args)
            print(
                f"  {subset}: success {r['success']:.3f} +-{r['stderr']:.3f}, "
                f"policy turns {r['policy_turns']:.1f}, calls {r['calls']:.1f}, {r['seconds']:.0f} s",
                flush=True,
            )
    finally:
        release(engine)
    return out


# ------------------------------------------------------------------------------------------ configs


def model_overrides(args: Any, tmp: str) -> list[str]:
    if args.quick:
        return ["model=tiny", f"model.out_dir={tmp}/tiny_model", "adapter=none"]
    return [f"model={args.model}"]


def env_overrides(args: Any) -> list[str]:
    return ["env=bfcl", f"env.max_doc_chars={args.max_doc_chars}", f"env.max_calls_per_turn={args.max_calls}"]


def compose_train(args: Any, allocator: str, run_dir: str, warm: str | None = None) -> DictConfig:
    overrides = [
        "experiment=bfcl",
        *env_overrides(args),
        *model_overrides(args, str(Path(run_dir).parent)),
        f"allocator={allocator}",
        f"run_dir={run_dir}",
        f"seed={args.seed}",
        f"engine={args.engine}",
        "logger=none",
        "callbacks=none",  # the Recorder below reads each iteration; no checkpoints or artifacts
        f"trainer.max_epochs={args.iterations}",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false",
        "++trainer.enable_checkpointing=false",
        f"budget.leaves={args.leaves}",
        f"data.pool_size={args.pool}",
        f"data.max_turns={args.max_turns}",
        f"data.max_episode_tokens={args.max_episode_tokens}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
    ]
    if allocator not in ("trace", "trace_root_only", "trace_prefix_only", "random_expand"):
        overrides.append("~allocator.expansion")  # experiment=bfcl's N = 1: only expanding allocators take it
    if warm is not None:
        overrides.append(f"model.warm_start={warm}")
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


def run_warm_start(args: Any, tmp: str, base_model: str) -> tuple[Path, dict[str, Any]]:
    """The warm start of step 3, into `--warm-start-dir` (kept) or the run's temporary folder. A
    `--warm-start-dir` that already holds a finished warm start of the same base model and held-out
    split is reused, not trained again (the RL steps can then be re-run without its hour on a CPU)."""
    run_dir = args.warm_start_dir or Path(tmp) / "warm_start"
    done = run_dir / "model" / model_folder.MARKER
    if done.is_file():
        record = model_folder.warm_start_record(str(done.parent))
        if record.get("base_model") != Path(base_model).name:
            raise SystemExit(
                f"--warm-start-dir {run_dir} holds a warm start of {record.get('base_model')}, not of "
                f"{Path(base_model).name}: pass an empty folder"
            )
        model_folder.check_held_out(str(done.parent), sorted(held_out_ids(BFCLEnv("base"), args.seed)))
        print(f"warm start: reusing {done.parent} ({record.get('demonstrations')} demos)", flush=True)
        return done.parent, record | {"wall_seconds": 0.0, "reused": str(done.parent)}
    overrides = [
        *env_overrides(args),
        *model_overrides(args, tmp),
        f"run_dir={run_dir}",
        "logger=none",
        f"seed={args.seed}",
        f"max_demos={args.demos}",
        f"max_demo_tokens={args.demo_tokens if args.demo_tokens is not None else 'null'}",
        f"trainer.max_epochs={args.epochs}",
        f"lr={args.lr}",
        # one conversation a step, 4 steps an update (the default's batch of 4): a batch of 4 long
        # conversations' logits took 13 GB and the machine's OOM killer
        "batch_size=1",
        f"++trainer.accumulate_grad_batches={args.accumulate}",
    ]
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        cfg = compose("warmstart", overrides=overrides)
    start = time.perf_counter()
    out = warmstart.run(cfg)
    record = json.loads((out / model_folder.MARKER).read_text())
    return out, record | {"wall_seconds": time.perf_counter() - start, "overrides": overrides}


# ------------------------------------------------------------------------------------------- RL


class Recorder(L.Callback):
    """One row per iteration: the product's rollout metrics, mixed nodes by depth, seconds; and the trees."""

    def __init__(self, args: Any) -> None:
        self.args, self.rows, self.trees = args, [], []
        self.after: dict[str, Any] | None = None
        self._last = time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Held-out Base success of the trained policy, on the collector's own engine (still up here)."""
        engine = trainer.datamodule.collector.runner.engine  # type: ignore[attr-defined]
        engine.sync_weights()
        env, ids = eval_env("base", self.args)
        self.after = episodes(engine, module.tokenizer, env, ids, self.args.eval_samples, self.args)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        report = trainer.datamodule.report  # type: ignore[attr-defined]
        m, now = rollout_metrics(report), time.perf_counter()
        by_depth = [tree_stats(t, SUCCESS).mixed_by_depth for t in report.result.trees]
        self.trees += report.result.trees
        self.rows.append(
            {
                "iteration": report.iteration,
                "leaves": int(m["budget/leaves"]),
                "tokens": int(m["budget/tokens"]),
                "prompts": int(m["rollout/prompts"]),
                "task_ids": sorted({t.task_id for t in report.result.trees}),
                "success_rate": m["rollout/success_rate"],
                "turns_mean": m["rollout/turns_mean"],
                "tool_calls": m["rollout/tool_calls"],
                "effective_ratio": m["rollout/effective_ratio"],
                "root_mixed_per_100": m["rollout/mixed_root_per_100_leaves"],
                "prefix_mixed_per_100": m["rollout/mixed_prefix_per_100_leaves"],
                "mixed_depth2_plus": int(sum(sum(d[2:]) for d in by_depth)),
                "prefill_tokens": m.get("budget/prefill_tokens"),
                "reused_prefill_tokens": m.get("budget/reused_prefill_tokens"),  # vLLM's prefix cache
                "sample_seconds": report.sample_seconds,
                "iteration_seconds": now - self._last,
            }
        )
        self._last = now
        r = self.rows[-1]
        print(
            f"    iteration {r['iteration']}: success {r['success_rate']:.3f}, turns {r['turns_mean']:.1f}, "
            f"prefix-mixed/100 {r['prefix_mixed_per_100']:.1f}, mixed at depth>=2 {r['mixed_depth2_plus']}, "
            f"{r['iteration_seconds']:.0f} s",
            flush=True,
        )


def run_rl(name: str, args: Any, tmp: str, warm: Path) -> dict[str, Any]:
    """`name` allocator from the warm start through the product's loop; held-out Base success after."""
    cfg = compose_train(args, name, f"{tmp}/{name}", str(warm))
    module, data, trainer = build(cfg)
    env = data.collector.env
    data.collector.train_ids = shortest(env, set(data.collector.train_ids), args.train_entries)
    recorder = Recorder(args)
    trainer.callbacks.append(recorder)
    clock = time.perf_counter()
    trainer.fit(module, datamodule=data)
    after = recorder.after
    assert after is not None
    fit_seconds = time.perf_counter() - clock - after["seconds"]  # the evaluation ran inside fit
    print(f"  {name}: held-out Base success after {after['success']:.3f} +-{after['stderr']:.3f}", flush=True)
    rows = recorder.rows
    leaves = sum(r["leaves"] for r in rows)
    return {
        "iterations": rows,
        "train_entries": data.collector.train_ids,
        "held_out_after": after,
        "fit_seconds": fit_seconds,
        "seconds_per_iteration": float(np.mean([r["iteration_seconds"] for r in rows])),
        "prefix_mixed_per_100": float(sum(r["prefix_mixed_per_100"] * r["leaves"] for r in rows) / leaves),
        "mixed_depth2_per_100": 100 * sum(r["mixed_depth2_plus"] for r in rows) / leaves,
        "mixed_depth2_iterations_share": float(np.mean([r["mixed_depth2_plus"] > 0 for r in rows])),
        "trees": recorder.trees,
    }


def paired_gain(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, float]:
    """Mean and standard error of the per-entry success differences (same entries, same seed)."""
    diff = np.array(after["per_entry"]) - np.array(before["per_entry"])
    return float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0


def best_tree(trees: list[RolloutTree], out: Path) -> dict[str, Any] | None:
    """Draw the tree with the most mixed nodes at depth >= 2 (then at depth >= 1, then the most nodes)."""
    if not trees:
        return None
    mixed = [tree_stats(t, SUCCESS).mixed_by_depth for t in trees]
    score = [(sum(m[2:]), sum(m[1:]), len(t.nodes)) for m, t in zip(mixed, trees, strict=True)]
    tree = trees[int(max(range(len(trees)), key=lambda i: score[i]))]
    draw_tree(tree, out)
    stats = tree_stats(tree, SUCCESS)
    return {
        "path": str(out),
        "task_id": tree.task_id,
        "mixed_by_depth": stats.mixed_by_depth,
        "leaves": stats.leaves,
    }


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(SHIPPED), help="the shipped model to measure")
    p.add_argument("--quick", action="store_true", help="tiny random model, tiny sizes (the test suite)")
    p.add_argument("--max-doc-chars", type=int, default=4800, help="env.max_doc_chars (4800: signatures)")
    p.add_argument("--max-calls", type=int, default=8, help="env.max_calls_per_turn")
    p.add_argument(
        "--eval-entries", type=int, default=6, help="shortest held-out entries evaluated per subset"
    )
    p.add_argument("--eval-samples", type=int, default=2, help="episodes per held-out entry")
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=None,
        help="temperature of the held-out episodes (default: the training one; 0: greedy, one episode)",
    )
    p.add_argument(
        "--eval-subsets", default=",".join(SUBSETS), help="subsets evaluated before/after the warm start"
    )
    p.add_argument("--demos", type=int, default=24, help="warm start: max_demos")
    p.add_argument("--demo-tokens", type=int, default=1600, help="warm start: max_demo_tokens")
    p.add_argument("--epochs", type=int, default=2, help="warm start epochs")
    p.add_argument("--lr", type=float, default=2e-4, help="warm start learning rate (conf/warmstart.yaml's)")
    p.add_argument("--accumulate", type=int, default=4, help="warm start: conversations per update")
    p.add_argument(
        "--warm-start-dir",
        type=Path,
        default=None,
        help="keep the warm start here (default: a temporary folder); reused if it already holds one",
    )
    p.add_argument(
        "--train-entries", type=int, default=16, help="shortest Base training entries RL draws from"
    )
    p.add_argument("--leaves", type=int, default=8, help="leaves per iteration, the same for every method")
    p.add_argument("--pool", type=int, default=8, help="candidate entries per iteration")
    p.add_argument("--iterations", type=int, default=3, help="RL iterations per method")
    p.add_argument(
        "--methods", default="trace,uniform", help="allocators compared from the warm start ('': no RL)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="sampling.max_new_tokens")
    p.add_argument("--max-turns", type=int, default=16, help="data.max_turns (policy turns per conversation)")
    p.add_argument("--max-episode-tokens", type=int, default=3072, help="data.max_episode_tokens")
    p.add_argument(
        "--engine", default="auto", help="engine group of every episode (auto: vLLM where installed)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bfcl.json"))
    p.add_argument(
        "--tree-png", type=Path, default=None, help="where the trace tree goes (default: beside --out)"
    )
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    try:
        eval_settings(args)
    except ValueError as err:
        p.error(str(err).replace("eval.", "--eval-"))
    return args


def measure(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    path = build_tiny_model(f"{tmp}/tiny_model") if args.quick else SHIPPED[args.model]()
    policy, tokenizer = build_policy(path)
    policy.eval()
    subsets = tuple(args.eval_subsets.split(","))
    result: dict[str, Any] = {"prompt_tokens": prompt_tokens(tokenizer, args.max_doc_chars)}
    if not args.quick:
        result["prompt_tokens_default_docs"] = prompt_tokens(tokenizer, 16000)
    print("held-out success of the model as shipped:", flush=True)
    result["before"] = held_out(policy, tokenizer, args, subsets)
    warm, result["warm_start"] = run_warm_start(args, tmp, path)
    print(
        f"warm start: {result['warm_start']['demonstrations']} demonstrations, "
        f"{result['warm_start']['wall_seconds']:.0f} s",
        flush=True,
    )
    policy, tokenizer = build_policy(str(warm))
    policy.eval()
    print("held-out success after the warm start:", flush=True)
    result["after_warm_start"] = held_out(policy, tokenizer, args, subsets)
    del policy
    gc.collect()
    result["rl"] = {name: run_rl(name, args, tmp, warm) for name in args.methods.split(",") if name}
    png = args.tree_png or args.out.with_name(f"bfcl_tree_{'quick' if args.quick else args.model}.png")
    result["tree_png"] = best_tree(result["rl"].get("trace", {}).get("trees", []), png)
    for run in result["rl"].values():
        run.pop("trees")
    return result


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys: mean policy turns after the warm start, Base held-out success at each stage,
    the share of trace iterations with a mixed node at depth >= 2, and the gains with their s.e."""
    warm = result["after_warm_start"]["base"]
    rl = result["rl"]
    out: dict[str, Any] = {
        "mean_turns": warm["policy_turns"],
        "heldout_success": {"base": result["before"]["base"]["success"], "warm_start": warm["success"]}
        | {name: run["held_out_after"]["success"] for name, run in rl.items()},
        "heldout_stderr": {"base": result["before"]["base"]["stderr"], "warm_start": warm["stderr"]}
        | {name: run["held_out_after"]["stderr"] for name, run in rl.items()},
        "heldout_gain_over_warm_start": {
            name: paired_gain(warm, run["held_out_after"]) for name, run in rl.items()
        },
        "mixed_depth2_iterations_share": rl["trace"]["mixed_depth2_iterations_share"]
        if "trace" in rl
        else None,
    }
    return out


def verdicts(h: dict[str, Any]) -> list[str]:
    lines = [
        (
            h["mean_turns"] >= 3,
            f"mean policy turns per episode after the warm start {h['mean_turns']:.2f} (target >= 3)",
        ),
        (
            h["heldout_success"]["warm_start"] > 0,
            f"held-out Base success after the warm start "
            f"{h['heldout_success']['warm_start']:.3f} (target > 0)",
        ),
    ]
    if h["mixed_depth2_iterations_share"] is not None:
        lines.append(
            (
                h["mixed_depth2_iterations_share"] > 0.5,
                "trace iterations with a mixed node at depth >= 2: "
                f"{h['mixed_depth2_iterations_share']:.2f} (target: most)",
            )
        )
    gains = h["heldout_gain_over_warm_start"]
    if {"trace", "uniform"} <= set(gains):
        (t, tse), (u, use) = gains["trace"], gains["uniform"]
        lines.append(
            (t >= u, f"held-out gain trace {t:+.3f} +-{tse:.3f} vs uniform {u:+.3f} +-{use:.3f} (target >=)")
        )
    return [f"{'MET' if ok else 'MISSED'}: {text}" for ok, text in lines]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config.register()
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, tmp)
    h = headline(result)
    lines = verdicts(h)
    print("\n" + "\n".join(lines))
    name = "tiny" if args.quick else args.model
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    entry = h | {
        "verdicts": lines,
        "config": cfg,
        "details": result,
        "seconds": time.perf_counter() - clock,
        "peak_rss_gib": peak_rss_gib(),
    }
    merged = json.loads(args.out.read_text()) if args.out.is_file() else {}
    merged.setdefault("models", {})[name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1))
    print(f"total {entry['seconds']:.0f} s; peak RSS {entry['peak_rss_gib']:.2f} GiB; JSON {args.out}")


if __name__ == "__main__":
    main()
