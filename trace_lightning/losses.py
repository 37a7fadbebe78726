"""Policy and predictor losses: pure torch functions over [B, T] token tensors.

Shapes: B sequences of T tokens; `mask` is 1 on the tokens that train (the action tokens a sequence
owns, see `tree.py`) and 0 on prompt, observation, padding and shared-prefix tokens.

Masked-out positions never influence a loss or its gradient, even when they hold garbage (e.g. -inf
log-probabilities on padding): they are replaced by neutral values with `torch.where` before any
exp or product, so no 0 * inf can reach the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

KL_KINDS: tuple[str, ...] = ("k1", "k3")


class Aggregation(Protocol):
    """Per-token values [B, T] and their mask [B, T] -> one scalar loss. The `aggregation` config
    group selects one by `_target_` (conf/aggregation/*.yaml).

    Every aggregation gives 0.0 for an all-zero mask, still attached to the graph of `values`, never
    NaN, and ignores whatever the masked-out positions hold.

    Example: values [[1, 2, 3, 4], [5, 6, 0, 0]], mask [[1, 1, 1, 1], [1, 1, 0, 0]] -> TokenMean
    21 / 6 = 3.5; SeqMeanTokenMean (2.5 + 5.5) / 2 = 4.0.
    """

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


def _kept(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values with masked-out positions set to 0, the mask as weights), both [B, T]."""
    keep = mask.bool()
    return torch.where(keep, values, torch.zeros_like(values)), keep.to(values.dtype)


@dataclass(frozen=True)
class TokenMean:
    """sum(values * mask) / sum(mask): every trained token weighs the same (DAPO)."""

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        masked, weights = _kept(values, mask)
        return masked.sum() / weights.sum().clamp(min=1)


@dataclass(frozen=True)
class SeqMeanTokenMean:
    """The mean over sequences with at least one trained token of that sequence's token mean: every
    sequence weighs the same, whatever its length (the original GRPO)."""

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        masked, weights = _kept(values, mask)
        seq_tokens = weights.sum(dim=-1)  # [B]
        seq_mean = masked.sum(dim=-1) / seq_tokens.clamp(min=1)  # [B]; 0 for sequences with no token
        has_tokens = (seq_tokens > 0).to(values.dtype)  # [B]
        return (seq_mean * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _kl_from_log_ratio(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    """KL estimate per token from log_ratio = ref_logp - logp.  # [B, T]"""
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"loss.kl_kind={kind!r} is unknown; use 'k1' or 'k3'")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman 2020, "Approximating KL").

    k1 = logp - ref_logp: unbiased but high variance, can be negative.
    k3 = exp(ref - logp) - (ref - logp) - 1: unbiased and always >= 0, the usual choice for a KL loss.

    Example (k3): logp [0, -1], ref [-0.5, 0] -> [0.106531, 0.718282].

    Returns:
        [B, T] estimates, same shape as `logp`.
    """
    return _kl_from_log_ratio(ref_logp - logp, kind)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    aggregation: Aggregation,
) -> torch.Tensor:
    """Aggregated KL penalty against the reference policy over the trained tokens."""
    keep = mask.bool()  # [B, T]
    # A zero log-ratio gives exactly 0 for both k1 and k3, so masked tokens add nothing, not even NaN.
    log_ratio = torch.where(keep, ref_logp - logp, torch.zeros_like(logp))  # [B, T]
    return aggregation(_kl_from_log_ratio(log_ratio, kind), mask)


@dataclass(frozen=True)
class SurrogateOutput:
    """The PPO loss and its diagnostics. Metrics are detached scalars, token-means over the mask.

    clip_frac: fraction of trained tokens whose loss came from a clipped branch (no gradient).
    ratio_mean: mean of pi / pi_old.
    approx_kl: mean of old_logp - logp, the k1 estimate of KL(pi_old || pi) (see `clipped_surrogate`).
    """

    loss: torch.Tensor
    clip_frac: torch.Tensor
    ratio_mean: torch.Tensor
    approx_kl: torch.Tensor


@dataclass(frozen=True)
class LossSettings:
    """The `loss` config group: the policy loss's settings, checked when they are made (at start-up).

    clip_low / clip_high: the ratio's trust region [1 - clip_low, 1 + clip_high] (clip-higher, DAPO).
    dual_clip: cap on the loss of negative-advantage tokens (> 1), or None.
    kl_coef / kl_kind: weight and estimator of the KL penalty to the reference policy (0: none).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(
                f"loss.clip_low={self.clip_low}: must be in [0, 1) so that 1 - clip_low stays positive"
            )
        if self.clip_high < 0.0:
            raise ValueError(f"loss.clip_high={self.clip_high}: must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(
                f"loss.dual_clip={self.dual_clip}: must be > 1 (3.0 is usual), or null to disable"
            )
        if self.kl_coef < 0:
            raise ValueError(f"loss.kl_coef={self.kl_coef} must be >= 0 (0: no KL penalty)")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"loss.kl_kind={self.kl_kind!r} is unknown; use one of {list(KL_KINDS)}")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    aggregation: Aggregation,
) -> SurrogateOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric bounds and optional dual clip.

    Per token, with ratio = exp(logp - old_logp):
        loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    With `dual_clip` c > 1 (Ye et al. 2020), tokens with A < 0 are also capped at -A * c, so a
    ratio that has already grown far beyond the trust region cannot make the loss unbounded.

    Example: A = +1, ratio 1.5 -> clamped to 1.2, loss -1.2 (clipped, no gradient); A = -1, ratio
    0.5 -> clamped to 0.8, loss 0.8 (clipped); A = -1, ratio 4 with c = 3 -> loss min(4, 3) = 3.

    approx_kl is the k1 estimate mean(old_logp - logp): the tokens were sampled from pi_old, so it is
    unbiased for KL(pi_old || pi) and matches what verl logs as `ppo_kl`; it can dip below 0 on a
    batch, which is noise, not a bug.

    Returns:
        SurrogateOutput with the aggregated loss and detached token-mean metrics.
    """
    clip_low, clip_high, dual_clip = settings.clip_low, settings.clip_high, settings.dual_clip
    keep = mask.bool()  # [B, T]
    zeros = torch.zeros_like(logp)  # [B, T]
    log_ratio = torch.where(keep, logp - old_logp, zeros)  # [B, T]; masked tokens get ratio 1
    adv = torch.where(keep, advantages.to(logp.dtype), zeros)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    was_clipped = clipped > unclipped  # [B, T]
    if dual_clip is not None:
        cap = -adv * dual_clip  # [B, T]
        capped = (adv < 0) & (per_token > cap)  # [B, T]
        per_token = torch.where(capped, cap, per_token)
        was_clipped = was_clipped | capped
    with torch.no_grad():
        mean = TokenMean()
        clip_frac, ratio_mean = mean(was_clipped.to(logp.dtype), mask), mean(ratio, mask)
        approx_kl = mean(-log_ratio, mask)
    return SurrogateOutput(aggregation(per_token, mask), clip_frac, ratio_mean, approx_kl)


def predictor_mse(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted mean squared error: sum(w * (pred - target)^2) / sum(w).

    Weights are normalised by their sum, so only their proportions matter (e.g. leaf counts, which
    weigh a node's backed-up value by how many outcomes it averages). No weights means a plain mean.
    Empty input, or weights that sum to 0, give a 0.0 loss attached to `pred`'s graph.

    Example: pred [0, 1], target [1, 1], weights [3, 1] -> (3 * 1 + 1 * 0) / 4 = 0.75.
    """
    if pred.shape != target.shape:
        raise ValueError(f"predictor_mse: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    w = torch.ones_like(pred) if weights is None else weights.to(pred.dtype)  # [N]
    if w.shape != pred.shape:
        raise ValueError(f"predictor_mse: weights {tuple(w.shape)} do not match pred {tuple(pred.shape)}")
    if bool((w < 0).any()):
        raise ValueError("predictor_mse: weights must be >= 0")
    sq_err = (pred - target.to(pred.dtype)).square()  # [N]
    return (w * sq_err).sum() / w.sum().clamp(min=torch.finfo(pred.dtype).tiny)


# ---------------------------------------------------------------------------------------------------
# Plain-loop references, used only by the tests.
# ---------------------------------------------------------------------------------------------------


def aggregate_reference(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    v, m = values.tolist(), mask.tolist()
    if mode == "token-mean":
        total = sum(x for row, mrow in zip(v, m, strict=True) for x, k in zip(row, mrow, strict=True) if k)
        count = sum(1 for mrow in m for k in mrow if k)
        return torch.tensor(total / count if count else 0.0, dtype=values.dtype)
    seq_means = []
    for row, mrow in zip(v, m, strict=True):
        kept = [x for x, k in zip(row, mrow, strict=True) if k]
        if kept:
            seq_means.append(sum(kept) / len(kept))
    return torch.tensor(sum(seq_means) / len(seq_means) if seq_means else 0.0, dtype=values.dtype)


def clipped_surrogate_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    mode: str,
) -> SurrogateOutput:
    """The loop form of `clipped_surrogate`; `mode` names the aggregation ("token-mean" or
    "seq-mean-token-mean")."""
    clip_low, clip_high, dual_clip = settings.clip_low, settings.clip_high, settings.dual_clip
    B, T = logp.shape
    losses = [[0.0] * T for _ in range(B)]
    flags: list[float] = []
    ratios: list[float] = []
    kls: list[float] = []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a, r = float(advantages[b, t]), math.exp(float(logp[b, t] - old_logp[b, t]))
            r_clamped = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
            tok, clipped = max(-a * r, -a * r_clamped), -a * r_clamped > -a * r
            if dual_clip is not None and a < 0 and tok > -a * dual_clip:
                tok, clipped = -a * dual_clip, True
            losses[b][t] = tok
            flags.append(float(clipped))
            ratios.append(r)
            kls.append(float(old_logp[b, t] - logp[b, t]))

    def mean(xs: list[float]) -> torch.Tensor:
        return torch.tensor(sum(xs) / len(xs) if xs else 0.0, dtype=logp.dtype)

    loss = aggregate_reference(torch.tensor(losses, dtype=logp.dtype), mask, mode)
    return SurrogateOutput(loss, mean(flags), mean(ratios), mean(kls))
