"""RolloutDataModule: one Lightning epoch = one TRACE iteration of freshly generated trees.

`train_dataloader()` is called again at every epoch (the Trainer must run with
`reload_dataloaders_every_n_epochs=1`), after the previous epoch's updates, so each batch is sampled
by the current policy (on-policy):

    candidate pool -> predictor (or cold-start prior) scores roots -> Stage 1 -> bare rollouts
    -> scores of prefixes -> Stage 2 -> continuations -> V̂ backup and advantages -> micro-batches

The DataModule owns the rollout RNG, the iteration counter and the cold-start prior; `state_dict()`
returns all three so a resumed run continues the same sequence.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch.utils.data import DataLoader

from trace_lightning.allocation import BetaPrior, Budget, BudgetLedger, TreeAllocator
from trace_lightning.batching import (
    ESTIMATORS,
    LeafSequence,
    RolloutBatch,
    collate,
    collate_packed,
    leaf_sequences,
    node_advantages,
)
from trace_lightning.engines.base import GenerationEngine, SamplingParams
from trace_lightning.envs.base import Environment
from trace_lightning.iteration import Iteration, Shard, build_trees
from trace_lightning.packing import budget_groups
from trace_lightning.predictor import PredictorFit, ReplayEntry
from trace_lightning.runner import ReActRunner, RolloutCounters
from trace_lightning.selection import RootQuality, Selection, bare_outcomes
from trace_lightning.tree import RolloutTree, backup

# The iteration lines are for the run's log file (Hydra's trainer.log); on the console a progress
# display (console.IterationProgress) shows the same counts as they happen.
_log_info = rank_zero_only(logging.getLogger(__name__).info)


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


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        env: Environment,
        allocator: TreeAllocator,
        engine: Callable[..., GenerationEngine],
        sampling: SamplingParams,
        leaves: int = 16,
        max_tokens: int | None = None,
        pool_size: int = 16,
        micro_batch_size: int = 4,
        micro_batch_tokens: int | None = None,
        max_turns: int = 4,
        max_episode_tokens: int = 256,
        step_timeout: float | None = 30.0,
        max_observation_chars: int = 4000,
        estimator: str = "tree_grpo",
        cold_start: BetaPrior | None = None,
        selection: Selection | None = None,
        predictor_fit: PredictorFit | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if estimator not in ESTIMATORS:
            raise ValueError(f"data.estimator={estimator!r} is unknown; use one of {list(ESTIMATORS)}")
        if micro_batch_size < 1 or pool_size < 1:
            raise ValueError(
                f"data.micro_batch_size={micro_batch_size} and data.pool_size={pool_size} must be >= 1"
            )
        self.env, self.allocator, self.engine_factory, self.sampling = env, allocator, engine, sampling
        self.budget = Budget(leaves, max_tokens)
        allocator.n_roots(self.budget)  # a budget the allocator cannot split fails here, at start-up
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(
                f"data.micro_batch_tokens={micro_batch_tokens} must be >= 1, or null to batch "
                "data.micro_batch_size sequences at a time"
            )
        self.pool_size, self.micro_batch_size, self.estimator = pool_size, micro_batch_size, estimator
        self.micro_batch_tokens = micro_batch_tokens
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.step_timeout, self.max_observation_chars = step_timeout, max_observation_chars
        self.prior = cold_start if cold_start is not None else BetaPrior(warmup=0)
        self.selection = selection if selection is not None else Selection()
        self.predictor_fit = predictor_fit  # None: the head learns only from the joint loss
        self.rng = np.random.default_rng(seed)
        # The engine samples with torch's global RNG; the DataModule owns that stream between iterations
        # (restored before and saved after each one), so whatever else draws from the global RNG in
        # between (DataLoader seeds, a resume) cannot change what the next iteration samples.
        self._sampling_rng = torch.Generator().manual_seed(seed).get_state()
        self.iteration = 0
        self.report: IterationReport | None = None
        self._runner: ReActRunner | None = None
        self._engine_version: float | None = None  # policy fingerprint the engine last synced to
        self.local_trees: list[RolloutTree] = []
        self.on_episode_end: Callable[[], None] | None = None  # called as each episode ends (progress bars)

    def _runner_for(self, module: Any) -> ReActRunner:
        if self._runner is None:
            scored_at = getattr(module, "hparams", {}).get("temperature", self.sampling.temperature)
            if scored_at != self.sampling.temperature:
                rank_zero_warn(
                    f"TraceModule scores tokens at temperature {scored_at} but they are sampled at "
                    f"sampling.temperature={self.sampling.temperature}: the importance ratio then compares "
                    "against another policy (engine/logprob_mismatch will show it). Pass the same "
                    "temperature to TraceModule (the CLI does)."
                )
            engine = self.engine_factory(model=module.policy, tokenizer=module.tokenizer)
            self._runner = ReActRunner(
                engine,
                module.tokenizer,
                self.env,
                self.sampling,
                self.max_turns,
                self.max_episode_tokens,
                self.step_timeout,
                self.max_observation_chars,
            )
            n_tasks = len(self._runner.tasks)
            if n_tasks < self.pool_size:
                raise ValueError(
                    f"data.pool_size={self.pool_size} exceeds the {n_tasks} tasks of env {self.env.name}"
                )
        return self._runner

    def train_dataloader(self) -> DataLoader[RolloutBatch | None]:
        """Iteration k is sampled for epoch k.

        On resume Lightning first asks again for the epoch the checkpoint was taken in, whose iteration
        was already sampled (and trained on, up to the save). That epoch gets a single `None` batch,
        which `TraceModule.training_step` skips, so the RNG is not spent twice and the next epoch
        samples exactly the iteration an uninterrupted run would. (An empty loader would make
        Lightning stop the whole fit.)
        """
        if self.trainer.current_epoch < self.iteration:
            return DataLoader([None], batch_size=None, collate_fn=lambda b: b)
        batches = self.build_iteration(self.trainer.lightning_module)
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=lambda b: b)

    def build_iteration(self, module: Any) -> list[RolloutBatch]:
        """Sample one iteration of trees with the module's current policy and turn them into batches.

        With several processes (DDP), every process draws the same candidate pool, scores its share
        of it, and gathers the scores, so that all make the same Stage 1 allocation over the whole
        pool and the leaf budget holds globally; each then rolls out the prompts it owns. The report
        and the cold-start prior see every process's trees; the batches hold this process's only.
        """
        runner = self._runner_for(module)
        runner.counters, runner.on_episode_end = RolloutCounters(), self.on_episode_end
        pool_ids = self.selection.draw_pool(sorted(runner.tasks), self.pool_size, self.iteration, self.rng)
        pool = [runner.new_tree(t) for t in pool_ids]
        used_prior = self.prior.active(self.iteration)
        score = _RecordingScorer(module, self.prior, used_prior)
        weights_used = fingerprint(module)
        sync_seconds = self._sync_engine(runner.engine, module)
        _log_info(
            f"iteration {self.iteration}: sampling {self.budget.leaves} trajectories ({self.allocator.name})"
        )
        start = time.perf_counter()
        raw = self._root_predictions(pool, score)  # [P] the head's (or the prior's) estimates
        estimates = self.selection.estimates(raw, pool_ids, self.prior, self.rng)  # [P] what Stage 1 uses
        torch.set_rng_state(self._sampling_rng)
        local = build_trees(
            pool, self.allocator, self._budget(), score, runner, self.rng, self._shard(estimates), estimates
        )
        self._sampling_rng = torch.get_rng_state()
        for tree, v in zip(pool, raw, strict=True):  # calibration is measured on the raw predictions
            tree.root.predicted = float(v)
        if hasattr(runner.engine, "sleep"):  # optional: frees accelerator memory for training
            runner.engine.sleep()
        sample_seconds = time.perf_counter() - start
        self.local_trees = local.trees  # this process's part (all of it, in a single process)
        result, counters = self._gathered(local, runner.counters)
        _log_info(
            f"iteration {self.iteration}: {result.ledger.leaves_used} trajectories over {len(result.trees)} "
            f"prompts, {result.ledger.tokens_used} tokens in {sample_seconds:.1f} s"
        )
        quality = self.selection.observe(self.iteration, result.trees, raw)
        refit_loss = self._refit(module, pool, result.trees, score.features)
        self.prior.step()
        for tree in result.trees:
            wins = bare_outcomes(tree)
            self.prior.update(tree.task_id, float(wins.sum()), float(len(wins) - wins.sum()))
        batches, gaps = self._batches(local.trees, module, pool)
        mismatch = _mean_max(np.concatenate(self._all_gather(gaps)))
        self.report = IterationReport(
            self.iteration,
            Iteration(result.trees, result.ledger, raw, result.root_counts),
            counters,
            used_prior,
            weights_used,
            sync_seconds,
            sample_seconds,
            *mismatch,
            processes=self._world()[1],
            root_quality=quality,
            refit_loss=refit_loss,
        )
        self.iteration += 1
        return batches

    # ------------------------------------------------------------------ predictor

    def _root_predictions(self, pool: list[RolloutTree], score: _RecordingScorer) -> np.ndarray:
        """Root estimates over the whole pool [P]. With several processes each scores a round-robin
        share (shares differ by at most one) and the scores are gathered, so all see the same pool."""
        rank, world = self._world()
        if world == 1:
            return np.concatenate(score(pool, [[0]] * len(pool))) if pool else np.zeros(0)
        mine = list(range(rank, len(pool), world))
        local = score([pool[i] for i in mine], [[0]] * len(mine)) if mine else []
        scores = np.full(len(pool), np.nan)
        for r, values in enumerate(self._all_gather([float(v[0]) for v in local])):
            scores[r::world] = values
        return scores

    def _refit(
        self,
        module: Any,
        pool: list[RolloutTree],
        trees: list[RolloutTree],
        features: dict[tuple[int, int], Any],
    ) -> float:
        """Fit the head on this and recent iterations' V̂ targets, before the policy trains on them.

        Root targets are the mean of the bare rollouts only; a prefix's target is its subtree mean.
        Every process gathers the same features and runs the same fit, so the head stays replicated."""
        if self.predictor_fit is None:
            return math.nan
        seen: dict[tuple[int, int], Any] = {}
        for part in self._all_gather(features):
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

    # ------------------------------------------------------------------ engine

    def _sync_engine(self, engine: GenerationEngine, module: Any) -> float:
        """Bring the engine to the policy's current weights when they changed since its last sync (or it
        has never been synced: a resumed policy differs from the weights the engine loaded). Seconds."""
        version = fingerprint(module.policy)
        if self._engine_version == version:
            return 0.0
        start = time.perf_counter()
        engine.sync_weights()
        self._engine_version = version
        return time.perf_counter() - start

    # ------------------------------------------------------------------ processes

    def _world(self) -> tuple[int, int]:
        """(rank, world size); (0, 1) without a Trainer or without an initialised process group."""
        trainer = self.trainer
        if trainer is None or not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _all_gather(self, obj: Any) -> list[Any]:
        world = self._world()[1]
        if world == 1:
            return [obj]
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj)
        return out

    def _budget(self) -> Budget:
        """This process's budget: all leaves (Stage 1 is global and sums to them), and its share of a
        token cap, since the processes generate at the same time without seeing each other's tokens."""
        world = self._world()[1]
        if world == 1 or self.budget.max_tokens is None:
            return self.budget
        return Budget(self.budget.leaves, self.budget.max_tokens // world)

    def _shard(self, estimates: np.ndarray) -> Shard | None:
        rank, world = self._world()
        if world == 1:
            return None
        # One shared draw keeps the allocation RNG identical on every process; the rest is per process.
        seed = int(self.rng.integers(2**63))
        return Shard(estimates, rank, world, np.random.default_rng([seed, rank]))

    def _gathered(self, local: Iteration, counters: RolloutCounters) -> tuple[Iteration, RolloutCounters]:
        """The iteration as a whole: every process's trees, spending and counters."""
        if self._world()[1] == 1:
            return local, counters
        parts = self._all_gather((local.trees, local.ledger, counters))
        ledger = BudgetLedger(self.budget)
        total = RolloutCounters()
        for _, part_ledger, part_counters in parts:
            for stage in ledger.leaves:
                ledger.leaves[stage] += part_ledger.leaves[stage]
                ledger.tokens[stage] += part_ledger.tokens[stage]
            for depth, n in part_ledger.tokens_by_depth.items():
                ledger.tokens_by_depth[depth] = ledger.tokens_by_depth.get(depth, 0) + n
            total.merge(part_counters)
        trees = [t for part_trees, _, _ in parts for t in part_trees]
        return Iteration(trees, ledger, local.pool_predicted, local.root_counts), total

    # ------------------------------------------------------------------ batches

    def _prior_scores(
        self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        return [np.repeat(self.prior.mean([t.task_id]), len(n)) for t, n in zip(trees, node_ids, strict=True)]

    def _batches(
        self, trees: list[RolloutTree], module: Any, pool: list[RolloutTree]
    ) -> tuple[list[RolloutBatch], np.ndarray]:
        """Tree-packed micro-batches with old log-probs, and |engine - trainer| log-prob gaps on the
        trained tokens. A micro-batch holds up to `micro_batch_tokens` packed tokens (whole trees where
        they fit, see `packing.budget_groups`), or `micro_batch_size` leaf sequences when that is null.

        Every process must run the same number of micro-batches (DDP synchronises each backward), so a
        process with fewer leaves pads with batches that train nothing (all-zero loss mask)."""
        seqs = leaf_sequences(trees, node_advantages(trees, self.estimator))  # type: ignore[arg-type]
        groups = self._groups(trees, seqs)
        n_batches = max(self._all_gather(len(groups)))
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
        if self.micro_batch_tokens is not None:
            return budget_groups(trees, [(s.tree_index, s.leaf) for s in seqs], self.micro_batch_tokens)
        size = self.micro_batch_size
        return [list(range(i, min(i + size, len(seqs)))) for i in range(0, len(seqs), size)]

    def state_dict(self) -> dict[str, Any]:
        """Everything the next iteration depends on besides the weights: the allocation RNG, the torch
        RNG the engine samples with, the iteration counter and the cold-start prior."""
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


class _RecordingScorer:
    """The scorer the iteration runs with: the head's predictions (or the cold-start prior's), keeping
    each scored prefix's head input, keyed (task_id, node_id), for the refit after the rollouts.

    With `predictor.posterior_features` the input also carries the prompt's decayed posterior mean
    and log(1 + decayed visits) as they were before this iteration."""

    def __init__(self, module: Any, prior: BetaPrior, use_prior: bool) -> None:
        self.module, self.prior, self.use_prior = module, prior, use_prior
        self.extra = bool(getattr(module, "hparams", {}).get("predictor_posterior_features", False))
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
    return collate(
        [
            LeafSequence(
                0,
                0,
                list(prompt_ids),
                [0] * len(prompt_ids),
                [0.0] * len(prompt_ids),
                [],
                [],
                [],
                [math.nan] * len(prompt_ids),
            )
        ],
        pad_id,
    )


def _mean_max(gaps: np.ndarray) -> tuple[float, float]:
    return (float(gaps.mean()), float(gaps.max())) if gaps.size else (math.nan, math.nan)


def fingerprint(module: torch.nn.Module) -> float:
    """Sum of the trainable weights: cheap evidence of which weights produced a batch."""
    return float(sum(p.detach().double().sum() for p in module.parameters() if p.requires_grad))
