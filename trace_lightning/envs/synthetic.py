"""A synthetic multi-turn task whose success probability is known exactly at every prefix.

Each task is a chain of `turns` decisions. At turn t the agent picks one of `n_choices` actions; one
of them is the task's answer for that turn. A wrong pick is a mistake; the episode is lost as soon
as the mistakes exceed the task's `tolerance`, and won when all turns are done within it.

Under the reference tabular policy, turn t of task i is answered correctly with probability
p_it = sigmoid(theta_i + h_t): theta_i is the task's hidden skill gap (partly visible through its
`features`, partly hidden noise) and h_t the turn's own hardness. The state after a prefix is
(turn, mistakes), so the true V of any prefix is a Poisson-binomial tail, computed exactly below.
This gives the decided prefixes (too many mistakes already: V = 0) and the knife-edge ones that
TRACE looks for, with an oracle to measure allocation against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from trace_lightning.allocation import BudgetLedger
from trace_lightning.iteration import Branch
from trace_lightning.tree import RolloutTree

CORRECT, WRONG = 1, 0  # observation token after each turn


@dataclass(frozen=True)
class ChainTask:
    task_id: int
    features: tuple[float, ...]  # what a predictor may see about the task
    answers: tuple[int, ...]  # the right choice at each turn
    step_probs: tuple[float, ...]  # P(right choice at turn t) under the reference policy
    tolerance: int  # mistakes allowed

    @property
    def turns(self) -> int:
        return len(self.answers)


def make_tasks(
    n: int,
    turns: int = 4,
    n_features: int = 4,
    n_choices: int = 4,
    hidden_noise: float = 0.5,
    spread: float = 2.0,
    seed: int = 0,
) -> list[ChainTask]:
    """Tasks whose success rates spread from hopeless to trivial (as real RL prompt pools do).

    theta_i = spread * (w . x_i) / |w| + hidden_noise * eps_i, with x_i ~ N(0, I) visible as
    `features` and eps_i ~ N(0, 1) hidden; turn hardness h_t rises linearly from +1 to -1.
    """
    if turns < 1 or n_choices < 2:
        raise ValueError(
            f"synthetic task needs turns >= 1 (got {turns}) and n_choices >= 2 (got {n_choices})"
        )
    rng = np.random.default_rng(seed)
    w = rng.normal(size=n_features)
    x = rng.normal(size=(n, n_features))  # [n, F]
    theta = spread * x @ w / np.linalg.norm(w) + hidden_noise * rng.normal(size=n)  # [n]
    hardness = np.linspace(1.0, -1.0, turns)  # [T]
    probs = 1.0 / (1.0 + np.exp(-(theta[:, None] + hardness[None, :])))  # [n, T]
    answers = rng.integers(n_choices, size=(n, turns))
    tolerance = rng.integers(0, 2, size=n)
    return [
        ChainTask(
            i, tuple(x[i].round(4)), tuple(answers[i].tolist()), tuple(probs[i].tolist()), int(tolerance[i])
        )
        for i in range(n)
    ]


def true_value(task: ChainTask, turn: int, mistakes: int) -> float:
    """P(success | `turn` turns done with `mistakes` mistakes) under the reference policy."""
    return _value_table(task.step_probs, task.tolerance)[turn][min(mistakes, task.tolerance + 1)]


@lru_cache(maxsize=65536)
def _value_table(step_probs: tuple[float, ...], tolerance: int) -> tuple[tuple[float, ...], ...]:
    """V[t][e] for e in 0..tolerance+1 by backward induction (e = tolerance+1 means already lost)."""
    turns = len(step_probs)
    table = [[0.0] * (tolerance + 2) for _ in range(turns + 1)]
    table[turns] = [1.0] * (tolerance + 1) + [0.0]
    for t in range(turns - 1, -1, -1):
        p = step_probs[t]
        for e in range(tolerance + 1):
            table[t][e] = p * table[t + 1][e] + (1 - p) * table[t + 1][e + 1]
    return tuple(tuple(row) for row in table)


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
