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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from trace_lightning.allocation import BetaPrior, TreeAllocator
from trace_lightning.batching import Batching, RolloutBatch, micro_batches, step_layout
from trace_lightning.budget import Budget, BudgetError, plan_leaves
from trace_lightning.distributed import Processes
from trace_lightning.engines.base import GenerationEngine, SamplingParams, require_sampling
from trace_lightning.envs.base import Environment, HasAttributes, split_tasks
from trace_lightning.evaluation import Evaluator
from trace_lightning.iteration import Iteration, build_trees
from trace_lightning.predictor import PredictorFit, PrefixScorer
from trace_lightning.predictor.calibration import PlattCalibration
from trace_lightning.predictor.online import IterationScorer, refit
from trace_lightning.pricing import FlipRates, Flips
from trace_lightning.report import IterationReport
from trace_lightning.runner import EpisodeLimits, ReActRunner
from trace_lightning.selection import RootQuality, Selection
from trace_lightning.tree import RolloutTree, bare_outcomes

# The iteration lines are for the run's log file (Hydra's trainer.log); on the console a progress
# display (console.IterationProgress) shows the same counts as they happen.
_log_info = rank_zero_only(logging.getLogger(__name__).info)

EngineFactory = Callable[..., GenerationEngine]


class Learner(Protocol):
    """What the collector needs of the module it samples for (`module.TraceModule` is one): the tokenizer
    and sampling settings, the network the engine samples with, the predictor's scorer, and the hooks
    around a generation phase. Nothing else of the module is touched here."""

    tokenizer: Any
    sampling: SamplingParams
    scorer: PrefixScorer

    @property
    def rollout_policy(self) -> torch.nn.Module: ...

    def sync_rollout_policy(self) -> None:
        """Bring the network the engine reads up to the trained weights (FSDP2: gather the shards)."""
        ...

    def weights_fingerprint(self) -> float:
        """A number that changes whenever the policy's trainable weights do (the same on every process)."""
        ...

    def fill_old_logprobs(self, batch: RolloutBatch) -> None:
        """Set `batch.old_logprobs` with the forward pass the first training step will run."""
        ...


