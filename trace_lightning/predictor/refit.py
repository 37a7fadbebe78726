"""Head-only refit of Ṽ_ψ on recent iterations' V̂ targets (docs/algorithm.md#predictor-targets-and-the-refit).

`replay_entry` turns one tree into targets (the root from its bare rollouts, each scored prefix from
its subtree mean); `PredictorFit` keeps the latest entry per prompt and fits the head on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from trace_lightning.losses import predictor_mse
from trace_lightning.predictor.calibration import PlattCalibration
from trace_lightning.tree import RolloutTree, backup


@dataclass
class ReplayEntry:
    """One prompt's latest predictor targets: inputs [K, F], V̂ targets [K] and leaf-count weights [K]."""

    iteration: int
    features: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor


@dataclass
class PredictorFit:
    """Head-only refit of Ṽ_ψ after each iteration's trees are built, before the policy trains on them
    (docs/algorithm.md#predictor-targets-and-the-refit).

    The replay holds, per prompt, the targets of the latest iteration it was rolled out in (a later
    visit replaces them), and a fit uses the prompts seen within the last `window` iterations. `steps`
    minibatch steps of weighted MSE run with the head's own AdamW, whose state is checkpointed here.
    `steps = 0` disables the refit (the head then learns only from the joint loss, `predictor.coef`).
    With `label_decay` < 1 an entry's weights shrink by that factor per iteration of age: the policy
    has moved since older labels were drawn.
    """

    steps: int = 50
    window: int = 8
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    replay: dict[int, ReplayEntry] = field(default_factory=dict)
    label_decay: float = 1.0
    calibration: PlattCalibration | None = None  # maps the head's root predictions before Stage 1

    def __post_init__(self) -> None:
        if not 0 < self.label_decay <= 1:
            raise ValueError(f"predictor.label_decay={self.label_decay} must be in (0, 1] (1: no decay)")
        if self.steps < 0 or self.window < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"predictor.refit_steps={self.steps} (>= 0), predictor.replay_window={self.window} "
                f"(>= 1), predictor.refit_batch={self.batch_size} (>= 1) and predictor.lr={self.lr} (> 0): "
                "one is out of range"
            )
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None
        self._generator = torch.Generator().manual_seed(self.seed)

    def add(self, task_id: int, entry: ReplayEntry) -> None:
        self.replay[task_id] = entry

    def training_set(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs [N, F], targets [N] and weights [N] of the prompts seen in the last `window` iterations."""
        kept = [e for e in self.replay.values() if e.iteration > iteration - self.window]
        self.replay = {t: e for t, e in self.replay.items() if e.iteration > iteration - self.window}
        if not kept:
            return torch.zeros(0, 0), torch.zeros(0), torch.zeros(0)
        ages = [self.label_decay ** (iteration - e.iteration) for e in kept]
        weights = torch.cat([e.weights * age for e, age in zip(kept, ages, strict=True)])
        return torch.cat([e.features for e in kept]), torch.cat([e.targets for e in kept]), weights

    def fit(self, head: nn.Module, iteration: int) -> float:
        """`steps` head-only steps on the replay; the mean training loss of the last step (NaN: no data)."""
        x, y, w = self.training_set(iteration)
        if self.steps == 0 or len(y) == 0:
            return float("nan")
        optimizer = self._optimizer_for(head)
        device = next(head.parameters()).device
        x, y, w = x.to(device), y.to(device), w.to(device)
        loss = torch.zeros(())
        with torch.enable_grad():
            for _ in range(self.steps):
                rows = torch.randint(len(y), (min(self.batch_size, len(y)),), generator=self._generator)
                loss = predictor_mse(torch.sigmoid(head(x[rows])), y[rows], w[rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return float(loss.detach())

    def _optimizer_for(self, head: nn.Module) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(head.parameters(), lr=self.lr)
            if self._pending_optimizer_state is not None:
                self._optimizer.load_state_dict(self._pending_optimizer_state)
        return self._optimizer

    def state_dict(self) -> dict[str, Any]:
        """Plain containers of tensors and numbers only (checkpoints load with weights_only=True)."""
        optimizer = (
            self._optimizer.state_dict() if self._optimizer is not None else self._pending_optimizer_state
        )
        return {
            "replay": {str(t): vars(e) for t, e in self.replay.items()},
            "optimizer": optimizer,
            "generator": self._generator.get_state(),
            "calibration": self.calibration.state_dict() if self.calibration is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replay = {int(t): ReplayEntry(**e) for t, e in state["replay"].items()}
        self._pending_optimizer_state, self._optimizer = state["optimizer"], None
        self._generator.set_state(state["generator"])
        if self.calibration is not None and state.get("calibration") is not None:
            self.calibration.load_state_dict(state["calibration"])


def replay_entry(
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
