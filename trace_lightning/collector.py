"""The rollout collector: a policy and an iteration number in, `(batches, report)` out.

    candidate pool -> predictor (or cold-start prior) scores roots -> Stage 1 -> bare rollouts
    -> scores of prefixes -> Stage 2 -> continuations -> V̂ backup and advantages -> micro-batches

It owns everything one iteration needs besides the weights: the candidate pool, the allocation RNG and
the torch RNG the engine samples with, the cold-start prior, root selection, the predictor refit, the
engine (started with `start`, closed with `close`), its weight sync and its counters. `state_dict()`
holds all of it, so a resumed run samples exactly what an uninterrupted one would.

The Lightning side (`data.RolloutDataModule`) only calls it: `start` in `setup`, `collect` in
`train_dataloader`, `close` in `teardown`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from trace_lightning.allocation import BetaPrior, Budget, BudgetLedger, TreeAllocator
from trace_lightning.batching import (
    Estimator,
    LeafSequence,
    RolloutBatch,
    collate,
    collate_packed,
    leaf_sequences,
    node_advantages,
)
from trace_lightning.distributed import Processes
from trace_lightning.engines.base import EngineStats, GenerationEngine, SamplingParams, require_sampling
from trace_lightning.envs.base import Environment, split_tasks
from trace_lightning.evaluation import EvalResult, EvalSettings, score
from trace_lightning.iteration import Branch, Iteration, build_trees
from trace_lightning.packing import budget_groups
from trace_lightning.predictor import PredictorFit, ReplayEntry
from trace_lightning.runner import EpisodeLimits, ReActRunner, RolloutCounters
from trace_lightning.selection import RootQuality, Selection, bare_outcomes
from trace_lightning.sharding import trainable_sum
from trace_lightning.tree import RolloutTree, backup

# The iteration lines are for the run's log file (Hydra's trainer.log); on the console a progress
# display (console.IterationProgress) shows the same counts as they happen.
_log_info = rank_zero_only(logging.getLogger(__name__).info)

EngineFactory = Callable[..., GenerationEngine]


@dataclass
class IterationReport:
    """What the latest iteration built and spent; callbacks read it, compute code never logs."""

    iteration: int
    result: Iteration
    counters: RolloutCounters
    used_prior: bool
    policy_fingerprint: float  # sum of trainable weights when the rollouts were sampled
    sync_seconds: float = 0.0  # engine weight sync before this iteration's sampling (0: already in sync)
    sample_seconds: float = 0.0  # tree building: scoring, allocation, generation and environment steps
    # |engine log-prob - trainer log-prob| on the trained tokens, same weights, same temperature: the
    # mean and max over tokens (NaN when the engine reported none). Large values mean a stale engine.
    logprob_mismatch: float = math.nan
    logprob_mismatch_max: float = math.nan
    processes: int = 1  # processes whose trees `result` gathers (multi-process training)
    root_quality: RootQuality | None = None  # how the head's raw root predictions fared (out of sample)
    refit_loss: float = math.nan  # the predictor refit's last minibatch loss (NaN: no refit ran)
    engine_stats: EngineStats | None = None  # this process's engine counters for this iteration
    local_trees: list[RolloutTree] | None = None  # this process's part of `result.trees`
    # the whole `collect` call: sync, sampling, the refit and the batches' old log-probs (budget/seconds)
    collect_seconds: float = 0.0


@dataclass(frozen=True)
class Batching:
    """How the sampled trees become micro-batches (the `data` group's batching keys)."""

    micro_batch_size: int  # leaf sequences per micro-batch, used only when micro_batch_tokens is None
    micro_batch_tokens: int | None  # packed tokens per micro-batch (whole trees where they fit)
    estimator: Estimator  # the `advantage` group's estimator (batching.py)

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"data.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"data.micro_batch_tokens={self.micro_batch_tokens} must be >= 1, or null to batch "
                "data.micro_batch_size sequences at a time"
            )


