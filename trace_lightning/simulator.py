"""The allocation benchmark's episode runner: the reference tabular policy of `envs/synthetic.py` played
through the algorithm's own `iteration.build_trees` (an `EpisodeRunner`), and the oracle scorer that
knows every prefix's exact V. It lives above the algorithm, not among the environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trace_lightning.budget import BudgetLedger
from trace_lightning.envs.synthetic import CORRECT, WRONG, ChainTask, true_value
from trace_lightning.iteration import Branch
from trace_lightning.tree import RolloutTree


def state_of(tree: RolloutTree, node_id: int) -> tuple[int, int]:
    """(turns done, mistakes) at a prefix, replayed from the observation tokens on its path."""
    path = tree.path(node_id)
    return len(path), sum(tree.nodes[n].obs_ids == [WRONG] for n in path)


@dataclass
class ChainSimulator:
    """Plays the reference tabular policy on `ChainTask`s: the `EpisodeRunner` of the benchmark.

    Each turn costs one generated token. When `budget.max_tokens` runs out mid-episode the episode
    ends as a failure with stop reason "token_budget".
    """

    tasks: dict[int, ChainTask]
    n_choices: int = 4

    def __call__(self, branches: Sequence[Branch], ledger: BudgetLedger, rng: np.random.Generator) -> None:
        for branch in branches:
            task = self.tasks[branch.tree.task_id]
            for _ in range(branch.count):
                self._play(branch.tree, branch.node_id, branch.stage, task, ledger, rng)

    def _play(self, tree: RolloutTree, node_id: int, stage, task: ChainTask, ledger, rng) -> None:
        turn, mistakes = state_of(tree, node_id)
        while True:
            if ledger.tokens_left() == 0:
                node_id = tree.add_turn(node_id, stage, [], [])
                tree.finish(node_id, 0.0, "token_budget")
                return
            right = rng.random() < task.step_probs[turn]
            choice = task.answers[turn] if right else self._wrong_choice(task.answers[turn], rng)
            node_id = tree.add_turn(node_id, stage, [choice], [CORRECT if right else WRONG])
            ledger.charge_tokens(1, stage, turn + 1)
            turn, mistakes = turn + 1, mistakes + (not right)
            if mistakes > task.tolerance:
                tree.finish(node_id, 0.0, "lost")
                return
            if turn == task.turns:
                tree.finish(node_id, 1.0, "solved")
                return

    def _wrong_choice(self, answer: int, rng: np.random.Generator) -> int:
        return int((answer + rng.integers(1, self.n_choices)) % self.n_choices)


def oracle_scores(
    tasks: dict[int, ChainTask], trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """The exact V of each requested prefix: the upper bound any predictor can reach."""
    out = []
    for tree, nodes in zip(trees, node_ids, strict=True):
        task = tasks[tree.task_id]
        out.append(np.array([true_value(task, *state_of(tree, n)) for n in nodes]))
    return out