@dataclass(frozen=True)
class _Plan:
    """An iteration's pool, scored: what sampling and the updates after it read."""

    pool_ids: list[int]
    pool: list[RolloutTree]  # one empty tree per pool prompt
    used_prior: bool  # the cold-start prior, not the head, scored the roots
    score: IterationScorer
    raw: np.ndarray  # [P] the head's (or the prior's) root estimates
    predicted: np.ndarray  # [P] after calibration
    estimates: np.ndarray  # [P] what Stage 1 allocates on (`stage1_estimates`)
    reserved: np.ndarray  # [P] the unbiased slice's rollouts
    calibration: PlattCalibration | None  # the map `predicted` went through (None: none)
    scored_at: float  # perf_counter() when the pool's scoring began
    steer: bool  # the skill gate is open: Stage 1 follows the estimates (else the allocator's closed rule)


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
        *,
        split_seed: int | None = None,  # the held-out split's seed (None: `seed`)
    ) -> None:
        allocator.n_roots(budget)  # a budget the allocator cannot split fails here, at start-up
        step = max(allocator.leaf_step(True), allocator.leaf_step(False))  # gate open, gate closed
        if budget.unit == "tokens" and budget.leaves < step:
            raise BudgetError(
                f"budget.leaves={budget.leaves}: with budget.unit=tokens it is the most leaves an iteration "
                f"may spend, and {allocator.name} splits budgets by {step}; raise it"
            )
        require_sampling(sampling)
        ids = [t.task_id for t in env.tasks()]
        if not 0 <= held_out < len(ids):
            raise ValueError(
                f"data.held_out={held_out} must be in [0, {len(ids) - 1}]: env {env.name} has {len(ids)} "
                "tasks"
            )
        train_ids, held = split_tasks(ids, held_out, seed if split_seed is None else split_seed)
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
        # priced Stage 2's flip rates and the roots' yield, learned online (pricing.py)
        self.flips = FlipRates(allocator.pricing) if allocator.pricing is not None else None
        # the tasks' attributes, coarse to fine, for the pooled estimates (selection.attributes)
        self.attribute_keys: dict[int, tuple[str, ...]] = (
            {t.task_id: tuple(env.attributes(t)) for t in env.tasks()}
            if isinstance(env, HasAttributes)
            else {}
        )
        # held-out evaluation and the probe: episodes outside the budget, on this run's engine; its
        # pass@1 by the tasks' coarsest attribute
        groups = {t: keys[0] for t, keys in self.attribute_keys.items() if keys}
        self.evaluator = Evaluator(
            env, limits, sampling, self.train_ids, self.held_out, self.synced_engine, groups
        )
        # The engine samples with torch's global RNG; the collector owns that stream between iterations
        # (restored before and saved after each one), so whatever else draws from the global RNG in
        # between (DataLoader seeds, a resume) cannot change what the next iteration samples.
        self._sampling_rng = torch.Generator().manual_seed(seed).get_state()
        self.iteration = 0
        # budget.unit=tokens: the last iteration's (leaves, generated tokens, whether the budget bound it)
        self._spent: tuple[int, int, bool] | None = None
        self.report: IterationReport | None = None
        self.runner: ReActRunner | None = None
        self._engine_version = math.nan  # policy fingerprint the engine last synced to (NaN: never)
        self.on_episode_end: Callable[[], None] | None = None  # called as each episode ends (progress bars)

    # ------------------------------------------------------------------ engine lifetime

    def start(self, module: Learner) -> None:
        """Build the engine on the module's rollout policy (idempotent)."""
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
        if self.runner is not None:
            self.runner.engine.close()
        self.runner, self._engine_version = None, math.nan

    # ------------------------------------------------------------------ one iteration

    def collect(self, module: Learner, processes: Processes = Processes()) -> list[RolloutBatch]:
        """Sample one iteration of trees with the module's current policy and turn them into batches;
        `self.report` describes it. With several processes see `distributed.py`.

        The phases, in order: draw and score the pool (`_plan`), build the trees under the budget
        (`_sample`), learn from the outcomes (`_observe`: the selection's record, calibration, the
        predictor's refit, the cold-start prior), and the training batches with their report."""
        began = time.perf_counter()
        self.start(module)
        runner = self.runner
        assert runner is not None
        runner.take_counters(), runner.engine.take_stats()  # what ran since the last iteration is not its
        runner.on_episode_end = self.on_episode_end
        budget = self._iteration_budget()
        plan, sync_seconds = self._plan(module, runner, processes, budget)
        local, sample_seconds = self._sample(plan, runner, processes, budget)
        result, counters = processes.gather_iteration(local, runner.take_counters(), budget)
        if self.budget.unit == "tokens":  # what these leaves cost: the next iteration's leaves follow
            cut = counters.stop_reasons.get("token_budget", 0) > 0 or counters.budget_bound_turns > 0
            self._spent = (result.ledger.leaves_used, result.ledger.tokens_used, cut)
        _log_info(
            f"iteration {self.iteration}: {result.ledger.leaves_used} trajectories over {len(result.trees)} "
            f"prompts, {result.ledger.tokens_used} tokens in {sample_seconds:.1f} s"
        )
        quality, refit_loss = self._observe(module, plan, result.trees, processes)
        flips = self._price(result) if self.flips is not None else None
        batches, gaps, per_step = self._batches(local.trees, module, plan.pool, processes)
        mismatch_mean, mismatch_max = _mean_max(np.concatenate(processes.all_gather(gaps)))
        self.report = IterationReport(
            iteration=self.iteration,
            result=Iteration(result.trees, result.ledger, plan.predicted, result.root_counts),
            counters=counters,
            used_prior=plan.used_prior,
            policy_fingerprint=self._engine_version,
            sync_seconds=sync_seconds,
            sample_seconds=sample_seconds,
            logprob_mismatch=mismatch_mean,
            logprob_mismatch_max=mismatch_max,
            processes=processes.world,
            root_quality=quality,
            refit_loss=refit_loss,
            engine_stats=runner.engine.take_stats(),
            local_trees=local.trees,
            pool_ids=plan.pool_ids,
            collect_seconds=time.perf_counter() - began,
            optimizer_steps=len(batches) // per_step,
            micro_batches_per_step=per_step,
            steered=self.allocator.steered(plan.steer),
            flips=flips,
        )
        self.iteration += 1
        return batches

    def _iteration_budget(self) -> Budget:
        """This iteration's budget (`budget.plan_leaves`): under `budget.unit=tokens` never fewer leaves
        than the unbiased slice takes."""
        steer, _ = self.selection.gate()  # the state this iteration's plan will see
        step = self.allocator.leaf_step(steer)
        slice_leaves = (
            self.selection.explore_groups * self.selection.explore_size * (1 + self.allocator.expansion)
        )
        least = max(step, -(-slice_leaves // step) * step)
        can_spend = partial(self.allocator.can_spend, pool_size=self.pool_size, steer=steer)
        return plan_leaves(self.budget, self._spent, step, least, can_spend)

    def _plan(
        self, module: Learner, runner: ReActRunner, processes: Processes, budget: Budget
    ) -> tuple[_Plan, float]:
        """Draw the pool, sync the engine to the policy, and score the pool's roots; (the plan, the
        sync's seconds)."""
        pool_ids = self.selection.draw_pool(self.train_ids, self.pool_size, self.iteration, self.rng)
        pool = [runner.new_tree(t) for t in pool_ids]
        used_prior = self.prior.active(self.iteration)
        score = IterationScorer(module.scorer, self.prior, used_prior)
        sync_seconds = self._sync_engine(runner.engine, module)
        _log_info(
            f"iteration {self.iteration}: sampling {budget.leaves} trajectories ({self.allocator.name})"
        )
        began = time.perf_counter()
        raw = processes.score_pool(pool, score)  # [P] the head's (or the prior's) estimates
        calibration = self.predictor_fit.calibration if self.predictor_fit is not None else None
        if used_prior:  # the prior's estimates, not the head's: nothing to calibrate them with
            calibration = None
        predicted = calibration(raw) if calibration is not None else raw  # [P]
        if self.selection.attributes and self.attribute_keys:  # what transfers between fresh prompts
            predicted = self.selection.pooled_rates([self.attribute_keys[t] for t in pool_ids])
        estimates, steer = self.stage1_estimates(module, pool_ids, predicted)  # [P] Stage 1's
        # with selection.cell_quota, no attribute cell takes more than its quota of candidates
        if steer and self.attribute_keys and self.selection.cell_quota is not None:
            trained = budget.leaves / self.allocator.leaf_step(False)  # GRPO's prompts at this budget
            estimates = self.selection.quota(estimates, [self.attribute_keys[t] for t in pool_ids], trained)
        reserved = self.selection.explore(len(pool), self.rng)  # [P] the unbiased slice's rollouts
        plan = _Plan(
            pool_ids, pool, used_prior, score, raw, predicted, estimates, reserved, calibration, began, steer
        )
        return plan, sync_seconds

    def stage1_estimates(
        self, module: Learner, pool_ids: list[int], predicted: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        """What Stage 1 allocates on [P] and whether it steers by it: the selection's estimates of the
        pool, under its skill gate. A benchmark's upper bound overrides it (benchmarks/learning.py
        TrueVCollector: Monte Carlo success rates, outside the budget); no method does."""
        steer, _ = self.selection.gate()
        return self.selection.estimates(predicted, pool_ids, self.prior, self.rng), steer

    def _sample(
        self, plan: _Plan, runner: ReActRunner, processes: Processes, budget: Budget
    ) -> tuple[Iteration, float]:
        """This process's trees under the budget (Stage 1 and Stage 2, `iteration.build_trees`), sampled
        on the collector's own RNG stream; (its iteration, seconds since the pool was scored)."""
        torch.set_rng_state(self._sampling_rng)
        local = build_trees(
            plan.pool,
            self.allocator,
            processes.budget(budget),
            plan.score,
            runner,
            self.rng,
            processes.shard(plan.estimates, self.rng),
            plan.estimates,
            plan.reserved,
            plan.steer,
            self.flips,
            root_predicted=plan.predicted,  # gauges judge the predictor's output, not Stage 1's estimates
        )
        self._sampling_rng = torch.get_rng_state()
        runner.engine.sleep()  # frees accelerator memory for training (a no-op where there is none)
        return local, time.perf_counter() - plan.scored_at

    def _observe(
        self, module: Learner, plan: _Plan, trees: list[RolloutTree], processes: Processes
    ) -> tuple[RootQuality | None, float]:
        """Learn from the iteration's outcomes: the selection's record (and the predictor's quality on
        the unbiased slice), the calibration, the predictor's refit and the cold-start prior."""
        slice_ids = {t for t, r in zip(plan.pool_ids, plan.reserved, strict=True) if r}
        if not plan.steer and self.allocator.closed is not None:  # closed: every group was drawn uniformly
            slice_ids = {t.task_id for t in trees}
        quality = self.selection.observe(self.iteration, trees, plan.predicted, slice_ids)
        wins = [bare_outcomes(t) for t in trees]
        if plan.calibration is not None:  # the Platt map, on the head's raw root predictions and outcomes
            raw = dict(zip(plan.pool_ids, plan.raw, strict=True))
            plan.calibration.observe(
                self.iteration,
                [raw[t.task_id] for t in trees],
                [w.sum() for w in wins],
                [len(w) for w in wins],
            )
        refit_loss = math.nan
        if self.predictor_fit is not None:  # every process gathers the same features, runs the same fit
            seen = {key: f for part in processes.all_gather(plan.score.features) for key, f in part.items()}
            refit_loss = refit(self.predictor_fit, module.scorer, plan.pool, trees, seen, self.iteration)
        if self.selection.attributes and self.attribute_keys:
            self.selection.pool_outcomes(trees, self.attribute_keys)
        self.prior.step()
        for tree, w in zip(trees, wins, strict=True):
            self.prior.update(tree.task_id, float(w.sum()), float(len(w) - w.sum()))
        return quality, refit_loss

    def _price(self, result: Iteration) -> Flips:
        """Teach priced Stage 2 what this iteration's continuations and roots earned (`FlipRates`)."""
        assert self.flips is not None
        return self.flips.observe(result.trees, self.flips.signal(result.trees), result.ledger.tokens["bare"])

    def synced_engine(self, module: Learner) -> GenerationEngine:
        """The engine, started and brought to the module's current weights: what `evaluator` plays on."""
        self.start(module)
        assert self.runner is not None
        self._sync_engine(self.runner.engine, module)
        return self.runner.engine

    def _sync_engine(self, engine: GenerationEngine, module: Learner) -> float:
        """Bring the engine to the policy's current weights when they changed since its last sync (or it
        has never been synced: a resumed policy differs from the weights the engine loaded). Seconds."""
        version = module.weights_fingerprint()
        if self._engine_version == version:
            return 0.0
        start = time.perf_counter()
        module.sync_rollout_policy()  # FSDP2: gather the full weights into the engine's unsharded copy
        engine.sync_weights()
        self._engine_version = version
        return time.perf_counter() - start

    # ------------------------------------------------------------------ batches

    def _batches(
        self, trees: list[RolloutTree], module: Learner, pool: list[RolloutTree], processes: Processes
    ) -> tuple[list[RolloutBatch], np.ndarray, int]:
        """This process's micro-batches (`Batching.plan`) with old log-probs, |engine - trainer|
        log-prob gaps on the trained tokens, and the micro-batches each optimizer step accumulates.
        Every step of every process holds as many micro-batches as the busiest one (DDP synchronises
        each backward); the others pad with batches that train nothing."""
        plan = self.batching.plan(trees)  # [step][micro-batch] -> leaf sequences
        steps = max(processes.all_gather(len(plan)))
        per_step = max(1, max(processes.all_gather(max((len(step) for step in plan), default=0))))
        layout = step_layout([*plan, *[[]] * (steps - len(plan))], per_step)
        batches = micro_batches(layout, trees, len(layout), module.tokenizer.pad_token_id, pool[0].prompt_ids)
        gaps = []
        for batch, chunk in zip(batches, layout, strict=True):
            module.fill_old_logprobs(batch)
            for row, seq in enumerate(chunk):
                engine = torch.tensor(seq.engine_logprobs)  # [T]
                known = torch.isfinite(engine)
                gaps.append((batch.old_logprobs[row, : len(engine)][known] - engine[known]).abs().numpy())
        return batches, np.concatenate(gaps) if gaps else np.zeros(0), per_step

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
            "spent": self._spent,
            "flips": self.flips.state_dict() if self.flips is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.rng.bit_generator.state = state["rng"]
        self._sampling_rng = state["torch_rng"]
        self.prior.load_state_dict(state["prior"])
        if "selection" in state:  # absent in checkpoints written before the selection state
            self.selection.load_state_dict(state["selection"])
        if self.predictor_fit is not None and state.get("predictor_fit") is not None:
            self.predictor_fit.load_state_dict(state["predictor_fit"])
        spent = state.get("spent")  # absent in checkpoints written before budget.unit=tokens
        self._spent = None if spent is None else (int(spent[0]), int(spent[1]), bool(spent[2]))
        if self.flips is not None and state.get("flips") is not None:  # absent before priced Stage 2
            self.flips.load_state_dict(state["flips"])


def _mean_max(gaps: np.ndarray) -> tuple[float, float]:
    return (float(gaps.mean()), float(gaps.max())) if gaps.size else (math.nan, math.nan)
