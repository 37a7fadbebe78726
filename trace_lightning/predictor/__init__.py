"""The success predictor Ṽ_ψ (our architecture choice, docs/algorithm.md#the-success-predictor), in one
place: its settings (here), the head (`head.py`), what it reads at a prefix (`features.py`) and its
online refit (`refit.py`).

The head reads the hidden state at the last token of a prefix, so one forward pass over a rollout
scores every turn prefix on it at once (attention is causal: the state at the end of turn t has seen
exactly H_t). Its input is detached: the predictor is used only for allocation and never sends a
gradient into the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from trace_lightning.predictor.calibration import PlattCalibration
from trace_lightning.predictor.features import PrefixScorer
from trace_lightning.predictor.head import FeatureScaler, SuccessHead, gather_positions
from trace_lightning.predictor.refit import PredictorFit, ReplayEntry, replay_entry

__all__ = [
    "FeatureScaler",
    "PredictorFit",
    "PredictorSettings",
    "PrefixScorer",
    "ReplayEntry",
    "SuccessHead",
    "gather_positions",
    "replay_entry",
]

POOLINGS = ("last", "last_mean")
WEIGHTINGS = ("leaves", "uniform")
POSTERIOR_FEATURES = 2  # the prompt's decayed posterior mean and log(1 + decayed visits), see data.py


@dataclass(frozen=True)
class PredictorSettings:
    """The `predictor` config group, checked when made (at start-up, before any model is loaded).

    width: hidden units of the head (0: a linear head). lr: its learning rate (joint loss and refit).
    coef: weight of the predictor MSE in the policy's loss (0: the head trains only in the refit).
    weighting: "leaves" weighs a prefix's target by its leaf count, "uniform" equally.
    backbone: a frozen companion LM folder the head reads instead of the policy (same tokenizer).
    standardize: a FeatureScaler (across prompts) instead of LayerNorm in front of the head.
    pooling: "last" (the prefix's last hidden state) or "last_mean" (also the mean over the prefix).
    posterior_features: append the prompt's decayed Beta mean and log(1 + visits) (refit only).
    text_buckets: also read hashed uni- and bigrams of the prefix's tokens, in this many columns (0: off);
      text does not drift with the policy. policy_features: read the policy's states (false:
      text only).
    label_decay: a replay target's weight is multiplied by this once per iteration of age (1: no decay).
    calibrate: Platt-scale the head's root predictions on the bare outcomes of the last
      calibration_window iterations' roots, predicted before they were seen (`calibration.py`).
    refit_steps / replay_window / refit_batch: the head-only refit after each iteration (0 steps: off).

    The defaults are the text-feature predictor (docs/algorithm.md#the-success-predictor): the head reads the
    prompt's and the prefix's text and the prompt's own record, not the policy's states, with
    labels fading by age and calibrated roots. On the learning testbed the policy-state head (now
    `policy_features=true text_buckets=0 posterior_features=false calibrate=false label_decay=1
    width=256`) lost its skill online: Spearman 0.36 with the probed success rates against 0.67 for the
    text head (BENCHMARKS.md "The predictor online").
    """

    width: int = 64
    lr: float = 3e-3
    coef: float = 0.0
    weighting: str = "leaves"
    backbone: str | None = None
    standardize: bool = True
    pooling: str = "last_mean"
    posterior_features: bool = True
    text_buckets: int = 1024
    policy_features: bool = False
    label_decay: float = 0.8
    calibrate: bool = True
    calibration_window: int = 8
    refit_steps: int = 50
    replay_window: int = 16
    refit_batch: int = 256

    def __post_init__(self) -> None:
        if self.width < 0 or self.lr <= 0 or self.coef < 0:
            raise ValueError(
                f"predictor.width={self.width} (>= 0), predictor.lr={self.lr} (> 0) and "
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
        if self.text_buckets < 0 or (not self.policy_features and self.text_buckets == 0):
            raise ValueError(
                f"predictor.text_buckets={self.text_buckets} must be >= 0, and > 0 when "
                "predictor.policy_features=false (the head needs something to read)"
            )
        if (self.text_buckets or not self.policy_features) and self.coef > 0:
            raise ValueError(
                "predictor.text_buckets and predictor.policy_features=false are read only by the refit; "
                "set predictor.coef=0 (train the head by predictor.refit_steps)"
            )
        if self.calibrate and self.refit_steps == 0:
            raise ValueError(
                "predictor.calibrate=true calibrates the refitted head: set predictor.refit_steps > 0"
            )
        self.refit(seed=0)  # its ranges are checked now too

    @classmethod
    def policy_state(cls, **overrides: object) -> PredictorSettings:
        """The head on the policy's own states alone (the earlier design, which the joint loss
        `coef > 0` needs): no text, no prompt statistics, no calibration, no label decay."""
        old = {
            "policy_features": True,
            "text_buckets": 0,
            "posterior_features": False,
            "calibrate": False,
            "label_decay": 1.0,
        }
        return cls(**(old | overrides))  # type: ignore[arg-type]

    def input_size(self, hidden_size: int) -> int:
        """Columns of policy states the scorer reads for a backbone of `hidden_size` (no extras)."""
        if not self.policy_features:
            return 0
        return hidden_size * (2 if self.pooling == "last_mean" else 1)

    def build_head(self, hidden_size: int) -> SuccessHead:
        """The head for a backbone of `hidden_size`, with the prompt statistics and text when configured."""
        extra = POSTERIOR_FEATURES if self.posterior_features else 0
        policy = self.input_size(hidden_size)
        return SuccessHead(policy, self.width, extra, self.standardize, self.text_buckets)

    def refit(self, seed: int) -> PredictorFit | None:
        """The head-only refit these settings ask for (None when refit_steps is 0)."""
        fit = PredictorFit(
            self.refit_steps,
            self.replay_window,
            self.refit_batch,
            self.lr,
            seed,
            label_decay=self.label_decay,
            calibration=PlattCalibration(self.calibration_window) if self.calibrate else None,
        )
        return fit if self.refit_steps > 0 else None
