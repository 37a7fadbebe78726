"""The success predictor Ṽ_ψ: a small head on the policy's final hidden state (our architecture choice,
docs/algorithm.md#the-success-predictor).

The head reads the hidden state at the last token of a prefix, so one forward pass over a rollout
scores every turn prefix on it at once (attention is causal: the state at the end of turn t has seen
exactly H_t). Its input is detached: the predictor is used only for allocation and never sends a
gradient into the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trace_lightning.losses import predictor_mse

POOLINGS = ("last", "last_mean")
WEIGHTINGS = ("leaves", "uniform")
POSTERIOR_FEATURES = 2  # the prompt's decayed posterior mean and log(1 + decayed visits), see data.py


@dataclass(frozen=True)
class PredictorSettings:
    """The `predictor` config group, checked when made (at start-up, before any model is loaded).

    width: hidden units of the head. lr: its learning rate (joint loss and refit).
    coef: weight of the predictor MSE in the policy's loss (0: the head trains only in the refit).
    weighting: "leaves" weighs a prefix's target by its leaf count, "uniform" equally.
    backbone: a frozen companion LM folder the head reads instead of the policy (same tokenizer).
    standardize: a FeatureScaler (across prompts) instead of LayerNorm in front of the head.
    pooling: "last" (the prefix's last hidden state) or "last_mean" (also the mean over the prefix).
    posterior_features: append the prompt's decayed Beta mean and log(1 + visits) (refit only).
    refit_steps / replay_window / refit_batch: the head-only refit after each iteration (0 steps: off).
    """

    width: int = 256
    lr: float = 1e-3
    coef: float = 0.0
    weighting: str = "leaves"
    backbone: str | None = None
    standardize: bool = True
    pooling: str = "last_mean"
    posterior_features: bool = False
    refit_steps: int = 50
    replay_window: int = 8
    refit_batch: int = 256

    def __post_init__(self) -> None:
        if self.width < 1 or self.lr <= 0 or self.coef < 0:
            raise ValueError(
                f"predictor.width={self.width} (>= 1), predictor.lr={self.lr} (> 0) and "
                f"predictor.coef={self.coef} (>= 0): one is out of range"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"predictor.weighting={self.weighting!r}: use one of {list(WEIGHTINGS)}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"predictor.pooling={self.pooling!r}: use one of {list(POOLINGS)}")
        if self.pooling != "last" and self.coef > 0:
            raise ValueError(
                "predictor.pooling=last_mean is read only by the refit; set predictor.coef=0 (train the "
                "head by predictor.refit_steps) or predictor.pooling=last"
            )
        if self.posterior_features and self.coef > 0:
            raise ValueError(
                "predictor.posterior_features=true feeds prompt statistics only the refit knows; set "
                "predictor.coef=0 (train the head by predictor.refit_steps) or posterior_features=false"
            )
        self.refit(seed=0)  # its ranges are checked now too

    def input_size(self, hidden_size: int) -> int:
        """Width of the features the module computes for a backbone of `hidden_size` (no extras)."""
        return hidden_size * (2 if self.pooling == "last_mean" else 1)

    def build_head(self, hidden_size: int) -> SuccessHead:
        """The head for a backbone of `hidden_size`, with the prompt statistics when configured."""
        extra = POSTERIOR_FEATURES if self.posterior_features else 0
        return SuccessHead(self.input_size(hidden_size), self.width, extra, self.standardize)

    def refit(self, seed: int) -> PredictorFit | None:
        """The head-only refit these settings ask for (None when refit_steps is 0)."""
        fit = PredictorFit(self.refit_steps, self.replay_window, self.refit_batch, self.lr, seed)
        return fit if self.refit_steps > 0 else None


class SuccessHead(nn.Module):
    """features [K, F] -> logit of P(success | prefix) [K].

    The features are the hidden state at the prefix's last token, optionally followed by
    `extra` prompt statistics (see `data.py`). With `standardize`, a `FeatureScaler` fitted across
    prompts comes first; otherwise a LayerNorm (the original head).
    """

    def __init__(self, hidden_size: int, width: int = 256, extra: int = 0, standardize: bool = False) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"predictor.width={width} must be >= 1")
        size = hidden_size + extra
        self.scaler = FeatureScaler(size) if standardize else None
        self.net = nn.Sequential(
            nn.Identity() if standardize else nn.LayerNorm(size),
            nn.Linear(size, width),
            nn.GELU(),
            nn.Linear(width, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = features.detach().float()
        return self.net(self.scaler(x) if self.scaler is not None else x).squeeze(-1)  # [K]


def gather_positions(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] at (rows[k], cols[k]) -> [K, H]."""
    return hidden[rows, cols]


# --------------------------------------------------------------------------- online refit (issue 11)


class FeatureScaler(nn.Module):
    """Per-feature standardisation across prompts, with running (exponential) mean and variance.

    After a warm start the prompts' last hidden states can be nearly identical (mean pairwise cosine
    0.9993 measured at 85f38aa), so what tells prompts apart is a tiny deviation from their common
    direction. LayerNorm normalises each vector on its own and keeps that common direction; this
    removes it, so the head sees the differences at unit scale. Buffers, so they are checkpointed
    with the module.
    """

    def __init__(self, size: int, momentum: float = 0.1, eps: float = 1e-12) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("mean", torch.zeros(size))
        self.register_buffer("var", torch.ones(size))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch [N, F] of inputs (e.g. one iteration's candidate prompts) into the statistics."""
        if len(x) < 2:
            return
        mean, var = x.float().mean(0), x.float().var(0)
        if int(self.seen) == 0:  # the first batch sets them; later ones move them by `momentum`
            self.mean.copy_(mean)
            self.var.copy_(var)
        else:
            self.mean.lerp_(mean, self.momentum)
            self.var.lerp_(var, self.momentum)
        self.seen += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) / torch.sqrt(self.var + self.eps)


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
    """

    steps: int = 50
    window: int = 8
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    replay: dict[int, ReplayEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
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
        return tuple(torch.cat([getattr(e, k) for e in kept]) for k in ("features", "targets", "weights"))  # type: ignore[return-value]

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replay = {int(t): ReplayEntry(**e) for t, e in state["replay"].items()}
        self._pending_optimizer_state, self._optimizer = state["optimizer"], None
        self._generator.set_state(state["generator"])
