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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from trace_lightning.allocation import BetaPrior, Budget, TreeAllocator
from trace_lightning.batching import ESTIMATORS, RolloutBatch, collate, leaf_sequences, node_advantages
from trace_lightning.engines.base import GenerationEngine, SamplingParams
from trace_lightning.envs.base import Environment
from trace_lightning.iteration import Iteration, build_trees
from trace_lightning.runner import ReActRunner, RolloutCounters
from trace_lightning.tree import RolloutTree


@dataclass
class IterationReport:
    """What the latest iteration built and spent; callbacks read it, compute code never logs."""

    iteration: int
    result: Iteration
    counters: RolloutCounters
    used_prior: bool
    policy_fingerprint: float  # sum of trainable weights when the rollouts were sampled


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
        max_turns: int = 4,
        max_episode_tokens: int = 256,
        step_timeout: float | None = 30.0,
        max_observation_chars: int = 4000,
        estimator: str = "tree_grpo",
        cold_start: BetaPrior | None = None,
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
        self.pool_size, self.micro_batch_size, self.estimator = pool_size, micro_batch_size, estimator
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.step_timeout, self.max_observation_chars = step_timeout, max_observation_chars
        self.prior = cold_start if cold_start is not None else BetaPrior(warmup=0)
        self.rng = np.random.default_rng(seed)
        # The engine samples with torch's global RNG; the DataModule owns that stream between iterations
        # (restored before and saved after each one), so whatever else draws from the global RNG in
        # between (DataLoader seeds, a resume) cannot change what the next iteration samples.
        self._sampling_rng = torch.Generator().manual_seed(seed).get_state()
        self.iteration = 0
        self.report: IterationReport | None = None
        self._runner: ReActRunner | None = None

    def _runner_for(self, module: Any) -> ReActRunner:
        if self._runner is None:
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
        """Sample one iteration of trees with the module's current policy and turn them into batches."""
        runner = self._runner_for(module)
        runner.counters = RolloutCounters()
        task_ids = sorted(runner.tasks)
        pool = [
            runner.new_tree(task_ids[i])
            for i in self.rng.choice(len(task_ids), size=self.pool_size, replace=False)
        ]
        used_prior = self.prior.active(self.iteration)
        score = self._prior_scores if used_prior else module.predict_success
        weights_used = fingerprint(module)
        rank_zero_info(
            f"iteration {self.iteration}: sampling {self.budget.leaves} trajectories ({self.allocator.name})"
        )
        start = time.perf_counter()
        torch.set_rng_state(self._sampling_rng)
        result = build_trees(pool, self.allocator, self.budget, score, runner, self.rng)
        self._sampling_rng = torch.get_rng_state()
        rank_zero_info(
            f"iteration {self.iteration}: {result.ledger.leaves_used} trajectories over {len(result.trees)} "
            f"prompts, {result.ledger.tokens_used} tokens in {time.perf_counter() - start:.1f} s"
        )
        for tree in result.trees:
            wins = sum(tree.nodes[leaf].reward >= 0.5 for leaf in tree.leaves())  # type: ignore[operator]
            self.prior.update(tree.task_id, int(wins), len(tree.leaves()) - int(wins))
        self.report = IterationReport(self.iteration, result, runner.counters, used_prior, weights_used)
        self.iteration += 1
        return self._batches(result.trees, module)

    def _prior_scores(
        self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        return [np.repeat(self.prior.mean([t.task_id]), len(n)) for t, n in zip(trees, node_ids, strict=True)]

    def _batches(self, trees: list[RolloutTree], module: Any) -> list[RolloutBatch]:
        seqs = leaf_sequences(trees, node_advantages(trees, self.estimator))  # type: ignore[arg-type]
        pad = module.tokenizer.pad_token_id
        batches = [
            collate(seqs[i : i + self.micro_batch_size], pad)
            for i in range(0, len(seqs), self.micro_batch_size)
        ]
        for batch in batches:
            module.fill_old_logprobs(batch)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """Everything the next iteration depends on besides the weights: the allocation RNG, the torch
        RNG the engine samples with, the iteration counter and the cold-start prior."""
        return {
            "iteration": self.iteration,
            "rng": self.rng.bit_generator.state,
            "torch_rng": self._sampling_rng,
            "prior": self.prior.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.rng.bit_generator.state = state["rng"]
        self._sampling_rng = state["torch_rng"]
        self.prior.load_state_dict(state["prior"])


def fingerprint(module: torch.nn.Module) -> float:
    """Sum of the trainable weights: cheap evidence of which weights produced a batch."""
    return float(sum(p.detach().double().sum() for p in module.parameters() if p.requires_grad))
