"""Platt scaling of the head's predictions on outcomes it had not seen (our choice).

The head is refitted every iteration on few, noisy, recent labels, and measured online it was
over-confident: its Brier score was worse than the base rate's (0.309 against 0.223). A two-parameter
map p' = sigmoid(a * logit(p) + c), fitted on the bare outcomes of the roots the head predicted before
seeing them, shrinks an over-confident head towards the base rate (a < 1) and removes a bias (c) without
touching its ranking. The fit is a ridge-regularised logistic regression (towards a = 1, c = 0, the
identity) on the last `window` iterations, solved by Newton's method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LOGIT_CLIP = 1e-4  # predictions are clipped to [1e-4, 1 - 1e-4] before the logit


def logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), LOGIT_CLIP, 1 - LOGIT_CLIP)
    return np.asarray(np.log(q / (1 - q)))


@dataclass
class PlattCalibration:
    """sigmoid(a * logit(p) + c), refitted after every iteration on (raw prediction, bare outcomes) of
    its roots. `strength` is the ridge penalty in units of outcomes: with few outcomes the map stays
    near the identity."""

    window: int = 8
    strength: float = 4.0
    a: float = 1.0
    c: float = 0.0
    history: list[tuple[int, float, float, float]] = field(default_factory=list)  # (it, logit, wins, n)

    def __post_init__(self) -> None:
        if self.window < 1 or self.strength <= 0:
            raise ValueError(
                f"predictor.calibration_window={self.window} must be >= 1 and the ridge strength "
                f"{self.strength} > 0"
            )

    def __call__(self, p: np.ndarray) -> np.ndarray:
        return np.asarray(1 / (1 + np.exp(-(self.a * logit(p) + self.c))), dtype=np.float64)

    def observe(
        self, iteration: int, raw: Sequence[float], wins: Sequence[float], rollouts: Sequence[float]
    ) -> None:
        """Add one iteration's roots (raw predictions, successes, bare rollouts) and refit."""
        kept = [h for h in self.history if h[0] > iteration - self.window]
        x = logit(np.asarray(raw))
        rows = zip(x, wins, rollouts, strict=True)
        new = [(iteration, float(xi), float(s), float(n)) for xi, s, n in rows if n]
        self.history = kept + new
        self.a, self.c = self.fit()

    def fit(self, steps: int = 30) -> tuple[float, float]:
        """Damped Newton on the penalised binomial log-likelihood (a step is halved until the objective
        improves: plain Newton overshoots from the identity when the head is far off): (a, c)."""
        if not self.history:
            return 1.0, 0.0
        x, s, n = (np.array([h[i] for h in self.history]) for i in (1, 2, 3))
        design = np.stack([x, np.ones_like(x)], axis=1)  # [N, 2]
        prior = np.array([1.0, 0.0])

        def objective(theta: np.ndarray) -> float:
            z = design @ theta
            return float(
                np.sum(s * z - n * np.logaddexp(0, z)) - self.strength / 2 * np.sum((theta - prior) ** 2)
            )

        theta = prior.copy()
        for _ in range(steps):
            p = 1 / (1 + np.exp(-(design @ theta)))
            grad = design.T @ (s - n * p) - self.strength * (theta - prior)
            hess = (design * (n * p * (1 - p))[:, None]).T @ design + self.strength * np.eye(2)
            step, current = np.linalg.solve(hess, grad), objective(theta)
            while objective(theta + step) < current and np.abs(step).max() > 1e-12:
                step = step / 2
            theta = theta + step
        return float(theta[0]), float(theta[1])

    def state_dict(self) -> dict[str, Any]:
        return {"a": self.a, "c": self.c, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.a, self.c = float(state["a"]), float(state["c"])
        self.history = [(int(i), float(x), float(s), float(n)) for i, x, s, n in state["history"]]