class RolloutCollector:
    def __init__(
        self,
        env: Environment,
        allocator: TreeAllocator,
        engine: EngineFactory,
        sampling: SamplingParams,
        budget: Budget,
        pool_size: int,
        held_out: int,
        limits: EpisodeLimits,
        batching: Batching,
        cold_start: BetaPrior,
        selection: Selection,
        predictor_fit: PredictorFit | None,
        seed: int,
    ) -> None:
        allocator.n_roots(budget)  # a budget the allocator cannot split fails here, at start-up
        require_sampling(sampling)
        ids = [t.task_id for t in env.tasks()]
        if not 0 <= held_out < len(ids):
            raise ValueError(
                f"data.held_out={held_out} must be in [0, {len(ids) - 1}]: env {env.name} has {len(ids)} "
                "tasks"
            )
        train_ids, held = split_tasks(ids, held_out, seed)
        if not 1 <= pool_size <= len(train_ids):
            raise ValueError(
                f"data.pool_size={pool_size} must be in [1, {len(train_ids)}]: env {env.name} has "
                f"{len(ids)} tasks, data.held_out={held_out} of them held out"
            )
        self.train_ids, self.held_out = sorted(train_ids), sorted(held)
        self.env, self.allocator, self.engine_factory, self.sampling = env, allocator, engine, sampling
        self.budget, self.pool_size, self.limits, self.batching = budget, pool_size, limits, batching
        self.prior, self.selection, self.predictor_fit = cold_start, selection, predictor_fit
        self.rng = np.random.default_rng(seed)
        # The engine samples with torch's global RNG; the collector owns that stream between iterations
        # (restored before and saved after each one), so whatever else draws from the global RNG in
        # between (DataLoader seeds, a resume) cannot change what the next iteration samples.
        self._sampling_rng = torch.Generator().manual_seed(seed).get_state()
        self.iteration = 0
        self.report: IterationReport | None = None
        self.runner: ReActRunner | None = None
        self._engine_version: float | None = None  # policy fingerprint the engine last synced to
        self.on_episode_end: Callable[[], None] | None = None  # called as each episode ends (progress bars)

    # ------------------------------------------------------------------ engine lifetime

    def start(self, module: Any) -> None:
        """Build the engine on the module's policy (idempotent)."""
        if self.runner is not None:
            return
        scored_at = module.sampling.temperature
        if scored_at != self.sampling.temperature:
            raise ValueError(
                f"TraceModule scores tokens at temperature {scored_at} but they are sampled at "
                f"sampling.temperature={self.sampling.temperature}: the importance ratio would compare "
                "against another policy. Pass the same SamplingParams to both (the CLI does)."
            )
        engine = self.engine_factory(model=module.rollout_policy, tokenizer=module.tokenizer)
        self.runner = ReActRunner(engine, module.tokenizer, self.env, self.sampling, self.limits)

    def close(self) -> None:
        """Release the engine (a vLLM engine frees its memory and worker state); a later start rebuilds."""
        if self.runner is not None and hasattr(self.runner.engine, "close"):
            self.runner.engine.close()
        self.runner, self._engine_version = None, None

    # ------------------------------------------------------------------ one iteration

    def collect(self, module: Any, processes: Processes = Processes()) -> list[RolloutBatch]:
        """Sample one iteration of trees with the module's current policy and turn them into batches;
        `self.report` describes it. With several processes see `distributed.py`."""
        began = time.perf_counter()
        self.start(module)
        runner = self.runner
        assert runner is not None
        runner.counters, runner.on_episode_end = RolloutCounters(), self.on_episode_end
        pool_ids = self.selection.draw_pool(self.train_ids, self.pool_size, self.iteration, self.rng)
        pool = [runner.new_tree(t) for t in pool_ids]
        used_prior = self.prior.active(self.iteration)
        score = _RecordingScorer(module, self.prior, used_prior)
        weights_used = fingerprint(module)
        sync_seconds = self._sync_engine(runner.engine, module)
        _log_info(
            f"iteration {self.iteration}: sampling {self.budget.leaves} trajectories ({self.allocator.name})"
        )
        start = time.perf_counter()
        raw = _root_predictions(pool, score, processes)  # [P] the head's (or the prior's) estimates
        estimates = self.selection.estimates(raw, pool_ids, self.prior, self.rng)  # [P] what Stage 1 uses
        torch.set_rng_state(self._sampling_rng)
        local = build_trees(
            pool,
            self.allocator,
            processes.budget(self.budget),
            score,
            runner,
            self.rng,
            processes.shard(estimates, self.rng),
            estimates,
        )
        self._sampling_rng = torch.get_rng_state()
        for tree, v in zip(pool, raw, strict=True):  # calibration is measured on the raw predictions
            tree.root.predicted = float(v)
        if hasattr(runner.engine, "sleep"):  # optional: frees accelerator memory for training
            runner.engine.sleep()
        sample_seconds = time.perf_counter() - start
        result, counters = processes.gather_iteration(local, runner.counters, self.budget)
        _log_info(
            f"iteration {self.iteration}: {result.ledger.leaves_used} trajectories over {len(result.trees)} "
            f"prompts, {result.ledger.tokens_used} tokens in {sample_seconds:.1f} s"
        )
        quality = self.selection.observe(self.iteration, result.trees, raw)
        refit_loss = self._refit(module, pool, result.trees, score.features, processes)
        self.prior.step()
        for tree in result.trees:
            wins = bare_outcomes(tree)
            self.prior.update(tree.task_id, float(wins.sum()), float(len(wins) - wins.sum()))
        batches, gaps = self._batches(local.trees, module, pool, processes)
        mismatch = _mean_max(np.concatenate(processes.all_gather(gaps)))
        engine_stats, runner.engine.stats = runner.engine.stats, EngineStats()
        self.report = IterationReport(
            self.iteration,
            Iteration(result.trees, result.ledger, raw, result.root_counts),
            counters,
            used_prior,
            weights_used,
            sync_seconds,
            sample_seconds,
            *mismatch,
            processes=processes.world,
            root_quality=quality,
            refit_loss=refit_loss,
            engine_stats=engine_stats,
            local_trees=local.trees,
            collect_seconds=time.perf_counter() - began,
        )
        self.iteration += 1
        return batches

    def evaluate(
        self, module: Any, settings: EvalSettings, on_episode_end: Callable[[], None] | None = None
    ) -> EvalResult | None:
        """`settings.samples` episodes of every task in `settings.tasks` with the current policy, at the
        evaluation's temperature (`evaluation.py` scores them). None: no such task (data.held_out=0).
        `on_episode_end` is called as each episode ends (a progress display).

        The training streams are left exactly as they were: the torch RNG is saved and restored around
        a seeded draw of its own, and the runner's counters and sampling and the engine's stats are put
        back, so an evaluation changes neither what the next iteration samples nor what it reports."""
        task_ids = self.eval_tasks(settings.tasks)
        if not task_ids:
            return None
        start = time.perf_counter()
        self.start(module)
        runner = self.runner
        assert runner is not None
        self._sync_engine(runner.engine, module)
        trees = [runner.new_tree(t) for t in task_ids]
        n = len(trees) * settings.samples
        ledger = BudgetLedger(Budget(n))
        ledger.reserve_leaves(n, "bare")
        saved = (
            torch.get_rng_state(),
            runner.counters,
            runner.on_episode_end,
            runner.engine.stats,
            runner.sampling,
        )
        runner.counters, runner.on_episode_end, runner.engine.stats = (
            RolloutCounters(),
            on_episode_end,
            EngineStats(),
        )
        runner.sampling = settings.sampling(runner.sampling)  # the runner's, which holds the env's stops
        torch.manual_seed(settings.seed)
        try:
            branches = [Branch(t, 0, settings.samples, "bare") for t in trees]
            runner(branches, ledger, np.random.default_rng(settings.seed))
        finally:
            torch.set_rng_state(saved[0])
            runner.counters, runner.on_episode_end, runner.engine.stats, runner.sampling = saved[1:]
        if hasattr(runner.engine, "sleep"):
            runner.engine.sleep()
        temperature = settings.sampling(self.sampling).temperature
        return score(trees, settings.pass_k, temperature, time.perf_counter() - start)

    def eval_tasks(self, tasks: str) -> list[int]:
        """The task ids of an `eval.tasks` choice: held_out, train or all."""
        return {
            "held_out": self.held_out,
            "train": self.train_ids,
            "all": sorted(self.train_ids + self.held_out),
        }[tasks]

    def _refit(
        self,
        module: Any,
        pool: list[RolloutTree],
        trees: list[RolloutTree],
        features: dict[tuple[int, int], Any],
        processes: Processes,
    ) -> float:
        """Fit the head on this and recent iterations' V̂ targets, before the policy trains on them.

        Root targets are the mean of the bare rollouts only; a prefix's target is its subtree mean.
        Every process gathers the same features and runs the same fit, so the head stays replicated."""
        if self.predictor_fit is None:
            return math.nan
        seen: dict[tuple[int, int], Any] = {}
        for part in processes.all_gather(features):
            seen.update(part)
        scaler = getattr(module.head, "scaler", None)
        if scaler is not None:
            roots = [seen[(t.task_id, 0)] for t in pool if (t.task_id, 0) in seen]
            if roots:
                scaler.update(torch.stack(roots))
        for tree in trees:
            entry = _replay_entry(tree, seen, self.iteration)
            if entry is not None:
                self.predictor_fit.add(tree.task_id, entry)
        return self.predictor_fit.fit(module.head, self.iteration)

    def _sync_engine(self, engine: GenerationEngine, module: Any) -> float:
        """Bring the engine to the policy's current weights when they changed since its last sync (or it
        has never been synced: a resumed policy differs from the weights the engine loaded). Seconds."""
        version = fingerprint(module.policy)
        if self._engine_version == version:
            return 0.0
        start = time.perf_counter()
        module.sync_rollout_policy()  # FSDP2: gather the full weights into the engine's unsharded copy
        engine.sync_weights()
        self._engine_version = version
        return time.perf_counter() - start

    # ------------------------------------------------------------------ batches

    def _batches(
        self, trees: list[RolloutTree], module: Any, pool: list[RolloutTree], processes: Processes
    ) -> tuple[list[RolloutBatch], np.ndarray]:
        """Tree-packed micro-batches with old log-probs, and |engine - trainer| log-prob gaps on the
        trained tokens. A micro-batch holds up to `micro_batch_tokens` packed tokens (whole trees where
        they fit, see `packing.budget_groups`), or `micro_batch_size` leaf sequences when that is None.

        Every process must run the same number of micro-batches (DDP synchronises each backward), so a
        process with fewer leaves pads with batches that train nothing (all-zero loss mask)."""
        seqs = leaf_sequences(trees, node_advantages(trees, self.batching.estimator))
        groups = self._groups(trees, seqs)
        n_batches = max(processes.all_gather(len(groups)))
        pad = module.tokenizer.pad_token_id
        batches, gaps = [], []
        for i in range(n_batches):
            chunk = [seqs[j] for j in groups[i]] if i < len(groups) else []
            batch = collate_packed(chunk, trees, pad) if chunk else _idle_batch(pool[0].prompt_ids, pad)
            module.fill_old_logprobs(batch)
            for row, seq in enumerate(chunk):
                engine = torch.tensor(seq.engine_logprobs)  # [T]
                known = torch.isfinite(engine)
                gaps.append((batch.old_logprobs[row, : len(engine)][known] - engine[known]).abs().numpy())
            batches.append(batch)
        return batches, np.concatenate(gaps) if gaps else np.zeros(0)

    def _groups(self, trees: list[RolloutTree], seqs: list[LeafSequence]) -> list[list[int]]:
        """Indices into `seqs` of each micro-batch: by packed-token budget, or a fixed count."""
        if self.batching.micro_batch_tokens is not None:
            return budget_groups(
                trees, [(s.tree_index, s.leaf) for s in seqs], self.batching.micro_batch_tokens
            )
        size = self.batching.micro_batch_size
        return [list(range(i, min(i + size, len(seqs)))) for i in range(0, len(seqs), size)]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Everything the next iteration depends on besides the weights: the allocation RNG, the torch
        RNG the engine samples with, the iteration counter, the prior, selection and the refit."""
        return {
            "iteration": self.iteration,
            "rng": self.rng.bit_generator.state,
            "torch_rng": self._sampling_rng,
            "prior": self.prior.state_dict(),
            "selection": self.selection.state_dict(),
            "predictor_fit": self.predictor_fit.state_dict() if self.predictor_fit is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.rng.bit_generator.state = state["rng"]
        self._sampling_rng = state["torch_rng"]
        self.prior.load_state_dict(state["prior"])
        if "selection" in state:  # absent in checkpoints written before issue 11
            self.selection.load_state_dict(state["selection"])
        if self.predictor_fit is not None and state.get("predictor_fit") is not None:
            self.predictor_fit.load_state_dict(state["predictor_fit"])


def _root_predictions(pool: list[RolloutTree], score: _RecordingScorer, processes: Processes) -> np.ndarray:
    """Root estimates over the whole pool [P]; with several processes each scores a round-robin share
    and the scores are gathered, so all see the same pool."""
    if processes.world == 1:
        return np.concatenate(score(pool, [[0]] * len(pool))) if pool else np.zeros(0)
    mine = processes.round_robin(len(pool))
    local = score([pool[i] for i in mine], [[0]] * len(mine)) if mine else []
    return processes.gather_scores(len(pool), [float(v[0]) for v in local])


class _RecordingScorer:
    """The scorer the iteration runs with: the head's predictions (or the cold-start prior's), keeping
    each scored prefix's head input, keyed (task_id, node_id), for the refit after the rollouts.

    With `predictor.posterior_features` the input also carries the prompt's decayed posterior mean
    and log(1 + decayed visits) as they were before this iteration."""

    def __init__(self, module: Any, prior: BetaPrior, use_prior: bool) -> None:
        self.module, self.prior, self.use_prior = module, prior, use_prior
        self.extra = bool(module.predictor_settings.posterior_features)
        self.features: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        feats = self.module.prefix_features(trees, node_ids)
        out = []
        for tree, nodes, f in zip(trees, node_ids, feats, strict=True):
            if self.extra:
                stats = torch.tensor(
                    [self.prior.mean([tree.task_id])[0], math.log1p(self.prior.visits([tree.task_id])[0])]
                )
                f = torch.cat([f, stats.float().expand(len(f), -1)], dim=1)
            self.features.update({(tree.task_id, int(n)): row for n, row in zip(nodes, f, strict=True)})
            prior = np.repeat(self.prior.mean([tree.task_id]), len(nodes))
            out.append(prior if self.use_prior else self.module.head_predict(f))
        return out


def _replay_entry(
    tree: RolloutTree, features: dict[tuple[int, int], Any], iteration: int
) -> ReplayEntry | None:
    """The tree's scored nodes as predictor targets: the root from its bare rollouts, prefixes from
    their subtree means; weights are leaf counts."""
    rows, targets, weights = [], [], []
    bare = [float(tree.nodes[x].reward) for x in tree.leaves() if tree.nodes[x].stage == "bare"]  # type: ignore[arg-type]
    if (tree.task_id, 0) in features and bare:
        rows.append(features[(tree.task_id, 0)])
        targets.append(float(np.mean(bare)))
        weights.append(float(len(bare)))
    b = backup(tree)
    for node in tree.nodes[1:]:
        if (tree.task_id, node.id) in features and b.leaves[node.id] > 0:
            rows.append(features[(tree.task_id, node.id)])
            targets.append(float(b.value[node.id]))
            weights.append(float(b.leaves[node.id]))
    if not rows:
        return None
    return ReplayEntry(iteration, torch.stack(rows), torch.tensor(targets), torch.tensor(weights))


def _idle_batch(prompt_ids: list[int], pad_id: int) -> RolloutBatch:
    """A micro-batch that trains nothing: one prompt, no trained token, no predictor target."""
    n = len(prompt_ids)
    return collate(
        [LeafSequence(0, 0, list(prompt_ids), [0] * n, [0.0] * n, [], [], [], [math.nan] * n)], pad_id
    )


def _mean_max(gaps: np.ndarray) -> tuple[float, float]:
    return (float(gaps.mean()), float(gaps.max())) if gaps.size else (math.nan, math.nan)


def fingerprint(module: torch.nn.Module) -> float:
    """Sum of the trainable weights: cheap evidence of which weights produced a batch."""
    return trainable_sum(module)  # also over FSDP2 shards, the same number on every process
