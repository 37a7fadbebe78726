"""Losses: peer goldens (verl 0.9.1, /work/shared/DATA.md), a hand-derived PPO example, gradients,
masking edge cases, argument errors, and vectorised == plain-loop reference on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from trace_lightning.losses import (
    LossSettings,
    SeqMeanTokenMean,
    TokenMean,
    aggregate_reference,
    clipped_surrogate,
    clipped_surrogate_reference,
    kl_loss,
    kl_penalty,
    predictor_mse,
)

AGGREGATIONS = {
    "token-mean": TokenMean(),
    "seq-mean-token-mean": SeqMeanTokenMean(),
}  # by the reference's names
VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


# ------------------------------------------------------------------ aggregation


@pytest.mark.parametrize(("mode", "expected"), [("token-mean", 3.5), ("seq-mean-token-mean", 4.0)])
def test_aggregate_matches_verl(mode: str, expected: float) -> None:
    assert AGGREGATIONS[mode](VALUES, MASK).item() == pytest.approx(expected)
    assert aggregate_reference(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_skips_sequences_without_tokens() -> None:
    # The empty third row must not pull the sequence mean towards 0: still (2.5 + 5.5) / 2.
    values = torch.cat([VALUES, torch.full((1, 4), 100.0)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.long)])
    assert AGGREGATIONS["seq-mean-token-mean"](values, mask).item() == pytest.approx(4.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_aggregate_all_masked_is_zero_with_grad(mode: str) -> None:
    values = torch.randn(3, 5, requires_grad=True)
    out = AGGREGATIONS[mode](values, torch.zeros(3, 5))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(values.grad, torch.zeros(3, 5))


def test_aggregate_ignores_garbage_under_the_mask() -> None:
    values = VALUES.clone()
    values[1, 2:] = torch.tensor([math.inf, math.nan])
    assert AGGREGATIONS["token-mean"](values, MASK).item() == pytest.approx(3.5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_aggregate_matches_reference(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
        mask = torch.rand(5, 7, generator=gen) < 0.4
        torch.testing.assert_close(AGGREGATIONS[mode](values, mask), aggregate_reference(values, mask, mode))


# ------------------------------------------------------------------ KL


def test_k3_matches_verl() -> None:
    out = kl_penalty(torch.tensor([0.0, -1.0]), torch.tensor([-0.5, 0.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([0.106531, 0.718282]), atol=1e-6, rtol=0)


def test_k1_is_log_ratio() -> None:
    out = kl_penalty(torch.tensor([0.0, -1.0]), torch.tensor([-0.5, 0.0]), "k1")
    torch.testing.assert_close(out, torch.tensor([0.5, -1.0]))


def test_kl_loss_masks_and_stays_finite() -> None:
    # Token 0: k3 = 0.106531; token 1 is padding with a -inf reference: it must add nothing, not NaN.
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -math.inf]])
    loss = kl_loss(logp, ref, torch.tensor([[1, 0]]), "k3", TokenMean())
    assert loss.item() == pytest.approx(0.106531, abs=1e-6)
    loss.backward()
    # d/d logp of exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp) = 1 - exp(-0.5).
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-0.5), 0.0]]))


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"loss\.kl_kind"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k2")  # type: ignore[arg-type]


# ------------------------------------------------------------------ clipped surrogate

# Four tokens, one sequence, old_logp = 0 so ratio = exp(logp); clip 0.2 both sides.
#   t0: A = +1, ratio 1.5 -> clamped 1.2:     max(-1.5, -1.2) = -1.2  (clipped)
#   t1: A = -1, ratio 0.5 -> clamped 0.8:     max( 0.5,  0.8) =  0.8  (clipped)
#   t2: A = +1, ratio 1.1 -> inside:          max(-1.1, -1.1) = -1.1  (not clipped)
#   t3: A = -1, ratio 4.0 -> clamped 1.2:     max( 4.0,  1.2) =  4.0  (not clipped: PPO is pessimistic)
#       with dual_clip 3:                     min( 4.0, 3 * 1) =  3.0  (capped)
# token-mean: (-1.2 + 0.8 - 1.1 + 4.0) / 4 = 0.625;  with dual clip (-1.2 + 0.8 - 1.1 + 3.0) / 4 = 0.375.
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 4.0]])
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0]])


@pytest.mark.parametrize(("dual_clip", "loss", "clip_frac"), [(None, 0.625, 0.5), (3.0, 0.375, 0.75)])
def test_clipped_surrogate_hand_example(dual_clip: float | None, loss: float, clip_frac: float) -> None:
    logp = RATIOS.log().requires_grad_()
    out = clipped_surrogate(
        logp, torch.zeros(1, 4), ADV, torch.ones(1, 4), LossSettings(0.2, 0.2, dual_clip), TokenMean()
    )
    assert out.loss.item() == pytest.approx(loss)
    assert out.clip_frac.item() == pytest.approx(clip_frac)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 0.5 + 1.1 + 4.0) / 4)
    # approx_kl = mean(old - logp) = -log(1.5 * 0.5 * 1.1 * 4) / 4 = -log(3.3) / 4
    assert out.approx_kl.item() == pytest.approx(-math.log(3.3) / 4)
    assert not (out.clip_frac.requires_grad or out.ratio_mean.requires_grad or out.approx_kl.requires_grad)
    out.loss.backward()
    # Only unclipped tokens carry gradient: d(-A * ratio) / d logp / 4 = -A * ratio / 4.
    expected = torch.tensor([[0.0, 0.0, -1.1 / 4, 0.0 if dual_clip else 4.0 / 4]])
    torch.testing.assert_close(logp.grad, expected)


def test_clip_higher_widens_the_upper_bound() -> None:
    # DAPO clip-higher: with clip_high 0.28, A = +1 at ratio 1.25 is inside the trust region.
    logp = torch.tensor([[math.log(1.25)]])
    out = clipped_surrogate(
        logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), LossSettings(clip_high=0.28), TokenMean()
    )
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.clip_frac.item() == 0.0


def test_clipped_surrogate_all_masked_is_zero() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    out = clipped_surrogate(
        logp, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), LossSettings(), TokenMean()
    )
    assert [out.loss.item(), out.clip_frac.item(), out.ratio_mean.item(), out.approx_kl.item()] == [0.0] * 4
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_clipped_surrogate_grad_finite_with_padding_garbage() -> None:
    # Padding carries -inf log-probs and NaN advantages; the real token must still get a clean gradient.
    logp = torch.tensor([[-0.1, -math.inf]], requires_grad=True)
    old = torch.tensor([[-0.1, -math.inf]])
    out = clipped_surrogate(
        logp, old, torch.tensor([[2.0, math.nan]]), torch.tensor([[1, 0]]), LossSettings(), TokenMean()
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"clip_low": 1.0}, "loss.clip_low"),
        ({"clip_low": -0.1}, "loss.clip_low"),
        ({"clip_high": -0.1}, "loss.clip_high"),
        ({"dual_clip": 1.0}, "loss.dual_clip"),
        ({"kl_coef": -0.1}, "loss.kl_coef"),
        ({"kl_kind": "k2"}, "loss.kl_kind"),
    ],
)
def test_loss_settings_reject_bad_values_when_made(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        LossSettings(**kwargs)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_clipped_surrogate_matches_reference(dual_clip: float | None, aggregation: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
        logp = old + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.8  # ratios ~ e^{+-0.8}
        adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        mask = torch.rand(4, 6, generator=gen) < 0.7
        args = (logp, old, adv, mask, LossSettings(0.2, 0.28, dual_clip))
        out = clipped_surrogate(*args, AGGREGATIONS[aggregation])
        ref = clipped_surrogate_reference(*args, aggregation)
        for field in ("loss", "clip_frac", "ratio_mean", "approx_kl"):
            torch.testing.assert_close(getattr(out, field), getattr(ref, field), msg=field)


# ------------------------------------------------------------------ predictor


def test_predictor_mse_weighted() -> None:
    # (3 * (0 - 1)^2 + 1 * (1 - 1)^2) / (3 + 1) = 0.75; unweighted it is the plain mean 0.5.
    pred, target = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])
    assert predictor_mse(pred, target, torch.tensor([3, 1])).item() == pytest.approx(0.75)
    assert predictor_mse(pred, target).item() == pytest.approx(0.5)
    # Only the proportions of the weights matter.
    assert predictor_mse(pred, target, torch.tensor([30.0, 10.0])).item() == pytest.approx(0.75)


def test_predictor_mse_empty_is_zero() -> None:
    pred = torch.zeros(0, requires_grad=True)
    loss = predictor_mse(pred, torch.zeros(0), torch.zeros(0))
    assert loss.item() == 0.0
    loss.backward()


def test_predictor_mse_bad_args() -> None:
    with pytest.raises(ValueError, match="differ"):
        predictor_mse(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="weights"):
        predictor_mse(torch.zeros(2), torch.zeros(2), torch.ones(3))
    with pytest.raises(ValueError, match=">= 0"):
        predictor_mse(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -1.0]))
