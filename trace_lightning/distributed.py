"""What a multi-process (DDP) iteration shares between processes, in one place.

Stage 1 is global: every process draws the same candidate pool, scores a round-robin share of it,
and gathers the scores, so all make the same allocation over the whole pool and the leaf budget holds
across processes. Stage 2 is local: each process rolls out the prompts it owns. The report, the prior
and the predictor refit then see every process's trees (gathered); the batches hold the process's own.

Everything here is the identity on one process (no process group), so single-process code calls it
unconditionally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.iteration import Iteration, Shard
from trace_lightning.runner import RolloutCounters
from trace_lightning.tree import RolloutTree


@dataclass(frozen=True)
class Processes:
    """This process's rank among `world` training processes."""

    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, trainer: Any) -> Processes:
        """(0, 1) without a Trainer or without an initialised process group."""
        if trainer is None or not dist.is_available() or not dist.is_initialized():
            return cls()
        return cls(trainer.global_rank, trainer.world_size)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def budget(self, budget: Budget) -> Budget:
        """This process's budget: all leaves (Stage 1 is global and sums to them), and its share of a
        token cap, since the processes generate at the same time without seeing each other's tokens."""
        if self.world == 1 or budget.max_tokens is None:
            return budget
        return Budget(budget.leaves, budget.max_tokens // self.world)

    def shard(self, estimates: np.ndarray, rng: np.random.Generator) -> Shard | None:
        """This process's part of the iteration (None on one process)."""
        if self.world == 1:
            return None
        # One shared draw keeps the allocation RNG identical on every process; the rest is per process.
        seed = int(rng.integers(2**63))
        return Shard(estimates, self.rank, self.world, np.random.default_rng([seed, self.rank]))

    def round_robin(self, n: int) -> list[int]:
        """The pool indices this process scores (shares differ by at most one)."""
        return list(range(self.rank, n, self.world))

    def score_pool(
        self, pool: list[RolloutTree], score: Callable[[list[RolloutTree], list[list[int]]], list[np.ndarray]]
    ) -> np.ndarray:
        """Root estimates over the whole pool [P] (`score(trees, node ids)`, e.g. an IterationScorer);
        with several processes each scores a round-robin share and the scores are gathered, so all see
        the same pool."""
        if self.world == 1:
            return np.concatenate(score(pool, [[0]] * len(pool))) if pool else np.zeros(0)
        mine = self.round_robin(len(pool))
        local = score([pool[i] for i in mine], [[0]] * len(mine)) if mine else []
        return self.gather_scores(len(pool), [float(v[0]) for v in local])

    def gather_scores(self, n: int, local: list[float]) -> np.ndarray:
        """The whole pool's scores [n] from each process's round-robin share."""
        scores = np.full(n, np.nan)
        for r, values in enumerate(self.all_gather(local)):
            scores[r :: self.world] = values
        return scores

    def gather_iteration(
        self, local: Iteration, counters: RolloutCounters, budget: Budget
    ) -> tuple[Iteration, RolloutCounters]:
        """The iteration as a whole: every process's trees, spending and counters."""
        if self.world == 1:
            return local, counters
        parts = self.all_gather((local.trees, local.ledger, counters, local.root_counts))
        ledger = BudgetLedger(budget)
        total = RolloutCounters()
        for _, part_ledger, part_counters, _ in parts:
            for stage in ledger.leaves:
                ledger.leaves[stage] += part_ledger.leaves[stage]
                ledger.tokens[stage] += part_ledger.tokens[stage]
            ledger.returned += part_ledger.returned
            for depth, n in part_ledger.tokens_by_depth.items():
                ledger.tokens_by_depth[depth] = ledger.tokens_by_depth.get(depth, 0) + n
            total.merge(part_counters)
        trees = [t for part_trees, _, _, _ in parts for t in part_trees]
        # Stage 1's counts are the same everywhere; priced Stage 2 gives leaves back over disjoint
        # candidates per process (iteration.build_trees), so the largest count of each is the whole's
        root_counts = np.max(np.stack([counts for _, _, _, counts in parts]), axis=0)
        return Iteration(trees, ledger, local.pool_predicted, root_counts), total
