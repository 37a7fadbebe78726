"""RolloutDataModule: one Lightning epoch = one TRACE iteration of freshly generated trees.

`train_dataloader()` is called again at every epoch (the Trainer must run with
`reload_dataloaders_every_n_epochs=1`), after the previous epoch's updates, so each batch is sampled
by the current policy (on-policy). The DataModule is the Lightning side only: the engine is started in
`setup` and closed in `teardown`, and each epoch's batches come from `collector.RolloutCollector`,
which owns the pool, the RNGs, the prior, the engine sync and the report.

Observers (the callbacks, the console) reach the run's rollouts only through this class's typed face:
`RolloutDataModule.of(trainer)`, then `report`, `budget`, `eval_tasks`/`evaluate` and `probe`. A
progress display registers itself once as `progress` (an `EpisodeProgress`); the DataModule hands its
per-episode hook to the collector while an iteration samples, and the held-out evaluation opens its
bar from the same display.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from trace_lightning.advantages import Estimator, TreeGRPO
from trace_lightning.allocation import BetaPrior, TreeAllocator
from trace_lightning.batching import Batching, RolloutBatch
from trace_lightning.budget import Budget
from trace_lightning.collector import EngineFactory, Learner, RolloutCollector
from trace_lightning.distributed import Processes
from trace_lightning.engines.base import SamplingParams
from trace_lightning.envs.base import Environment
from trace_lightning.evaluation import EvalResult, EvalSettings
from trace_lightning.predictor import PredictorFit
from trace_lightning.report import IterationReport
from trace_lightning.runner import EpisodeLimits
from trace_lightning.selection import Selection

__all__ = ["DataSettings", "EpisodeBar", "EpisodeProgress", "IterationReport", "RolloutDataModule"]


@dataclass(frozen=True)
class DataSettings(EpisodeLimits):
    """The `data` config group: the candidate pool, micro-batching, and (inherited) the episode limits."""

    pool_size: int = 12  # candidate prompts scored per iteration
    micro_batch_size: int = 4  # leaf sequences per micro-batch, used only when micro_batch_tokens is null
    micro_batch_tokens: int | None = 2048  # packed tokens per micro-batch (shared tokens once)
    # Optimizer steps per iteration, whatever the allocator and packing: the iteration's leaves are split
    # evenly into this many steps, each accumulating the gradients of its micro-batches (the DataModule
    # sets the Trainer's accumulate_grad_batches). null: one step per micro-batch, so a method whose
    # trees pack into fewer micro-batches makes fewer steps.
    steps_per_iteration: int | None = 2
    # With steps_per_iteration set: deal each tree's leaves across the steps (leaf i to step i mod steps)
    # instead of cutting the leaves into contiguous runs, so one tree of near-duplicates does not fill a
    # step and every step sees as many prompts as the iteration holds.
    spread_trees: bool = False
    # Tasks set aside (envs.base.split_tasks with the run's seed, the warm start's rule): never drawn
    # into the pool; callbacks.HeldOutSuccess plays them to draw the learning curve. 0: none.
    held_out: int = 0
    # The seed of that split (null: the run's `seed`). Seeds of one comparison that train from the same
    # warm start set it (and env.seed) to the warm start's seed, so that only the training streams differ.
    split_seed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pool_size < 1 or self.held_out < 0:
            raise ValueError(
                f"data.pool_size={self.pool_size} must be >= 1 and data.held_out={self.held_out} >= 0"
            )


class EpisodeBar(Protocol):
    """A bar counting the episodes of one loop (a tqdm bar is one)."""

    def update(self, n: int = 1) -> bool | None: ...

    def close(self) -> None: ...


class EpisodeProgress(Protocol):
    """A display that counts episodes as they end (`console.IterationProgress` is one)."""

    def episode_done(self) -> None:
        """One episode of the iteration being sampled has ended."""
        ...

    def episode_bar(self, description: str, total: int) -> EpisodeBar | None:
        """A bar for another loop of episodes (the held-out evaluation); None while disabled."""
        ...


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        env: Environment,
        allocator: TreeAllocator,
        engine: EngineFactory,
        *,
        sampling: SamplingParams = SamplingParams(),
        budget: Budget = Budget(),
        settings: DataSettings = DataSettings(),
        estimator: Estimator = TreeGRPO(),
        cold_start: BetaPrior | None = None,
        selection: Selection | None = None,
        predictor_fit: PredictorFit | None = None,
        seed: int = 0,
        collector: Callable[..., RolloutCollector] = RolloutCollector,
    ) -> None:
        """`collector` builds the collector from the rest: the product's, or a benchmark's instrument
        that overrides one of its stages (benchmarks/learning.py TrueVCollector)."""
        super().__init__()
        self.collector = collector(
            env,
            allocator,
            engine,
            sampling,
            budget,
            settings.pool_size,
            settings.held_out,
            settings.limits(),
            Batching(
                settings.micro_batch_size,
                settings.micro_batch_tokens,
                estimator,
                settings.steps_per_iteration,
                settings.spread_trees,
            ),
            cold_start if cold_start is not None else BetaPrior(warmup=0),
            selection if selection is not None else Selection(),
            predictor_fit,  # None: the head learns only from the joint loss
            seed,
            split_seed=settings.split_seed,
        )
        self.progress: EpisodeProgress | None = None  # the display that counts episodes, if any

    @classmethod
    def of(cls, trainer: Any) -> RolloutDataModule | None:
        """The Trainer's DataModule when it is a RolloutDataModule, else None (no Trainer, no
        `fit(datamodule=...)` yet, or another DataModule): where observers start."""
        datamodule = getattr(trainer, "datamodule", None)  # set by `fit(datamodule=...)`
        return datamodule if isinstance(datamodule, cls) else None

    @property
    def report(self) -> IterationReport | None:
        """The latest iteration's report (callbacks read it)."""
        return self.collector.report

    @property
    def budget(self) -> Budget:
        """What every iteration may spend (progress displays count episodes against its leaves)."""
        return self.collector.budget

    def eval_tasks(self, tasks: str) -> list[int]:
        """The task ids of an `eval.tasks` choice: held_out, train or all."""
        return self.collector.evaluator.tasks(tasks)

    def evaluate(self, module: Learner, settings: EvalSettings, description: str) -> EvalResult | None:
        """The held-out evaluation with the module's current policy (`evaluation.Evaluator`), its
        episodes counted on a bar named `description` when a display is registered (`progress`).
        None: nothing to evaluate (data.held_out=0)."""
        episodes = len(self.eval_tasks(settings.tasks)) * settings.samples
        progress = self.progress if episodes > 0 else None
        bar = None if progress is None else progress.episode_bar(description, episodes)

        try:
            return self.collector.evaluator.evaluate(module, settings, bar)
        finally:
            if bar is not None:
                bar.close()

    def probe(self, module: Learner, task_ids: Sequence[int], samples: int, seed: int) -> np.ndarray:
        """Successes of `samples` episodes of each task [P], outside the budget (`evaluation.Evaluator`)."""
        return self.collector.evaluator.probe(module, task_ids, samples, seed)

    def setup(self, stage: str) -> None:
        """Start the engine on the policy the Trainer holds (its weights are synced before sampling)."""
        if stage == "fit" and self.trainer is not None:
            self.collector.start(self.trainer.lightning_module)

    def teardown(self, stage: str) -> None:
        self.collector.close()

    def train_dataloader(self) -> DataLoader[RolloutBatch | None]:
        """Iteration k is sampled for epoch k.

        On resume Lightning first asks again for the epoch the checkpoint was taken in, whose iteration
        was already sampled (and trained on, up to the save). That epoch gets a single `None` batch,
        which `TraceModule.training_step` skips, so the RNG is not spent twice and the next epoch
        samples exactly the iteration an uninterrupted run would. (An empty loader would make
        Lightning stop the whole fit.)
        """
        self.trainer.accumulate_grad_batches = 1
        if self.trainer.current_epoch < self.collector.iteration:
            return DataLoader([None], batch_size=None, collate_fn=lambda b: b)
        batches = self.build_iteration(self.trainer.lightning_module)
        report = self.collector.report
        assert report is not None
        # this data module owns the accumulation: each optimizer step ends where the plan's steps end
        self.trainer.accumulate_grad_batches = report.micro_batches_per_step
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=lambda b: b)

    def build_iteration(self, module: Learner) -> list[RolloutBatch]:
        """One iteration's micro-batches, sampled with the module's current policy (see the collector)."""
        self.collector.on_episode_end = None if self.progress is None else self.progress.episode_done
        return self.collector.collect(module, Processes.of(self.trainer))

    def state_dict(self) -> dict[str, Any]:
        return self.collector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.load_state_dict(state)
