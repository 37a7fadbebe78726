"""What one iteration built and spent (`IterationReport`): the collector writes it, observers read it
(`metrics.py` turns it into numbers, `artifacts.py` into files, the console into lines).

No Lightning here, so notebooks and benchmarks read reports without the training stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trace_lightning.engines.base import EngineStats
from trace_lightning.iteration import Iteration
from trace_lightning.pricing import Flips
from trace_lightning.runner import RolloutCounters
from trace_lightning.selection import RootQuality
from trace_lightning.tree import RolloutTree


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
    pool_ids: list[int] | None = None  # the candidate pool's task ids, in `result.pool_predicted`'s order
    # the whole `collect` call: sync, sampling, the refit and the batches' old log-probs (budget/seconds)
    collect_seconds: float = 0.0
    optimizer_steps: int = 0  # optimizer steps this iteration trains (data.steps_per_iteration)
    micro_batches_per_step: int = 1  # the gradient accumulation of each of them
    steered: bool = True  # the predictor steered Stage 1 (the skill gate was open, or there is none)
    flips: Flips | None = None  # priced Stage 2: its continuations and flips by start depth
