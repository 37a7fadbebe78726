"""A synthetic multi-turn task whose success probability is known exactly at every prefix.

Each task is a chain of `turns` decisions. At turn t the agent picks one of `n_choices` actions; one
of them is the task's answer for that turn. A wrong pick is a mistake; the episode is lost as soon
as the mistakes exceed the task's `tolerance`, and won when all turns are done within it.

Under the reference tabular policy, turn t of task i is answered correctly with probability
p_it = sigmoid(theta_i + h_t): theta_i is the task's hidden skill gap (partly visible through its
`features`, partly hidden noise) and h_t the turn's own hardness. The state after a prefix is
(turn, mistakes), so the true V of any prefix is a Poisson-binomial tail, computed exactly below.
This gives the decided prefixes (too many mistakes already: V = 0) and the knife-edge ones that
TRACE looks for, with an oracle to measure allocation against. The episode runner that plays it and
the oracle scorer are in `simulator.py` (they use the algorithm; an environment does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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
