"""Learning benchmark: does TRACE learn more per sampled trajectory than GRPO?

    python benchmarks/learning.py             # the full run reported in BENCHMARKS.md
    python benchmarks/learning.py --quick     # the test suite's smoke run (tests/test_bench_learning.py)
    python benchmarks/learning.py --from-json benchmarks/results/learning.json   # reprint, redraw

Seeds vary the RL randomness (pools, sampling, predictor refit) and the evaluation draw; the task
sets and the warm start are shared, so methods are paired within a seed.
1. Testbed: `DecisiveEnv` (envs/decisive.py): `--tasks` training tasks and `--heldout-tasks` held-out tasks
   (another seed; never trained on) with heterogeneous difficulty and one decisive turn each.
2. Warm start (supervised, not RL), shared by every seed and method and cached under `--cache`: a tiny
   Qwen3 fitted for exactly `--sft-steps` steps to episodes of the imperfect teacher `teacher_pick` on
   the training tasks. A fixed number of steps, so the start is not picked by the evaluation that
   later measures it; each seed measures it with its own evaluation seed.
3. RL, per method, from that warm start: the product's own loop, i.e. a Lightning `Trainer` built
   from `conf/trainer/cpu.yaml` (gradient clipping, one epoch per iteration, dataloaders reloaded
   every epoch) around `TraceModule` and `RolloutDataModule` (pool, predictor refit, allocation,
   advantages, micro-batches and the non-finite guards exactly as in training). Every method spends
   `--leaves` leaves per iteration (asserted), except the (M, N) table's extra runs.
4. Evaluation before RL and every `--eval-every` iterations: success on the held-out tasks,
   `--eval-samples` episodes each, at the training temperature, with a torch seed used nowhere else
   (the start value is measured with it too). Its tokens are in no budget.

Methods: uniform (GRPO, groups of 4), grpo_trace_prompts (GRPO with trace's prompt count: groups of
`--control-group`), pcl, random_expand, trace (the shipped default), trace_pooled (the earlier default:
pooled rates behind a gate at 0.25, Stage 2 at the mean; the variants below change it), trace_shared_sum
(a shared prefix weighted once per leaf), trace_bounded and trace_ungated_bounded (bounded tree
advantages, gated and ungated),
uniform_spread and trace_spread (each tree's leaves dealt across the iteration's optimizer steps),
trace_quota and trace_ungated_quota (no attribute cell given more than GRPO's share of candidates),
trace_ungated_n0 and true_v_n0 (Stage 1 alone, steered every iteration by pooled or true rates),
trace_ungated_head (steered every iteration by the predictor's per-prompt estimates, no pooling),
trace_head_gate0 (the same behind a skill gate at 0) with trace_head_gate0_n0 (Stage 1 alone) and
trace_head_gate0_bounded (bounded tree advantages), and trace_ungated_head_n0; trace_split and
trace_head_gate0_split (the turns sampled from one prefix share one trajectory's prompt-level credit),
trace_head_gate0_tokens (Stage 2 priced in tokens with a contrast, not leaves), trace_head_gate0_sure
(each bucket priced one posterior std below its mean flip rate), trace_head_gate0_grow (each bucket buys
at most its measured continuations), trace_head_gate0_sure_grow (both) and trace_sure_grow (both, on
the earlier default's selection); trace_attributes (the shipped default with Stage 1 on rates pooled by
the tasks' attributes), trace_attributes_thompson (the same on one posterior sample per candidate) and
trace_attributes_quota (the same with no attribute cell given more than its share of GRPO's prompts);
Table 1: trace_root_only, trace_prefix_only (the shipped trace's Stage 1 settings); the (M, N)
table: trace at (M, 3N) and (2M, N); remedies for Stage 1: trace_explore (Thompson sampling, epoch
pools and a visit cap) and trace_gate (the calibration gate).
Verdicts (`verdicts`): every method makes the same optimizer steps; the head online (Spearman with the
probe >= 0.70, Brier <= 0.8x the base rate's, expected mixed prompts >= 0.8x the true-v allocation's);
at equal leaves trace recovers >= 50% of true_v's gain over GRPO; at an equal token budget (`--tokens`)
trace gains >= +0.02 over GRPO, in >= 4 of 5 seeds, and no less than random_expand.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import multiprocessing as mp
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trace_lightning import allocation as alloc
from trace_lightning import config
from trace_lightning.advantages import ESTIMATORS, GRPO, TreeGRPO, node_advantages
from trace_lightning.allocation import BetaPrior
from trace_lightning.batching import collate, leaf_sequences
from trace_lightning.budget import Budget
from trace_lightning.callbacks import SuccessProbe
from trace_lightning.collector import Learner, RolloutCollector
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams, ScriptedEngineBase
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.decisive import TEACHER_SHIFT_ACCURACY, DecisiveEnv, teacher_pick
from trace_lightning.iteration import Iteration, build_trees
from trace_lightning.metrics import BUDGET_UNITS, budget_row, running_sums
from trace_lightning.models import build_policy, build_tiny_model
from trace_lightning.module import TraceModule
from trace_lightning.predictor import PredictorSettings
from trace_lightning.runner import EpisodeLimits, ReActRunner
from trace_lightning.selection import Selection
from trace_lightning.tree import SUCCESS, tree_stats

MAX_NEW_TOKENS = 10  # "<choose>X</choose>" is 7 tokens with the tiny tokenizer
MAX_EPISODE_TOKENS = 320


# --------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    allocator: alloc.TreeAllocator
    leaves: int
    selection: dict[str, Any] = field(default_factory=dict)
    predictor: PredictorSettings = field(default_factory=PredictorSettings)  # the product's by default
    true_v: bool = False  # Stage 1 on Monte Carlo success rates (an upper bound, not a method)
    estimator: Any = None  # the advantage estimator; None: --estimator
    spread: bool = False  # each tree's leaves dealt across the iteration's steps (data.spread_trees)


def policy_state_head(args: argparse.Namespace) -> PredictorSettings:
    """The earlier predictor: an MLP on the policy's own states (last + mean), refitted on
    undecayed labels, no text, no calibration; sized as this benchmark always sized it."""
    return PredictorSettings.policy_state(
        width=64,
        lr=args.predictor_lr,
        standardize=True,
        pooling=args.pooling,
        refit_steps=args.refit_steps,
        replay_window=args.replay_window,
        refit_batch=256,
    )


MEAN_PRICED = {"confidence": 0.0, "growth": None}  # Stage 2 at each bucket's posterior mean, uncapped


def methods(args: argparse.Namespace) -> dict[str, Method]:
    """`trace` is `experiment=trace` as the shipped config composes it (allocator, selection, predictor
    defaults), so the benchmark measures what a user runs. The others vary one thing against the earlier
    default, `trace_pooled` (Stage 1 on success rates pooled by the tasks' attributes behind a gate at
    0.25, Stage 2 priced at each bucket's posterior mean, uncapped), under which they were recorded."""
    n, leaves, cap = args.expansion, args.leaves, args.max_per_prompt
    m = leaves // (1 + n)
    allocator = args.experiment["allocator"]
    shipped = instantiate(allocator)

    def priced(**changes: Any) -> Any:  # the earlier default's Stage 2 pricing with some settings changed
        return instantiate(allocator | {"pricing": allocator["pricing"] | MEAN_PRICED | changes})

    mean, in_tokens, sure, grow = priced(), priced(worth="tokens"), priced(confidence=1.0), priced(growth=1.0)
    sure_grow = priced(confidence=1.0, growth=1.0)
    stage1 = {k: allocator[k] for k in ("min_group", "max_per_prompt", "breadth")}
    selection = dict(args.experiment["selection"])
    pooled = selection | {"attributes": True, "gate_skill": 0.25}  # the earlier default's selection
    explore = {"thompson": True, "epoch_pools": True, "max_visits": 2, "visit_window": 8}
    gate = {"explore_groups": 2, "gate_skill": 0.0}
    head = {
        "gate_skill": None,
        "attributes": False,
    }  # the head's per-prompt estimates, steering every iteration
    head_gate0 = head | {"gate_skill": 0.0}  # the same, while their slice skill beats the base rate
    old = policy_state_head(args)
    return {
        "uniform": Method(alloc.uniform(4), leaves),
        "grpo_trace_prompts": Method(alloc.uniform(args.control_group), leaves),
        "pcl": Method(alloc.pcl(4), leaves),
        "random_expand": Method(alloc.random_expand(2, n), leaves),
        "trace": Method(shipped, leaves, selection),
        "trace_pooled": Method(mean, leaves, pooled),  # the earlier default
        # the earlier predictor, on the same allocator: where the gap to true_v came from
        "trace_head": Method(mean, leaves, pooled, old),
        # the unbiased slice and the skill gate, with a predictor that has skill and one that has little
        "trace_gate": Method(mean, leaves, pooled | gate),
        "trace_head_gate": Method(mean, leaves, pooled | gate, old),
        # the estimates steer every iteration, whatever their measured skill (as true_v does)
        "trace_ungated": Method(mean, leaves, pooled | {"gate_skill": None}),
        # NOT a method: Stage 1 steered by `--true-v-samples` fresh episodes of every candidate, outside
        # the budget and training nothing (TrueVCollector). The ceiling every predictor is read
        # against.
        "true_v": Method(mean, leaves, pooled, true_v=True),
        # Table 1 with the earlier default's Stage 1 (groups, cap, breadth) and N
        "trace_root_only": Method(alloc.trace_root_only(n, **stage1), leaves, pooled),
        "trace_prefix_only": Method(alloc.trace_prefix_only(stage1["min_group"], n), leaves, pooled),
        # trace, with a prefix shared by k leaves trained at k times the weight (once per leaf)
        "trace_shared_sum": Method(mean, leaves, pooled, estimator=TreeGRPO(shared_prefix="sum")),
        # trace, and its ungated twin, with the tree advantages bounded (advantages.tree_grpo_bounded)
        "trace_bounded": Method(mean, leaves, pooled, estimator=TreeGRPO(bounded=True)),
        "trace_ungated_bounded": Method(
            mean, leaves, pooled | {"gate_skill": None}, estimator=TreeGRPO(bounded=True)
        ),
        # trace, and its ungated twin, with no attribute cell given more than GRPO's share of candidates
        "trace_quota": Method(mean, leaves, pooled | {"cell_quota": 1.0}),
        "trace_ungated_quota": Method(mean, leaves, pooled | {"gate_skill": None, "cell_quota": 1.0}),
        # steered every iteration by the predictor's own per-prompt estimates instead of pooled rates
        "trace_ungated_head": Method(mean, leaves, pooled | head),
        # the same estimates behind a gate at skill 0 (steer while they beat the base rate), and alone (N = 0)
        "trace_head_gate0": Method(mean, leaves, pooled | head_gate0),
        "trace_ungated_head_n0": Method(alloc.trace(0, **stage1), leaves, pooled | head),
        # the head gated at 0 with Stage 1 alone, and with bounded tree advantages (the real model's suspects)
        "trace_head_gate0_n0": Method(alloc.trace(0, **stage1), leaves, pooled | head_gate0),
        "trace_head_gate0_bounded": Method(
            mean, leaves, pooled | head_gate0, estimator=TreeGRPO(bounded=True)
        ),
        # the earlier default and the head gated at 0 with the turns sampled from one prefix sharing one
        # trajectory's weight (advantages.branch_weights)
        "trace_split": Method(mean, leaves, pooled, estimator=TreeGRPO(branch_weight=True)),
        "trace_head_gate0_split": Method(
            mean, leaves, pooled | head_gate0, estimator=TreeGRPO(branch_weight=True)
        ),
        # the head gated at 0 with Stage 2 priced in tokens that get a contrast instead of leaves
        "trace_head_gate0_tokens": Method(in_tokens, leaves, pooled | head_gate0),
        # ... and with each bucket priced one posterior std below its mean flip rate
        "trace_head_gate0_sure": Method(sure, leaves, pooled | head_gate0),
        # ... with each bucket buying at most what it has measured, and with both rules
        "trace_head_gate0_grow": Method(grow, leaves, pooled | head_gate0),
        "trace_head_gate0_sure_grow": Method(sure_grow, leaves, pooled | head_gate0),
        # the earlier default's selection (pooled rates, gate 0.25) with both rules
        "trace_sure_grow": Method(sure_grow, leaves, pooled),
        # today's default with Stage 1's estimates pooled by the tasks' attributes (one switch)
        "trace_attributes": Method(shipped, leaves, selection | {"attributes": True}),
        # ... on one posterior sample per candidate: a cell's candidates no longer tie (selection.thompson)
        "trace_attributes_thompson": Method(
            shipped, leaves, selection | {"attributes": True, "thompson": True}
        ),
        # ... with no attribute cell given more than its share of GRPO's prompts (selection.cell_quota)
        "trace_attributes_quota": Method(
            shipped, leaves, selection | {"attributes": True, "cell_quota": 1.0}
        ),
        # Stage 1 alone (N = 0), steered every iteration by the pooled estimates, and by true rates
        "trace_ungated_n0": Method(alloc.trace(0, **stage1), leaves, pooled | {"gate_skill": None}),
        "true_v_n0": Method(alloc.trace(0, **stage1), leaves, pooled, true_v=True),
        # GRPO and trace with each tree's leaves dealt across the iteration's steps (data.spread_trees)
        "uniform_spread": Method(alloc.uniform(4), leaves, spread=True),
        "trace_spread": Method(mean, leaves, pooled, spread=True),
        f"trace_m{m}_n{3 * n}": Method(alloc.trace(3 * n, max_per_prompt=cap), m * (1 + 3 * n)),
        f"trace_m{2 * m}_n{n}": Method(alloc.trace(n, max_per_prompt=cap), 2 * m * (1 + n)),
        "trace_explore": Method(mean, leaves, pooled | explore),
    }


def run_budget(method: Method, args: argparse.Namespace) -> Budget:
    """`--leaves` leaves per iteration; with `--tokens`, that many generated tokens per iteration, the
    leaves derived from each method's own cost per leaf (`budget.unit=tokens`), at most 1.5x its leaves
    (trace's leaves cost about 0.8x GRPO's here, so the bound does not bind; twice would not fit the
    quick mode's pool)."""
    if args.tokens is None:
        return Budget(method.leaves)
    step = method.allocator.leaf_step()
    return Budget(3 * method.leaves // 2 // step * step, args.tokens, "tokens")


def budget_names(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(name, M, N) of the budget table: (M, N) is the main trace run."""
    n, m = args.expansion, args.leaves // (1 + args.expansion)
    return [("trace", m, n), (f"trace_m{m}_n{3 * n}", m, 3 * n), (f"trace_m{2 * m}_n{n}", 2 * m, n)]


# --------------------------------------------------------------------------- warm start


@dataclass
class TeacherEngine(ScriptedEngineBase):
    """A scripted `GenerationEngine`: reads the last cue of the conversation ("Key 2: F" or "Key 2: F+2=H")
    and answers as `teacher_pick` would (the shift applied with the teacher's accuracy)."""

    tokenizer: Any
    env: DecisiveEnv
    rng: np.random.Generator
    stats: EngineStats = field(default_factory=EngineStats)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            cue = re.findall(r"Key \d+: ([A-Z](?:\+\d=[A-Z])?)\.", text)[-1]
            ids = self.tokenizer(f"<choose>{teacher_pick(cue, self.rng)}</choose>", add_special_tokens=False)[
                "input_ids"
            ]
            out.append(Completion(list(ids), [0.0] * len(ids), "stop"))
        return out


def play_all(runner: ReActRunner, per_task: int, rng: np.random.Generator) -> Iteration:
    """`per_task` episodes of every task of the runner's environment (no allocation, no predictor)."""
    pool = [runner.new_tree(t) for t in sorted(runner.tasks)]

    def flat(trees: Sequence[Any], nodes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return [np.full(len(n), 0.5) for n in nodes]

    return build_trees(pool, alloc.uniform(per_task), Budget(per_task * len(pool)), flat, runner, rng)


def warm_start(module: TraceModule, env: DecisiveEnv, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """`sft_steps` supervised steps on teacher episodes (loss on the policy's own tokens only)."""
    rng = np.random.default_rng(seed)
    teacher = TeacherEngine(module.tokenizer, env, rng)
    limits = EpisodeLimits(args.turns, MAX_EPISODE_TOKENS)
    runner = ReActRunner(teacher, module.tokenizer, env, SamplingParams(MAX_NEW_TOKENS, 1.0), limits)
    demos = play_all(runner, args.demos, rng).trees
    seqs = leaf_sequences(demos, node_advantages(demos, GRPO()))
    opt = torch.optim.AdamW(module.policy.parameters(), lr=args.sft_lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(args.sft_steps):
        rows = torch.randperm(len(seqs), generator=gen)[: args.sft_batch].tolist()
        batch = collate([seqs[i] for i in rows], module.tokenizer.pad_token_id)
        logp = module._forward(module.policy, batch.input_ids, batch.attention_mask)[0]  # [B, T]
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    teacher_success = float(np.mean([t.nodes[x].reward >= SUCCESS for t in demos for x in t.leaves()]))
    return {"steps": args.sft_steps, "demos": len(seqs), "teacher_success": teacher_success}


# --------------------------------------------------------------------------- evaluation


def evaluate(module: TraceModule, env: DecisiveEnv, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Held-out success (`eval_samples` episodes per task), with a torch seed no other stage uses; the
    caller's RNG state is restored. Also the per-task success, for the difficulty spread."""
    engine = HFEngine(module.policy, module.tokenizer, max_batch_size=256)
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature=args.temperature)
    runner = ReActRunner(
        engine, module.tokenizer, env, sampling, EpisodeLimits(args.turns, MAX_EPISODE_TOKENS)
    )
    state = torch.get_rng_state()
    torch.manual_seed(1_000_000 + seed)
    trees = play_all(runner, args.eval_samples, np.random.default_rng(seed)).trees
    torch.set_rng_state(state)
    per_task = [float(np.mean([t.nodes[x].reward >= SUCCESS for x in t.leaves()])) for t in trees]
    return {"success": float(np.mean(per_task)), "per_task": per_task}


def difficulty(per_task: list[float]) -> dict[str, float]:
    """Share of tasks that (almost) never / always succeed, and GRPO's expected effective ratio at
    groups of 4 if each task's success rate were its measured one."""
    p = np.array(per_task)
    return {
        "never": float(np.mean(p <= 0.05)),
        "always": float(np.mean(p >= 0.95)),
        "expected_grpo_effective": float(np.mean(1 - p**4 - (1 - p) ** 4)),
    }


# --------------------------------------------------------------------------- one RL run


def iteration_row(data: RolloutDataModule, train_seconds: float) -> dict[str, float]:
    res = data.report.result
    stats = [tree_stats(t) for t in res.trees]
    leaves = res.ledger.leaves_used
    quality = data.report.root_quality
    return {
        "leaves": leaves,
        "tokens": res.ledger.tokens_used,
        "optimizer_steps": data.report.optimizer_steps,
        "prompts": len(res.trees),
        "mixed_prompts": int(sum(s.mixed for s in stats)),
        "effective_ratio": float(np.mean([s.mixed for s in stats])),
        "mixed_prefix_per_100": 100 * sum(sum(s.mixed_by_depth[1:]) for s in stats) / leaves,
        "train_success": float(
            np.mean([t.nodes[x].reward >= SUCCESS for t in res.trees for x in t.leaves()])
        ),
        "pool_pred_sd": float(np.std(res.pool_predicted)),
        "slice_skill": quality.slice_skill if quality is not None else float("nan"),
        "gate": float(quality.gate_open) if quality is not None else float("nan"),
        "distinct_tasks": len({t.task_id for t in res.trees}),
        **budget_row(data.report, train_seconds),  # every budget unit, tokens and leaves too
    }


class Recorder(L.Callback):
    """Per-iteration rows from the DataModule's report, and the held-out evaluation every few epochs."""

    def __init__(self, name: str, env: DecisiveEnv, args: argparse.Namespace, seed: int, leaves: int) -> None:
        self.name, self.env, self.args, self.seed, self.leaves = name, env, args, seed, leaves
        self.rows: list[dict[str, float]] = []
        self.evals: list[dict[str, Any]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.rows.append(iteration_row(trainer.datamodule, time.perf_counter() - self._epoch_start))
        row = self.rows[-1]
        if self.args.tokens is None:
            assert row["leaves"] == self.leaves, (
                f"{self.name} spent {row['leaves']} leaves, budget {self.leaves}"
            )
        else:  # a token budget: the leaves are derived, the tokens are the hard limit
            assert row["tokens"] <= self.args.tokens, f"{self.name} spent {row['tokens']} tokens"
        it = len(self.rows)
        if it % self.args.eval_every == 0 or it == self.args.iterations:
            cum = {k: sum(r[k] for r in self.rows) for k in BUDGET_UNITS}
            self.evals.append(
                {
                    "iteration": it,
                    **cum,
                    "success": evaluate(module, self.env, self.args, self.seed)["success"],
                }
            )


def shipped_config(root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The CLI's own Trainer settings (conf/trainer/cpu.yaml: gradient clipping, one epoch per
    iteration, dataloaders reloaded every epoch) and `experiment=trace`'s allocator and selection.
    Composed once, before the workers start."""
    config.register()
    overrides = ["trainer=cpu", f"run_dir={root}", "logger=none", "callbacks=none", "experiment=trace"]
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    experiment = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("allocator", "selection")}
    experiment["selection"].pop("_target_")  # type: ignore[union-attr]
    return OmegaConf.to_container(cfg.trainer, resolve=True), experiment  # type: ignore[return-value]


def product_trainer(args: argparse.Namespace, callbacks: list[L.Callback], root: str) -> L.Trainer:
    return instantiate(
        args.trainer | {"default_root_dir": root},
        max_epochs=args.iterations,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def train_run(
    name: str,
    method: Method,
    model_dir: str,
    warm: dict[str, torch.Tensor],
    envs: tuple,
    args,
    seed: int,
    start,
) -> dict[str, Any]:
    train_env, heldout_env = envs
    torch.manual_seed(seed)
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature=args.temperature)
    head = method.predictor
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    module = TraceModule(build_policy(model_dir), optimizer, sampling=sampling, predictor=head)
    module.policy.load_state_dict(warm)
    data = RolloutDataModule(
        env=train_env,
        allocator=method.allocator,
        engine=functools.partial(HFEngine, max_batch_size=128),
        sampling=sampling,
        budget=run_budget(method, args),
        settings=DataSettings(
            pool_size=args.pool,
            micro_batch_size=args.micro_batch,
            micro_batch_tokens=None,
            max_turns=args.turns,
            max_episode_tokens=MAX_EPISODE_TOKENS,
            # equal leaves: a step per micro-batch of --micro-batch leaves, the same for all; a token
            # budget, or leaves dealt across steps: as many steps as --leaves would make
            steps_per_iteration=(
                None if args.tokens is None and not method.spread else args.leaves // args.micro_batch
            ),
            spread_trees=method.spread,
        ),
        estimator=method.estimator or ESTIMATORS[args.estimator](),
        cold_start=BetaPrior(warmup=1, decay=args.decay),
        selection=Selection(**method.selection),
        predictor_fit=head.refit(seed),
        seed=seed,
        collector=(
            functools.partial(TrueVCollector, samples=args.true_v_samples, probe_seed=seed)
            if method.true_v
            else RolloutCollector
        ),
    )
    recorder = Recorder(name, heldout_env, args, seed, method.leaves)
    recorder.evals.append({"iteration": 0, **dict.fromkeys(BUDGET_UNITS, 0), "success": start["success"]})
    probe = SuccessProbe(args.probe_every, args.probe_half, args.max_per_prompt, seed=3_000_017 + 97 * seed)
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        product_trainer(args, [probe, recorder], root).fit(module, datamodule=data)
    seconds = time.perf_counter() - clock
    rows, evals = recorder.rows, recorder.evals
    print(
        f"  seed {seed} {name:20s} held-out {evals[0]['success']:.3f} -> {evals[-1]['success']:.3f}  "
        f"eff {np.mean([r['effective_ratio'] for r in rows]):.3f}  "
        f"mixed/it {np.mean([r['mixed_prompts'] for r in rows]):.2f}  {seconds:.0f} s",
        flush=True,
    )
    return {
        "method": name,
        "seed": seed,
        "leaves_per_iteration": method.leaves,
        "iterations": running_sums(rows),
        "evals": evals,
        "probes": [{"iteration": it, **m} for it, m in probe.history],
        **({"probe_rates": probe_rates(probe)} if getattr(args, "probe_rates", False) else {}),
        "seconds": seconds,
    }


def probe_rates(probe: SuccessProbe) -> list[dict[str, Any]]:
    """Every probe's candidates with the head's raw prediction, each half's successes (of `half`
    episodes each) and the bare rollouts Stage 1 gave them."""
    return [
        {
            "iteration": it,
            "episodes": 2 * probe.half,
            "task_ids": ids,
            "predicted": list(map(float, p)),
            "half_a": list(map(float, a)),
            "half_b": list(map(float, b)),
            "counts": list(map(int, c)),
        }
        for it, ids, p, a, b, c in probe.rates
    ]


class TrueVCollector(RolloutCollector):
    """The `true_v` row, an upper bound and not a method: Stage 1 steered by Monte Carlo success rates of
    the pool under the current policy (`samples` episodes each, outside the budget, training nothing),
    what it would see with a perfect predictor, up to the probe's noise."""

    def __init__(self, *args: Any, samples: int, probe_seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples, self.probe_seed = samples, probe_seed

    def stage1_estimates(
        self, module: Learner, pool_ids: list[int], predicted: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        # the selection's estimates are still drawn (and dropped), so the RNG streams match the other rows
        super().stage1_estimates(module, pool_ids, predicted)
        # probe seeds of their own, so the probe rows never see the same episodes
        seed = 5_000_011 + 1_009 * self.probe_seed + self.iteration
        rates = self.evaluator.probe(module, pool_ids, self.samples, seed) / self.samples
        return np.asarray(rates, dtype=np.float64), True  # the ceiling always steers: it is not gated


def testbed(args: argparse.Namespace) -> tuple[DecisiveEnv, DecisiveEnv]:
    """The training and held-out task sets: the same for every seed (seeds vary the RL randomness)."""
    return (
        DecisiveEnv(args.tasks, args.heldout_tasks, "train", args.task_seed),
        DecisiveEnv(args.tasks, args.heldout_tasks, "heldout", args.task_seed),
    )


def warm_start_path(args: argparse.Namespace) -> Path:
    """Where the shared warm start is cached: a hash of everything it depends on."""
    keys = ("tasks", "task_seed", "hidden", "layers", "demos", "sft_steps", "sft_lr", "sft_batch", "turns")
    spec = json.dumps(
        {k: getattr(args, k) for k in keys} | {"teacher": TEACHER_SHIFT_ACCURACY}, sort_keys=True
    )
    return args.cache / f"warm_{hashlib.sha256(spec.encode()).hexdigest()[:16]}.pt"


def untrained_module(model_dir: str, args: argparse.Namespace) -> TraceModule:
    """The module the warm start trains and evaluations sample with (its head is never read)."""
    head = PredictorSettings.policy_state(width=64, coef=1.0, pooling="last", standardize=False)
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    return TraceModule(build_policy(model_dir), optimizer, predictor=head)


def shared_warm_start(args: argparse.Namespace) -> dict[str, Any]:
    """The supervised warm start every seed and method starts from, computed once (and cached)."""
    path = warm_start_path(args)
    if path.exists():
        return torch.load(path, weights_only=True)
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, hidden_size=args.hidden, layers=args.layers, seed=args.task_seed)
        torch.manual_seed(args.task_seed)
        module = untrained_module(model_dir, args)
        info = warm_start(module, testbed(args)[0], args, args.task_seed)
        state = {
            "weights": module.policy.state_dict(),
            "info": info | {"seconds": time.perf_counter() - clock},
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a warm start's weights: a seed file's runs are resumed only from the same ones."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def seed_file(args: argparse.Namespace, seed: int) -> Path:
    """Where a seed's runs are kept as each one ends (`--resume` reads them back)."""
    return args.out.with_name(f".{args.out.stem}_seed{seed}.json")


def earlier_runs(args: argparse.Namespace, seed: int, warm: str) -> dict[str, Any] | None:
    """The seed file an earlier run left (`--resume`), or None where there is none or its runs started
    from another warm start: a warm start rebuilt on another machine or library version can differ, and
    runs from two warm starts are not a paired comparison. `warm`: the current warm start's `fingerprint`."""
    path = seed_file(args, seed)
    if not (args.resume and path.exists()):
        return None
    result = json.loads(path.read_text())
    if result["warm_start"].get("weights") != warm:
        print(f"seed {seed}: not resuming {path}: its runs began from another warm start", flush=True)
        return None
    return result


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Every method of one seed from the shared warm start (one worker process)."""
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "trace_lightning"):  # one line per run is enough
        logging.getLogger(name).setLevel(logging.WARNING)
    clock = time.perf_counter()
    envs = testbed(args)
    warm = shared_warm_start(args)
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, hidden_size=args.hidden, layers=args.layers, seed=args.task_seed)
        module = untrained_module(model_dir, args)
        module.policy.load_state_dict(warm["weights"])
        start = evaluate(module, envs[1], args, seed)  # this seed's evaluation seed, used for every method
        # The difficulty spread needs more episodes per task than an evaluation point has.
        spread = evaluate(module, envs[1], argparse.Namespace(**vars(args) | {"eval_samples": 8}), seed + 500)
        info = warm["info"] | {"heldout_success": start["success"], **difficulty(spread["per_task"])}
        info |= {"weights": fingerprint(warm["weights"])}
        print(f"seed {seed}: warm start {info}", flush=True)
        path = seed_file(args, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = (earlier_runs(args, seed, info["weights"]) or {"runs": []})["runs"]
        weights = warm["weights"]
        kept = {r["method"]: r for r in earlier}
        runs = []
        for name, method in methods(args).items():
            if args.methods and name not in args.methods:
                continue
            run = kept.get(name) or train_run(name, method, model_dir, weights, envs, args, seed, start)
            runs.append(run)
            kept[name] = run  # each run is kept as soon as it ends, beside the file's other methods
            path.write_text(json.dumps({"seed": seed, "warm_start": info, "runs": list(kept.values())}))
    return {"seed": seed, "warm_start": info, "runs": runs, "seconds": time.perf_counter() - clock}


def finished_seed(args: argparse.Namespace, seed: int, warm: str) -> dict[str, Any] | None:
    """The seed's result from an earlier run's file, restricted to the requested methods, or None
    when there is no such file or it lacks one of them (then `run_seed` trains only the missing ones).
    The file records the warm start (`earlier_runs`) but not the arguments: resuming is only honest
    with the same ones."""
    result = earlier_runs(args, seed, warm)
    if result is None:
        return None
    wanted = [m for m in methods(args) if m in args.methods or not args.methods]  # run_seed's order
    runs = {r["method"]: r for r in result["runs"]}
    if not set(wanted) <= set(runs):
        return None
    print(f"seed {seed}: taken from {seed_file(args, seed)} ({', '.join(wanted)})", flush=True)
    return result | {"runs": [runs[m] for m in wanted]}


# --------------------------------------------------------------------------- summary


def smoothed(evals: list[dict[str, float]]) -> np.ndarray:
    """Success at each evaluation, averaged with the one before (one evaluation is a few hundred
    episodes): "final success" and "first reached" both use this two-point trailing mean."""
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
    base = {
        k: float(np.mean([r[k] for r in grpo["iterations"]])) for k in ("effective_ratio", "mixed_prompts")
    }
    out = {}
    for name, r in runs.items():
        mean = {k: float(np.mean([row[k] for row in r["iterations"]])) for k in r["iterations"][0]}
        # Where GRPO ended no higher than the shared start, every method "reaches" its final success at
        # 0 leaves; the comparison says nothing there, so it is left undefined (nan) for that seed.
        reach = leaves_to_reach(r["evals"], target) if target > grpo["evals"][0]["success"] else float("nan")
        out[name] = {
            "final_success": float(smoothed(r["evals"])[-1]),
            "start_success": float(r["evals"][0]["success"]),
            "gain_vs_grpo": float(smoothed(r["evals"])[-1]) - target,
            "effective_ratio": mean["effective_ratio"],
            "effective_x_uniform": _ratio(mean["effective_ratio"], base["effective_ratio"]),
            "mixed_prompts_per_iteration": mean["mixed_prompts"],
            "mixed_prompts_x_uniform": _ratio(mean["mixed_prompts"], base["mixed_prompts"]),
            "prompts_per_iteration": mean["prompts"],
            "leaves_to_grpo_final": reach,
            "leaves_x_grpo": reach / grpo_total,
            "total_leaves": float(r["evals"][-1]["leaves"]),
            "tokens_per_iteration": mean["tokens"],
            "leaves_per_iteration": mean["leaves"],
            "steps_per_iteration": mean["optimizer_steps"],
            "mixed_prefix_per_100": mean["mixed_prefix_per_100"],
            "pool_pred_sd": mean["pool_pred_sd"],
        } | probe_summary(r["probes"])
    return out


def probe_summary(probes: list[dict[str, float]]) -> dict[str, float]:
    """The probe's gauges averaged over the run's probes: the head's Spearman with the probed
    success rates (and on v(1 - v)), its Brier score next to the base rate's, and the expected mixed
    groups of the run's allocations relative to the probe's own (true v) and to random pairs."""
    if not probes:
        return {}

    def mean(key: str) -> float:
        values = np.array([p[key] for p in probes])
        return float(values[np.isfinite(values)].mean()) if np.isfinite(values).any() else float("nan")

    return {
        "probe_spearman": mean("probe/spearman"),
        "probe_spearman_contrast": mean("probe/spearman_contrast"),
        "probe_spearman_ceiling": mean("probe/spearman_ceiling"),
        "probe_brier": mean("probe/brier"),
        "base_rate_brier": mean("probe/base_rate_brier"),
        "expected_mixed": mean("probe/expected_mixed"),
        "expected_mixed_true_v": mean("probe/expected_mixed_true_v"),
        "expected_mixed_random": mean("probe/expected_mixed_random"),
        "expected_mixed_x_true_v": _ratio(mean("probe/expected_mixed"), mean("probe/expected_mixed_true_v")),
        "expected_mixed_x_random": _ratio(mean("probe/expected_mixed"), mean("probe/expected_mixed_random")),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def summarize(seed_results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean, std, min and max over seeds of every per-seed metric; `reached` counts finite values."""
    per_seed = [per_seed_metrics(s) for s in seed_results]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in per_seed[0]:
        out[name] = {}
        for key in per_seed[0][name]:
            v = np.array([p[name][key] for p in per_seed])
            finite = v[np.isfinite(v)]
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


MAIN = [
    "uniform",
    "grpo_trace_prompts",
    "pcl",
    "random_expand",
    "true_v",
    "trace",
    "trace_pooled",
    "trace_shared_sum",
    "trace_head",
    "trace_gate",
    "trace_head_gate",
    "trace_explore",
    "trace_ungated",
    "trace_bounded",
    "trace_ungated_bounded",
    "uniform_spread",
    "trace_spread",
    "trace_quota",
    "trace_ungated_quota",
    "trace_ungated_n0",
    "true_v_n0",
    "trace_ungated_head",
    "trace_head_gate0",
    "trace_ungated_head_n0",
    "trace_head_gate0_n0",
    "trace_head_gate0_bounded",
    "trace_split",
    "trace_head_gate0_split",
    "trace_head_gate0_tokens",
    "trace_head_gate0_sure",
    "trace_head_gate0_grow",
    "trace_head_gate0_sure_grow",
    "trace_sure_grow",
    "trace_attributes",
    "trace_attributes_thompson",
    "trace_attributes_quota",
]


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The main table, Table 1, the (M, N) table and the verdict on each target; returns the verdicts."""
    seeds = len(summary["uniform"]["final_success"]["per_seed"])
    tokens = getattr(args, "tokens", None)  # absent from the configs of runs made before the token budget
    budget = f"{args.leaves} leaves per iteration"
    if tokens is not None:
        budget = (
            f"{tokens} generated tokens per iteration (leaves derived, optimizer steps as at {args.leaves})"
        )
    print(
        f"\nMain comparison: {budget}, {args.iterations} iterations, {seeds} seeds "
        f"(mean ± std over seeds; held-out success, 2-point trailing mean)"
    )
    print(
        f"{'method':20s} {'start':>6s} {'final held-out':>15s} {'x GRPO leaves':>15s} {'eff. ratio':>15s} "
        f"{'x uniform':>13s} {'mixed prompts/it':>17s} {'prompts/it':>10s} {'tokens/it':>9s}"
    )
    for name in [n for n in MAIN if n in summary]:
        s = summary[name]
        print(
            f"{name:20s} {s['start_success']['mean']:6.3f} {fmt(s['final_success']):>15s} "
            f"{fmt(s['leaves_x_grpo'], 2):>15s} {fmt(s['effective_ratio']):>15s} "
            f"{fmt(s['effective_x_uniform'], 2):>13s} {fmt(s['mixed_prompts_per_iteration'], 2):>17s} "
            f"{s['prompts_per_iteration']['mean']:10.1f} {s['tokens_per_iteration']['mean']:9.0f}"
        )
    print("\nTable 1 ablation (root allocation / prefix allocation), same budget")
    print(
        f"{'root':8s} {'prefix':8s} {'method':18s} {'final held-out':>15s} {'eff. ratio':>15s} "
        f"{'prefix mixed/100':>16s}"
    )
    for root, prefix, name in [
        ("uniform", "none", "uniform"),
        ("uniform", "random", "random_expand"),
        ("active", "random", "trace_root_only"),
        ("uniform", "active", "trace_prefix_only"),
        ("active", "active", "trace"),
    ]:
        if name in summary:
            s = summary[name]
            print(
                f"{root:8s} {prefix:8s} {name:18s} {fmt(s['final_success']):>15s} "
                f"{fmt(s['effective_ratio']):>15s} {s['mixed_prefix_per_100']['mean']:16.1f}"
            )
    print(
        "\n(M, N) budget table: trace with M bare rollouts and N continuations each, "
        f"{args.iterations} iterations"
    )
    print(
        f"{'M':>4s} {'N':>3s} {'leaves/iter':>11s} {'final held-out':>15s} {'eff. ratio':>15s} "
        f"{'total leaves':>12s}"
    )
    for name, m, n in budget_names(args):
        if name in summary:
            s = summary[name]
            print(
                f"{m:4d} {n:3d} {m * (1 + n):11d} {fmt(s['final_success']):>15s} "
                f"{fmt(s['effective_ratio']):>15s} {s['total_leaves']['mean']:12.0f}"
            )
    print_probe_table(summary)
    return verdicts(summary, tokens, [n for n, _, _ in budget_names(args)[1:]])


def print_probe_table(summary: dict[str, Any]) -> None:
    """The predictor online: its gauges against the Monte Carlo probe, averaged over probes."""
    print("\nThe predictor online: raw root predictions against a Monte Carlo probe of the pool (mean ± std)")
    cols = [
        ("Spearman", "probe_spearman", 3),
        ("noise ceiling", "probe_spearman_ceiling", 3),
        ("on v(1-v)", "probe_spearman_contrast", 3),
        ("Brier", "probe_brier", 3),
        ("base Brier", "base_rate_brier", 3),
        ("E mixed", "expected_mixed", 2),
        ("x true v", "expected_mixed_x_true_v", 2),
        ("x random", "expected_mixed_x_random", 2),
    ]
    print(f"{'method':18s}" + "".join(f"{name:>16s}" for name, _, _ in cols))
    for name in [n for n in MAIN if n in summary and "probe_spearman" in summary[n]]:
        s = summary[name]
        print(f"{name:18s}" + "".join(f"{fmt(s[key], d):>16s}" for _, key, d in cols))


def verdicts(
    summary: dict[str, Any], tokens: int | None = None, other_budgets: Sequence[str] = ()
) -> list[str]:
    """The targets for `trace` (the shipped experiment), each PASS or MISS with its figures: at equal
    leaves (`tokens` None) it recovers >= half of true_v's gain over GRPO; at an equal token budget it
    gains >= +0.02 over GRPO, in >= 4 of 5 seeds, and no less than random_expand; the predictor online;
    every method makes the same optimizer steps (but `other_budgets`, the (M, N) table's larger runs).
    One line saying so when the shipped `trace` or `uniform` did not run (a screen of other methods)."""
    if "trace" not in summary or "uniform" not in summary:
        return ["no verdicts: they judge the shipped trace against uniform, and a screen ran without them"]
    t = summary["trace"]
    seeds = len(t["gain_vs_grpo"]["per_seed"])
    paired = np.array(t["gain_vs_grpo"]["per_seed"])
    se = paired.std(ddof=1) / np.sqrt(len(paired)) if len(paired) > 1 else float("nan")
    need = math.ceil(0.8 * seeds)
    steps = {
        m: round(s["steps_per_iteration"]["mean"], 6) for m, s in summary.items() if m not in other_budgets
    }
    gain = f"{paired.mean():+.3f} ± {se:.3f} (s.e.), > 0 in {(paired > 0).sum()} of {seeds} seeds"
    lines = [
        (len(set(steps.values())) == 1, f"optimizer steps per iteration equal across methods: {steps}"),
        (
            _mean(t, "probe_spearman") >= 0.70,
            f"Spearman with the probe {fmt(t['probe_spearman'])} (>= 0.70; a predictor that knew the true "
            f"rates would reach {fmt(t['probe_spearman_ceiling'])} against this probe)",
        ),
        (
            _mean(t, "probe_brier") <= 0.8 * _mean(t, "base_rate_brier"),
            f"Brier {fmt(t['probe_brier'])} against the base rate's {fmt(t['base_rate_brier'])} "
            f"(<= 0.8x: {_ratio(_mean(t, 'probe_brier'), _mean(t, 'base_rate_brier')):.2f}x)",
        ),
        (
            _mean(t, "expected_mixed_x_true_v") >= 0.8,
            f"expected mixed prompts of the allocation {fmt(t['expected_mixed_x_true_v'], 2)} x the probe's "
            "own allocation on the same budget (>= 0.8)",
        ),
    ]
    if tokens is None and "true_v" in summary:
        ceiling = _mean(summary["true_v"], "gain_vs_grpo")
        share = paired.mean() / ceiling if ceiling > 0 else float("nan")
        lines.append(
            (
                bool(share >= 0.5),
                f"at equal leaves trace's gain over GRPO {gain} is {share:.0%} of true_v's "
                f"{ceiling:+.3f} (>= 50%)",
            )
        )
    if tokens is not None:
        rival = _mean(summary["random_expand"], "gain_vs_grpo") if "random_expand" in summary else -math.inf
        lines.append(
            (
                bool(paired.mean() >= 0.02 and (paired > 0).sum() >= need and paired.mean() >= rival),
                f"at {tokens} generated tokens per iteration trace minus GRPO {gain} (>= +0.02, >= {need} "
                f"seeds, >= random_expand's {rival:+.3f}; per seed {[round(float(x), 3) for x in paired]})",
            )
        )
    out = [f"{'PASS' if ok else 'MISS'}: {text}" for ok, text in lines]
    print("\n" + "\n".join(out))
    return out


def _mean(method: dict[str, Any], key: str) -> float:
    return float(method[key]["mean"]) if key in method else float("nan")


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
    compared = [n for n in MAIN if n in by_method]
    budget = [n for n, _, _ in budget_names(args) if n in by_method]
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
        ax.set_ylabel("held-out success (2-point mean)")
        ax.legend(fontsize=8)
    axes[0].set_title("held-out success vs leaves (band: min-max over seeds)")
    axes[1].set_title("held-out success vs generated tokens")
    axes[3].set_title("(M, N) budget table: trace")
    window = max(1, args.iterations // 10)
    for name in compared:
        mixed = np.mean([[row["mixed_prompts"] for row in r["iterations"]] for r in by_method[name]], axis=0)
        axes[2].plot(
            np.arange(window, len(mixed) + 1),
            np.convolve(mixed, np.ones(window) / window, "valid"),
            label=name,
        )
    axes[2].set_title(f"mixed prompts per iteration (mean over seeds, {window}-iteration running mean)")
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("prompts with both outcomes")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


QUICK = {
    "seeds": [0],
    "tasks": 40,
    "heldout_tasks": 8,
    "pool": 8,
    "leaves": 24,  # trace's closed gate spends M = 12 bare rollouts in GRPO's groups of 4
    "iterations": 2,
    "eval_every": 1,
    "eval_samples": 1,
    "sft_steps": 4,
    "demos": 1,
    "workers": 1,
    "refit_steps": 5,
    "control_group": 6,
    "probe_every": 1,
    "probe_half": 2,
    "true_v_samples": 2,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run for the test suite")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--workers", type=int, default=2, help="seeds run in parallel processes, one thread each")
    p.add_argument("--methods", nargs="*", default=[], help="run only these methods (default: all)")
    p.add_argument(
        "--probe-rates",
        action="store_true",
        help="keep every probe's candidates (true rates, predictions, Stage 1's bare rollouts) in the JSON, "
        "for benchmarks/budget_by_rate.py",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="take a seed from the file an earlier run with the same arguments left (.<out>_seed<k>.json) "
        "when it holds every requested method, else train only the methods it lacks",
    )
    p.add_argument("--tasks", type=int, default=1000, help="training tasks")
    p.add_argument("--task-seed", type=int, default=0, help="seed of the task sets and the warm start")
    p.add_argument("--cache", type=Path, default=Path("benchmarks/results/.cache"), help="warm-start cache")
    p.add_argument("--heldout-tasks", type=int, default=200, help="held-out tasks (never trained on)")
    p.add_argument("--turns", type=int, default=4, help="max turns of an episode (tasks have 2-4)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--leaves", type=int, default=48, help="leaves per iteration, every method")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="an equal token budget instead: generated tokens per iteration (budget.unit=tokens), the "
        "leaves derived per method, optimizer steps as at --leaves",
    )
    p.add_argument("--expansion", type=int, default=1, help="N, continuations per bare rollout")
    p.add_argument("--max-per-prompt", type=int, default=8)
    p.add_argument("--breadth", type=float, default=0.2, help="trace_breadth*: bonus per trained prompt")
    p.add_argument(
        "--control-group", type=int, default=8, help="grpo_trace_prompts: group size (fewer prompts)"
    )
    p.add_argument("--pool", type=int, default=64, help="candidate prompts per iteration")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--predictor-lr", type=float, default=3e-3)
    p.add_argument("--refit-steps", type=int, default=50)
    p.add_argument("--pooling", default="last_mean", help="predictor input: last or last_mean")
    p.add_argument("--replay-window", type=int, default=16)
    p.add_argument("--decay", type=float, default=0.9, help="per-iteration decay of the Beta counts")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--estimator", default="tree_grpo")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument(
        "--probe-every", type=int, default=4, help="Monte Carlo probe of the pool every k iterations"
    )
    p.add_argument("--probe-half", type=int, default=8, help="probe: 2 x this many episodes per candidate")
    p.add_argument(
        "--true-v-samples", type=int, default=8, help="true_v: episodes per candidate per iteration"
    )
    p.add_argument("--eval-samples", type=int, default=2, help="episodes per held-out task per evaluation")
    p.add_argument("--demos", type=int, default=2, help="warm start: teacher episodes per training task")
    p.add_argument("--sft-steps", type=int, default=1000, help="warm start: exactly this many steps")
    p.add_argument("--sft-lr", type=float, default=6e-3)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/learning.json"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/learning.png"))
    p.add_argument("--from-json", type=Path, help="reprint the tables and redraw the plot of a finished run")
    p.add_argument(
        "--into",
        type=Path,
        help="with --tokens: also write this run's summary as `summary_tokens` into an equal-leaves "
        "run's JSON",
    )
    args = p.parse_args(argv)
    if args.from_json is not None:  # the run's own configuration, so the tables describe what ran
        cfg = json.loads(args.from_json.read_text())["config"]
        return argparse.Namespace(
            **(cfg | {"out": args.from_json, "plot": args.plot, "from_json": args.from_json})
        )
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def run_seeds(args: argparse.Namespace, seeds: Sequence[int]) -> dict[int, dict[str, Any]]:
    """`run_seed` for each seed, in up to `args.workers` spawned processes (one thread each)."""
    if args.workers > 1 and len(seeds) > 1:
        with mp.get_context("spawn").Pool(min(args.workers, len(seeds))) as pool:
            return dict(zip(seeds, pool.starmap(run_seed, [(args, s) for s in seeds]), strict=True))
    return {s: run_seed(args, s) for s in seeds}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        print_tables(summarize(result["seeds"]), args)
        plot(result["seeds"], args, args.plot)
        return
    torch.set_num_threads(1)
    clock = time.perf_counter()
    args.trainer, args.experiment = shipped_config(tempfile.gettempdir())
    warm = fingerprint(shared_warm_start(args)["weights"])  # once, before the workers start
    done = {s: r for s in args.seeds if (r := finished_seed(args, s, warm)) is not None}
    todo = [s for s in args.seeds if s not in done]
    ran = run_seeds(args, todo)
    seed_results = [done.get(s) or ran[s] for s in args.seeds]
    summary = summarize(seed_results)
    verdict_lines = print_tables(summary, args)
    seconds = time.perf_counter() - clock
    print(f"\ntotal {seconds:.0f} s; JSON {args.out}; plot {args.plot}")
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {
        "config": cfg,
        "seconds": seconds,
        "verdicts": verdict_lines,
        "summary": summary,
        "seeds": seed_results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))  # compact: five seeds' per-iteration records of several methods
    plot(seed_results, args, args.plot)
    if args.into is not None:
        merge_tokens(args.into, out)


def merge_tokens(path: Path, token_run: dict[str, Any]) -> None:
    """Put a token-budget run's summary beside an equal-leaves run's: `path` (that run's JSON) gains
    `summary_tokens`, `config_tokens`, `verdicts_tokens` and `seconds_tokens`; its seeds must match."""
    base = json.loads(path.read_text())
    if base["config"].get("tokens") is not None or base["config"]["seeds"] != token_run["config"]["seeds"]:
        raise SystemExit(f"--into {path}: not an equal-leaves run over the same seeds")
    for key in ("summary", "config", "verdicts", "seconds"):
        base[f"{key}_tokens"] = token_run[key]
    path.write_text(json.dumps(base))
    print(f"summary_tokens written into {path}")


if __name__ == "__main__":
    main()
