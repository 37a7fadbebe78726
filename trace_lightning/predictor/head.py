"""The head Ṽ_ψ reads: an MLP on a prefix's features, behind a FeatureScaler (or a LayerNorm)."""

from __future__ import annotations

import torch
from torch import nn


class SuccessHead(nn.Module):
    """features [K, F] -> logit of P(success | prefix) [K].

    A row is [the policy's states at the prefix (`hidden_size`) ; `extra` prompt statistics ; `raw`
    binary text features]. The first two parts are normalised: with `standardize`, by a
    `FeatureScaler` fitted across prompts, otherwise by a LayerNorm (the original head). The text part
    (0/1 presence of hashed n-grams) enters as it is: a standardiser would blow up a column that no
    root has. With `width` 0 the MLP is one linear layer (a logistic regression: fewer parameters for
    the few labels an online refit has).
    """

    def __init__(
        self, hidden_size: int, width: int = 256, extra: int = 0, standardize: bool = False, raw: int = 0
    ) -> None:
        super().__init__()
        if width < 0:
            raise ValueError(f"predictor.width={width} must be >= 0 (0: a linear head)")
        self.scaled = hidden_size + extra
        self.scaler = FeatureScaler(self.scaled) if standardize else None
        norm = nn.Identity() if standardize or not self.scaled else nn.LayerNorm(self.scaled)
        hidden = [nn.Linear(self.scaled + raw, width), nn.GELU(), nn.Linear(width, 1)]
        # the layout (and state-dict keys) of the original head; width 0: logistic regression
        self.net = nn.Sequential(norm, *(hidden if width else [nn.Linear(self.scaled + raw, 1)]))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = features.detach().float()
        scaled, raw = x[:, : self.scaled], x[:, self.scaled :]
        scaled = self.net[0](self.scaler(scaled) if self.scaler is not None else scaled)
        return self.net[1:](torch.cat([scaled, raw], dim=1)).squeeze(-1)  # [K]


def gather_positions(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] at (rows[k], cols[k]) -> [K, H]."""
    return hidden[rows, cols]


class FeatureScaler(nn.Module):
    """Per-feature standardisation across prompts, with running (exponential) mean and variance.

    After a warm start the prompts' last hidden states can be nearly identical (mean pairwise cosine
    0.9993 measured on the search agent's warm start), so what tells prompts apart is a tiny deviation
    from their common direction. LayerNorm normalises each vector on its own and keeps that common
    direction; this removes it, so the head sees the differences at unit scale. Buffers, so they are
    checkpointed with the module.
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
