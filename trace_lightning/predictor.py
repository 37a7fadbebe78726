"""The success predictor Ṽ_ψ: a small head on the policy's final hidden state (TRACE_SPEC, "shared
predictor", our architecture choice).

The head reads the hidden state at the last token of a prefix, so one forward pass over a rollout
scores every turn prefix on it at once (attention is causal: the state at the end of turn t has seen
exactly H_t). Its input is detached: the predictor is used only for allocation and never sends a
gradient into the policy.
"""

from __future__ import annotations

import torch
from torch import nn


class SuccessHead(nn.Module):
    """hidden state [K, H] -> logit of P(success | prefix) [K]."""

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"predictor.width={width} must be >= 1")
        self.net = nn.Sequential(
            nn.LayerNorm(hidden_size), nn.Linear(hidden_size, width), nn.GELU(), nn.Linear(width, 1)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.detach().float()).squeeze(-1)  # [K]


def gather_positions(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] at (rows[k], cols[k]) -> [K, H]."""
    return hidden[rows, cols]
