"""Learning benchmark: a tiny Qwen3 policy trained with RL on the synthetic chain task (`env=chain`), every
allocator at the same leaf budget per iteration, 3 seeds; success measured by a fixed evaluation.

    python benchmarks/learning.py            # the full run reported in BENCHMARKS.md
    python benchmarks/learning.py --quick    # the test suite's smoke run (tests/test_bench_learning.py)

Per seed:
1. Task: `ChainEnv(n_tasks, turns, n_choices, seed)`: a key -> letter table; the policy answers
   `<choose>letter</choose>` once per key; tasks allow 0 or 1 mistakes.
2. Warm start (supervised, NOT reinforcement learning): a randomly initialised tiny model never writes
   the action format by itself, so RL from scratch has no signal. A scripted teacher reads the table
   and answers each key right with probability `--teacher-acc` (else a wrong letter); the model is
   fitted to `--demos` such episodes per task until its evaluation success reaches `--sft-target` (or
   after `--sft-steps` steps). This gives a policy that knows the format and is partly competent, so
   success spreads across tasks and RL has room to improve. All methods of a seed start from it.
3. RL, per method: a fresh `TraceModule` with the warm-start weights, `RolloutDataModule.build_iteration`
   (the trainer's own rollout + allocation path) and `TraceModule.training_step` with the module's own
   optimizer, one step per micro-batch, as a Lightning epoch with accumulate_grad_batches=1 runs it.
   Every method spends exactly `--leaves` leaves per iteration (asserted).
4. Evaluation every `--eval-every` iterations: sampled success over ALL tasks, `--eval-samples` episodes
   each, at the training temperature, with a fixed torch seed (a fixed task set, not the training
   reward). Its tokens are not part of any budget.

Methods: uniform (GRPO), pcl, random_expand, trace (main); trace_root_only, trace_prefix_only (Table 1);
trace at (M, N), (M, 3N), (2M, N) where M = leaves / (1 + N) (the (M, N) budget table).
Targets (issue 7): TRACE reaches GRPO's final success with <= 0.6x of GRPO's leaves; TRACE's effective
ratio >= 2x GRPO's. JSON (config, per-seed curves, summary) and a PNG land in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trace_lightning import allocation as alloc
from trace_lightning.allocation import BetaPrior, Budget
from trace_lightning.batching import collate, leaf_sequences, node_advantages
from trace_lightning.data import RolloutDataModule
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.iteration import Iteration, build_trees
from trace_lightning.models import build_tiny_model
from trace_lightning.module import TraceModule
from trace_lightning.runner import ReActRunner
from trace_lightning.tree import tree_stats

MAX_NEW_TOKENS = 12  # "<choose>X</choose>" is 7 tokens with the tiny tokenizer
MAX_EPISODE_TOKENS = 256


# --------------------------------------------------------------------------- methods


def methods(leaves: int, expansion: int, max_per_prompt: int) -> dict[str, alloc.TreeAllocator]:
    """Every run of one seed, by name. The (M, N) runs other than (M, N) itself change the leaves."""
    return {
        "uniform": alloc.uniform(4),
        "pcl": alloc.pcl(4),
        "random_expand": alloc.random_expand(2, expansion),
        "trace": alloc.trace(expansion, max_per_prompt=max_per_prompt),
        "trace_root_only": alloc.trace_root_only(expansion, max_per_prompt=max_per_prompt),
        "trace_prefix_only": alloc.trace_prefix_only(2, expansion),
        **{
            name: alloc.trace(n, max_per_prompt=max_per_prompt)
            for name, (_, n) in budget_runs(leaves, expansion).items()
        },
    }


def budget_runs(leaves: int, expansion: int) -> dict[str, tuple[int, int]]:
    """(M, N) of the budget table's extra runs: deeper expansion (M, 3N) and wider roots (2M, N).
    (M, N) itself is the main `trace` run."""
    m = leaves // (1 + expansion)
    return {
        f"trace_m{m}_n{3 * expansion}": (m, 3 * expansion),
        f"trace_m{2 * m}_n{expansion}": (2 * m, expansion),
    }


def leaves_of(name: str, args: argparse.Namespace) -> int:
    runs = budget_runs(args.leaves, args.expansion)
    if name in runs:
        m, n = runs[name]
        return m * (1 + n)
    return args.leaves


# --------------------------------------------------------------------------- warm start


@dataclass
class TeacherEngine:
    """A scripted `GenerationEngine` for the warm start's demonstrations: it finds the task and the key
    asked for in the prompt, and writes `<choose>letter</choose>`, right with probability `accuracy`."""

    tokenizer: Any
    env: ChainEnv
    accuracy: float
    rng: np.random.Generator
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.by_question = {
            t.question: c for t, c in zip(self.env.tasks(), self.env.chain_tasks, strict=True)
        }
        self.ids = {
            c: self.tokenizer(f"<choose>{c}</choose>", add_special_tokens=False)["input_ids"]
            for c in self.env.letters
        }

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            task = next(t for q, t in self.by_question.items() if q in text)
            right = task.answers[len(re.findall(r"Key \d+\?", text)) - 1]
            n = self.env.n_choices
            pick = right if self.rng.random() < self.accuracy else (right + self.rng.integers(1, n)) % n
            ids = self.ids[self.env.letters[pick]]
            out.append(Completion(list(ids), [0.0] * len(ids), "stop"))
        return out

    def sync_weights(self) -> None:
        """Nothing to sync: the teacher has no weights."""


def play_all(runner: ReActRunner, per_task: int, rng: np.random.Generator) -> Iteration:
    """`per_task` episodes of every task of the runner's environment (no allocation, no predictor)."""
    pool = [runner.new_tree(t) for t in sorted(runner.tasks)]

    def flat(trees: Sequence[Any], nodes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return [np.full(len(n), 0.5) for n in nodes]

    return build_trees(pool, alloc.uniform(per_task), Budget(per_task * len(pool)), flat, runner, rng)


def warm_start(module: TraceModule, env: ChainEnv, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Supervised fit to teacher demonstrations (loss on the policy's own tokens only) until the
    evaluation success reaches `sft_target`. Returns what it did, for the JSON."""
    rng = np.random.default_rng(seed)
    teacher = TeacherEngine(module.tokenizer, env, args.teacher_acc, rng)
    runner = ReActRunner(
        teacher, module.tokenizer, env, SamplingParams(MAX_NEW_TOKENS), args.turns, MAX_EPISODE_TOKENS
    )
    demos = play_all(runner, args.demos, rng).trees
    seqs = leaf_sequences(demos, node_advantages(demos, "grpo"))
    opt = torch.optim.AdamW(module.policy.parameters(), lr=args.sft_lr)
    gen = torch.Generator().manual_seed(seed)
    success, step = evaluate(module, env, args, seed), 0
    for step in range(1, args.sft_steps + 1):
        rows = torch.randperm(len(seqs), generator=gen)[: args.sft_batch].tolist()
        batch = collate([seqs[i] for i in rows], module.tokenizer.pad_token_id)
        logp = module._forward(module.policy, batch.input_ids, batch.attention_mask)[0]  # [B, T]
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.sft_check == 0 and step >= args.sft_min:
            success = evaluate(module, env, args, seed)
            if success >= args.sft_target:
                break
    return {"steps": step, "demos": len(seqs), "success": success}


# --------------------------------------------------------------------------- evaluation and RL


def evaluate(module: TraceModule, env: ChainEnv, args: argparse.Namespace, seed: int) -> float:
    """Sampled success over all tasks, `eval_samples` each, with a fixed seed; the training RNG is kept."""
    engine = HFEngine(module.policy, module.tokenizer, max_batch_size=128)
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature=args.temperature)
    runner = ReActRunner(engine, module.tokenizer, env, sampling, args.turns, MAX_EPISODE_TOKENS)
    state = torch.get_rng_state()
    torch.manual_seed(10_000 + seed)
    trees = play_all(runner, args.eval_samples, np.random.default_rng(seed)).trees
    torch.set_rng_state(state)
    return float(np.mean([t.nodes[leaf].reward >= 0.5 for t in trees for leaf in t.leaves()]))


def iteration_row(data: RolloutDataModule) -> dict[str, float]:
    res = data.report.result
    stats = [tree_stats(t) for t in res.trees]
    leaves = res.ledger.leaves_used
    return {
        "leaves": leaves,
        "tokens": res.ledger.tokens_used,
        "prompts": len(res.trees),
        "effective_ratio": float(np.mean([s.mixed for s in stats])),
        "mixed_prefix_per_100": 100 * sum(sum(s.mixed_by_depth[1:]) for s in stats) / leaves,
        "train_success": float(np.mean([t.nodes[x].reward >= 0.5 for t in res.trees for x in t.leaves()])),
        # Can the head tell prompts apart? The spread of its root predictions over the candidate pool,
        # and its bias on the prompts that got rollouts (predicted minus realised success).
        "pool_pred_sd": float(np.std(res.pool_predicted)),
        "root_pred_bias": float(
            np.mean(
                [
                    t.root.predicted - np.mean([t.nodes[x].reward >= 0.5 for x in t.leaves()])
                    for t in res.trees
                ]
            )
        ),
    }


def make_data(
    allocator: alloc.TreeAllocator, leaves: int, env: ChainEnv, args: argparse.Namespace, seed: int
) -> RolloutDataModule:
    return RolloutDataModule(
        env=env,
        allocator=allocator,
        engine=functools.partial(HFEngine, max_batch_size=64),
        sampling=SamplingParams(MAX_NEW_TOKENS, temperature=args.temperature),
        leaves=leaves,
        pool_size=args.pool,
        micro_batch_size=args.micro_batch,
        max_turns=args.turns,
        max_episode_tokens=MAX_EPISODE_TOKENS,
        estimator=args.estimator,
        cold_start=BetaPrior(warmup=1),
        seed=seed,
    )


def train_iteration(module: TraceModule, data: RolloutDataModule, opt: Any, it: int) -> None:
    """Sample one iteration, then one optimizer step per micro-batch (an epoch, minus the clipping)."""
    for batch in data.build_iteration(module):
        loss = module.training_step(batch, it)
        opt.zero_grad()
        if loss is not None:
            loss.backward()
            opt.step()


def train_run(
    name: str,
    allocator: alloc.TreeAllocator,
    model_dir: str,
    warm: dict[str, torch.Tensor],
    env: ChainEnv,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """One method from the seed's warm start: per-iteration rows and the evaluation curve."""
    torch.manual_seed(seed)
    module = TraceModule(model_dir, functools.partial(torch.optim.AdamW, lr=args.lr), predictor_width=64)
    module.policy.load_state_dict(warm)
    leaves = leaves_of(name, args)
    data = make_data(allocator, leaves, env, args, seed)
    opt = module.configure_optimizers()
    rows: list[dict[str, float]] = []
    evals = [{"iteration": 0, "leaves": 0, "tokens": 0, "success": evaluate(module, env, args, seed)}]
    start = time.perf_counter()
    for it in range(1, args.iterations + 1):
        train_iteration(module, data, opt, it)
        rows.append(iteration_row(data))
        assert rows[-1]["leaves"] == leaves, f"{name} spent {rows[-1]['leaves']} leaves, budget {leaves}"
        if it % args.eval_every == 0 or it == args.iterations:
            cum = {k: int(sum(r[k] for r in rows)) for k in ("leaves", "tokens")}
            evals.append({"iteration": it, **cum, "success": evaluate(module, env, args, seed)})
    seconds = time.perf_counter() - start
    print(
        f"  seed {seed} {name:18s} success {evals[0]['success']:.3f} -> {evals[-1]['success']:.3f} "
        f"eff {np.mean([r['effective_ratio'] for r in rows]):.3f}  {seconds:.0f} s",
        flush=True,
    )
    return {
        "method": name,
        "seed": seed,
        "leaves_per_iteration": leaves,
        "iterations": rows,
        "evals": evals,
        "seconds": seconds,
    }


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The warm start and every method of one seed (one worker process)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    env = ChainEnv(n_tasks=args.tasks, turns=args.turns, n_choices=args.choices, seed=seed)
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, hidden_size=args.hidden, layers=args.layers, seed=seed)
        torch.manual_seed(seed)
        module = TraceModule(model_dir, functools.partial(torch.optim.AdamW, lr=args.lr), predictor_width=64)
        warm_info = warm_start(module, env, args, seed)
        print(f"seed {seed}: warm start {warm_info} in {time.perf_counter() - start:.0f} s", flush=True)
        warm = {k: v.clone() for k, v in module.policy.state_dict().items()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        runs = [
            train_run(name, allocator, model_dir, warm, env, args, seed)
            for name, allocator in methods(args.leaves, args.expansion, args.max_per_prompt).items()
        ]
    result = {"seed": seed, "warm_start": warm_info, "runs": runs, "seconds": time.perf_counter() - start}
    # Each seed is also kept on its own as soon as it ends: a run cut short still leaves its finished seeds.
    args.out.with_name(f".{args.out.stem}_seed{seed}.json").write_text(json.dumps(result))
    return result


# --------------------------------------------------------------------------- summary


def smoothed(evals: list[dict[str, float]]) -> np.ndarray:
    """Success at each evaluation, averaged with the one before: one evaluation is noisy (a few hundred
    episodes), so both "final success" and "first reached" use this two-point trailing mean."""
    s = np.array([e["success"] for e in evals])  # [E]
    return np.concatenate([s[:1], (s[1:] + s[:-1]) / 2])


def leaves_to_reach(evals: list[dict[str, float]], target: float) -> float:
    """Cumulative leaves at the first evaluation whose smoothed success is >= target (inf: never)."""
    hit = np.flatnonzero(smoothed(evals) >= target - 1e-9)
    return float(evals[hit[0]]["leaves"]) if hit.size else float("inf")


def per_seed_metrics(seed_result: dict[str, Any]) -> dict[str, dict[str, float]]:
    runs = {r["method"]: r for r in seed_result["runs"]}
    grpo = runs["uniform"]
    target, grpo_total = float(smoothed(grpo["evals"])[-1]), float(grpo["evals"][-1]["leaves"])
    base_eff = float(np.mean([r["effective_ratio"] for r in grpo["iterations"]]))
    out = {}
    for name, r in runs.items():
        eff = float(np.mean([row["effective_ratio"] for row in r["iterations"]]))
        # Where GRPO ended no higher than the shared start, every method "reaches" its final success at
        # 0 leaves; the comparison says nothing there, so it is left undefined (nan) for that seed.
        reach = leaves_to_reach(r["evals"], target) if target > grpo["evals"][0]["success"] else float("nan")
        out[name] = {
            "final_success": float(smoothed(r["evals"])[-1]),
            "start_success": float(r["evals"][0]["success"]),
            "effective_ratio": eff,
            "effective_x_uniform": eff / base_eff if base_eff > 0 else float("nan"),
            "leaves_to_grpo_final": reach,
            "leaves_x_grpo": reach / grpo_total,
            "total_leaves": float(r["evals"][-1]["leaves"]),
            "tokens_per_iteration": float(np.mean([row["tokens"] for row in r["iterations"]])),
            "mixed_prefix_per_100": float(np.mean([row["mixed_prefix_per_100"] for row in r["iterations"]])),
        }
    return out


def summarize(seed_results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean, std, min and max over seeds of every per-seed metric; `reached` counts finite values."""
    per_seed = [per_seed_metrics(s) for s in seed_results]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in per_seed[0]:
        out[name] = {}
        for key in per_seed[0][name]:
            v = np.array([p[name][key] for p in per_seed])
            finite = v[np.isfinite(v)]
            # A metric that is not finite for some seed (never reached: inf; no baseline: nan) has no mean.
            missing = float("inf") if np.isinf(v).any() else float("nan")
            out[name][key] = {
                "mean": float(v.mean()) if finite.size == v.size else missing,
                "std": float(v.std()) if finite.size == v.size else float("nan"),
                "min": float(v.min()),
                "max": float(v.max()),
                "reached": int(finite.size),
                "per_seed": [float(x) for x in v],
            }
    return out


def fmt(stat: dict[str, float], digits: int = 3) -> str:
    if stat["reached"] < len(stat["per_seed"]):
        return f"{stat['reached']}/{len(stat['per_seed'])} seeds"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The three tables and the verdict on each target; returns the verdict lines."""
    main = ["uniform", "pcl", "random_expand", "trace"]
    print(
        f"\nMain comparison: {args.leaves} leaves per iteration, {args.iterations} iterations, "
        f"{len(args.seeds)} seeds (mean ± std over seeds; success = evaluation, 2-point trailing mean)"
    )
    print(
        f"{'method':15s} {'start':>6s} {'final success':>15s} {'leaves to GRPO final':>22s} "
        f"{'x GRPO leaves':>15s} {'eff. ratio':>15s} {'x uniform':>13s} {'tokens/iter':>11s}"
    )
    for name in main:
        s = summary[name]
        print(
            f"{name:15s} {s['start_success']['mean']:6.3f} {fmt(s['final_success']):>15s} "
            f"{fmt(s['leaves_to_grpo_final'], 0):>22s} {fmt(s['leaves_x_grpo'], 2):>15s} "
            f"{fmt(s['effective_ratio']):>15s} {fmt(s['effective_x_uniform'], 2):>13s} "
            f"{s['tokens_per_iteration']['mean']:11.0f}"
        )
    print("\nTable 1 ablation (root allocation / prefix allocation), same budget")
    head = f"{'final success':>15s} {'eff. ratio':>15s}"
    print(f"{'root':8s} {'prefix':8s} {'method':18s} {head} {'x uniform':>13s}")
    for root, prefix, name in [
        ("uniform", "none", "uniform"),
        ("uniform", "random", "random_expand"),
        ("active", "random", "trace_root_only"),
        ("uniform", "active", "trace_prefix_only"),
        ("active", "active", "trace"),
    ]:
        s = summary[name]
        print(
            f"{root:8s} {prefix:8s} {name:18s} {fmt(s['final_success']):>15s} "
            f"{fmt(s['effective_ratio']):>15s} {fmt(s['effective_x_uniform'], 2):>13s}"
        )
    m = args.leaves // (1 + args.expansion)
    print(
        f"\n(M, N) budget table: trace with M bare rollouts and N continuations each, "
        f"{args.iterations} iterations"
    )
    print(f"{'M':>4s} {'N':>3s} {'leaves/iter':>11s} {head} {'total leaves':>12s}")
    for name, (mm, n) in [("trace", (m, args.expansion)), *budget_runs(args.leaves, args.expansion).items()]:
        s = summary[name]
        print(
            f"{mm:4d} {n:3d} {mm * (1 + n):11d} {fmt(s['final_success']):>15s} "
            f"{fmt(s['effective_ratio']):>15s} {s['total_leaves']['mean']:12.0f}"
        )
    t, grpo = summary["trace"], summary["uniform"]
    ratio, eff = t["leaves_x_grpo"], t["effective_x_uniform"]
    gain = grpo["final_success"]["mean"] - grpo["start_success"]["mean"]
    leaves_ok = ratio["reached"] == len(ratio["per_seed"]) and ratio["mean"] <= 0.6 and gain > 0
    eff_ok = bool(np.isfinite(eff["mean"]) and eff["mean"] >= 2.0)
    verdicts = [
        f"{'PASS' if leaves_ok else 'MISS'}: TRACE reaches GRPO's final success with {fmt(ratio, 2)} x "
        f"GRPO's leaves (target <= 0.6; per seed {[round(x, 2) for x in ratio['per_seed']]}; "
        f"GRPO's own gain over the warm start {gain:+.3f}, the target is only meaningful when positive)",
        f"{'PASS' if eff_ok else 'MISS'}: TRACE's effective ratio is {fmt(eff, 2)} x GRPO's "
        f"(target >= 2; per seed {[round(x, 2) for x in eff['per_seed']]})",
    ]
    print("\n" + "\n".join(verdicts))
    return verdicts


# --------------------------------------------------------------------------- plot and main


def plot(seed_results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict[str, Any]]] = {}
    for s in seed_results:
        for r in s["runs"]:
            by_method.setdefault(r["method"], []).append(r)
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    compared = ["uniform", "pcl", "random_expand", "trace", "trace_root_only", "trace_prefix_only"]
    budget = ["trace", *budget_runs(args.leaves, args.expansion)]
    for ax, names, unit in [
        (axes[0], compared, "leaves"),
        (axes[1], compared, "tokens"),
        (axes[3], budget, "leaves"),
    ]:
        for name in names:
            runs = by_method[name]
            x = np.mean([[e[unit] for e in r["evals"]] for r in runs], axis=0)
            y = np.array([smoothed(r["evals"]) for r in runs])  # [S, E]
            (line,) = ax.plot(x, y.mean(0), label=name, lw=2.2 if name == "trace" else 1.4)
            ax.fill_between(x, y.min(0), y.max(0), color=line.get_color(), alpha=0.1)
        ax.set_xlabel(f"cumulative {'generated tokens' if unit == 'tokens' else 'leaves (trajectories)'}")
        ax.set_ylabel("evaluation success (2-point mean)")
        ax.legend(fontsize=8)
    axes[0].set_title("success vs leaves (band: min-max over seeds)")
    axes[1].set_title("success vs generated tokens")
    axes[3].set_title("(M, N) budget table: trace")
    window = max(1, args.iterations // 10)
    for name in compared:
        eff = np.mean([[row["effective_ratio"] for row in r["iterations"]] for r in by_method[name]], axis=0)
        smooth = np.convolve(eff, np.ones(window) / window, mode="valid")
        axes[2].plot(np.arange(window, len(eff) + 1), smooth, label=name)
    axes[2].set_title(f"effective ratio per iteration (mean over seeds, {window}-iteration running mean)")
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("share of prompts with mixed outcomes")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


QUICK = {
    "seeds": [0],
    "tasks": 8,
    "pool": 8,
    "leaves": 12,
    "iterations": 2,
    "eval_every": 1,
    "eval_samples": 1,
    "sft_steps": 4,
    "sft_min": 2,
    "sft_check": 2,
    "demos": 2,
    "workers": 1,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run for the test suite (~30 s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=3, help="seeds run in parallel processes, one thread each")
    p.add_argument("--tasks", type=int, default=32, help="chain tasks (training pool = evaluation set)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--choices", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--leaves", type=int, default=24, help="leaves per iteration, every method")
    p.add_argument("--expansion", type=int, default=2, help="N, continuations per bare rollout")
    p.add_argument("--max-per-prompt", type=int, default=8)
    p.add_argument("--pool", type=int, default=16, help="candidate prompts per iteration")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--estimator", default="tree_grpo")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=4, help="episodes per task per evaluation")
    p.add_argument(
        "--teacher-acc", type=float, default=1.0, help="warm start: P(teacher picks the right letter)"
    )
    p.add_argument("--demos", type=int, default=16, help="warm start: teacher episodes per task")
    p.add_argument("--sft-steps", type=int, default=800, help="warm start: at most this many steps")
    p.add_argument("--sft-min", type=int, default=100)
    p.add_argument("--sft-check", type=int, default=25, help="warm start: evaluate every this many steps")
    p.add_argument("--sft-target", type=float, default=0.45, help="warm start: stop at this success")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/learning.json"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/learning.png"))
    p.add_argument("--from-json", type=Path, help="reprint the tables and redraw the plot of a finished run")
    args = p.parse_args(argv)
    if args.from_json is not None:  # the run's own configuration, so the tables describe what ran
        config = json.loads(args.from_json.read_text())["config"]
        return argparse.Namespace(
            **(config | {"out": args.from_json, "plot": args.plot, "from_json": args.from_json})
        )
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        print_tables(summarize(result["seeds"]), args)
        plot(result["seeds"], args, args.plot)
        return
    torch.set_num_threads(1)
    start = time.perf_counter()
    if args.workers > 1 and len(args.seeds) > 1:
        with mp.get_context("spawn").Pool(min(args.workers, len(args.seeds))) as pool:
            seed_results = pool.starmap(run_seed, [(args, s) for s in args.seeds])
    else:
        seed_results = [run_seed(args, s) for s in args.seeds]
    summary = summarize(seed_results)
    verdicts = print_tables(summary, args)
    seconds = time.perf_counter() - start
    print(f"\ntotal {seconds:.0f} s; JSON {args.out}; plot {args.plot}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {
        "config": config,
        "seconds": seconds,
        "verdicts": verdicts,
        "summary": summary,
        "seeds": seed_results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    plot(seed_results, args, args.plot)


if __name__ == "__main__":
    main()
