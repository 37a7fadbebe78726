"""TraceModule: the policy (full weights or LoRA adapters) and the success predictor head.

`training_step` takes one `RolloutBatch` micro-batch and returns
    clipped surrogate (+ kl_coef * KL to the reference) + predictor_coef * predictor MSE.
With LoRA the reference policy is the base model with the adapters disabled; with full weights it is
a frozen copy, made only when kl_coef > 0. Gradient accumulation and precision come from the Trainer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from trace_lightning.batching import RolloutBatch
from trace_lightning.engines.base import SamplingParams, require_sampling
from trace_lightning.losses import (
    Aggregation,
    LossSettings,
    TokenMean,
    clipped_surrogate,
    kl_loss,
    predictor_mse,
)
from trace_lightning.models import Policy
from trace_lightning.packing import trained_logprobs, tree_mask_works
from trace_lightning.predictor import PredictorSettings, PrefixScorer, SuccessHead, gather_positions
from trace_lightning.sharding import (
    RolloutCopy,
    all_finite,
    average_grads,
    clip_grad_norm,
    shard_policy,
    trainable_sum,
)

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class NonFiniteTrainingError(RuntimeError):
    """Training stopped: too many optimizer steps in a row were non-finite (see module.max_skipped_steps)."""


@dataclass(frozen=True)
class ModuleSettings:
    """The `module` config group: the training step's guard against broken runs."""

    max_skipped_steps: int | None = 8  # stop after this many NaN/inf-skipped steps in a row (None: never)
    # A step whose policy gradient is exactly zero (every advantage in it 0: all its groups agreed) leaves
    # the policy's weights and Adam moments alone. Without this, AdamW's momentum keeps moving the
    # weights for several steps on no evidence at all, at the full learning rate.
    hold_on_zero_gradient: bool = True

    def __post_init__(self) -> None:
        if self.max_skipped_steps is not None and self.max_skipped_steps < 1:
            raise ValueError(
                f"module.max_skipped_steps={self.max_skipped_steps} must be >= 1 (or null: never stop)"
            )


class TraceModule(L.LightningModule):
    """The policy and the predictor head, built outside (`models.build_policy`, `PredictorSettings.
    build_head`) and handed in, so the module only trains: `TraceModule(policy, optimizer, ...)`.

    `sampling` is the one SamplingParams object the rollouts are drawn with: the module scores tokens at
    its temperature, so the importance ratio compares against the policy that sampled them. `companion`
    is an optional frozen LM the head reads instead of the policy (it must share the tokenizer).
    """

    def __init__(
        self,
        policy: Policy,
        optimizer: OptimizerFactory,
        scheduler: Callable[..., Any] | None = None,
        *,
        sampling: SamplingParams = SamplingParams(),
        loss: LossSettings = LossSettings(),
        aggregation: Aggregation = TokenMean(),
        predictor: PredictorSettings = PredictorSettings(),
        settings: ModuleSettings = ModuleSettings(),
        head: SuccessHead | None = None,
        companion: Policy | None = None,
    ) -> None:
        super().__init__()
        require_sampling(sampling)  # log-probs at temperature 0 are undefined: greedy is for evaluation
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.sampling, self.loss_settings, self.predictor_settings = sampling, loss, predictor
        self.aggregation = aggregation
        self.settings = settings
        self.policy, self.tokenizer = policy.model.train(), policy.tokenizer
        # from_pretrained returns eval mode; Lightning keeps submodules' modes, and we train (dropout 0)
        self.reference = None
        if loss.kl_coef > 0 and not _has_adapters(self.policy):  # full weights need a frozen reference
            self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.companion = None if companion is None else self._companion(companion)
        backbone = self.companion if self.companion is not None else self.policy
        self.head = head if head is not None else predictor.build_head(backbone.config.hidden_size)
        # what the collector scores prefixes with: the head on the companion's or the rollout policy's states
        self.scorer = PrefixScorer(
            lambda: self.companion if self.companion is not None else self.rollout_policy,
            self.tokenizer,
            self.head,
            predictor.pooling,
            predictor.posterior_features,
            predictor.text_buckets,
            predictor.policy_features,
        )
        self._loss_skipped, self._skipped_in_a_row = False, 0  # see on_before_optimizer_step
        self._tree_mask_ok: dict[int, bool] = {}  # id(model) -> it takes packed batches (packing.py)
        self._rollout: RolloutCopy | None = None  # the unsharded copy under FSDP2 (rollout_policy)
        self._sharded = False  # configure_model has sharded the policy

    def configure_model(self) -> None:
        """Under trainer=fsdp2 (Lightning's ModelParallelStrategy gives a device mesh): shard the policy's
        decoder layers and keep an unsharded copy for rollouts (sharding.py). Otherwise nothing."""
        if self.device_mesh is None or self._sharded:  # Lightning may call it again
            return
        shard_policy(self.policy, self.device_mesh["data_parallel"], self.rollout_policy)
        self._sharded = True

    @property
    def rollout_policy(self) -> torch.nn.Module:
        """What the engine samples with and the predictor scores with: the policy, or under FSDP2 its
        unsharded copy, made on first use (the DataModule's setup starts the engine before
        configure_model runs, but after the strategy has set the device mesh)."""
        if self.device_mesh is not None and self._rollout is None and not self._sharded:
            self._rollout = RolloutCopy.of(self.policy)
        return self.policy if self._rollout is None else self._rollout.module

    def sync_rollout_policy(self) -> None:
        """Refresh the FSDP2 rollout copy from the gathered weights (a collective); else nothing to do."""
        if self._rollout is not None:
            self._rollout.refresh(self.policy, self.device)

    def _companion(self, companion: Policy) -> torch.nn.Module:
        if companion.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"predictor.backbone={self.predictor_settings.backbone!r} has another tokenizer than the "
                "policy; use one that shares it"
            )
        return companion.model.requires_grad_(False).eval()

    def _predictor_hidden(
        self, ids: torch.Tensor, mask: torch.Tensor, policy_hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Last hidden states the head reads [B, T, H]: the policy's, or the companion's."""
        if self.companion is None and policy_hidden is not None:
            return policy_hidden
        model = self.companion if self.companion is not None else self.rollout_policy
        with torch.no_grad():
            # logits_to_keep=1: the head reads hidden states only; full-vocabulary logits would be wasted
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
            return out.hidden_states[-1]

    # ------------------------------------------------------------------ forward passes

    def _batch_forward(
        self, model: torch.nn.Module, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs aligned with batch.input_ids [B, T] and last hidden states [B, T, H].

        A packed batch runs its packed rows (each shared token once) when the model takes the tree mask,
        and maps both back to the per-leaf layout; its log-probs are then computed on the trained tokens
        only (loss_mask), 0 elsewhere. Otherwise the per-leaf rows run (0 at t = 0).

        Log-probs are taken at the sampling temperature: the tokens were drawn from softmax(logits / T),
        so that is the behaviour policy the importance ratio must compare against (and what the engine
        reports, which makes engine/trainer agreement a like-for-like check).
        """
        if batch.packed is None or not self._takes_tree_mask(model):
            return self._forward(model, batch.input_ids, batch.attention_mask)
        return trained_logprobs(model, batch.packed, batch.loss_mask.bool(), self.sampling.temperature)

    def _forward(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain forward over right-padded leaf sequences [B, T]: log-probs [B, T], hidden [B, T, H]."""
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        logits = out.logits[:, :-1].float() / self.sampling.temperature
        logp = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
        tok = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        return torch.nn.functional.pad(tok, (1, 0)), out.hidden_states[-1]

    def _takes_tree_mask(self, model: torch.nn.Module) -> bool:
        """Checked once per model (policy, reference), and logged once where it fails."""
        if id(model) not in self._tree_mask_ok:
            # Under FSDP2 the probe runs on the unsharded copy (same architecture): a sharded forward is a
            # collective, and a process whose first micro-batch is an idle one would not join it.
            probe = self.rollout_policy if model is self.policy else model
            self._tree_mask_ok[id(model)] = tree_mask_works(probe)
        return self._tree_mask_ok[id(model)]

    @torch.no_grad()
    def fill_old_logprobs(self, batch: RolloutBatch) -> None:
        """pi_old: the same forward the first training step will run, so its ratio is exactly 1."""
        device_batch = self.transfer_batch_to_device(batch, self.device, 0)
        batch.old_logprobs = self._batch_forward(self.policy, device_batch)[0].cpu()

    def weights_fingerprint(self) -> float:
        """Sum of the policy's trainable weights (over FSDP2 shards too: a collective): cheap evidence of
        which weights sampled a batch, and whether the engine must sync."""
        return trainable_sum(self.policy)

    # ------------------------------------------------------------------ training

    def training_step(self, batch: RolloutBatch | None, batch_idx: int) -> torch.Tensor | None:
        if (
            batch is None
        ):  # the already-trained epoch of a resumed run (see RolloutDataModule.train_dataloader)
            return None
        hp, pred_cfg = self.loss_settings, self.predictor_settings
        logp, hidden = self._batch_forward(self.policy, batch)
        pg = clipped_surrogate(
            logp, batch.old_logprobs, batch.advantages, batch.loss_mask, hp, self.aggregation
        )
        loss = pg.loss
        metrics = {
            "train/policy_loss": pg.loss.detach(),
            "train/clip_frac": pg.clip_frac,
            "train/ratio_mean": pg.ratio_mean,
            "train/approx_kl": pg.approx_kl,
        }
        if hp.kl_coef > 0:
            ref = self._reference_logprobs(batch)
            kl = kl_loss(logp, ref, batch.loss_mask, hp.kl_kind, self.aggregation)
            loss = loss + hp.kl_coef * kl
            metrics["train/kl"] = kl.detach()
        if batch.pred_targets.numel() and pred_cfg.coef > 0:
            hidden = self._predictor_hidden(batch.input_ids, batch.attention_mask, hidden)
            pred = torch.sigmoid(self.head(gather_positions(hidden, batch.pred_rows, batch.pred_cols)))
            weights = batch.pred_weights if pred_cfg.weighting == "leaves" else None
            pred_loss = predictor_mse(pred, batch.pred_targets, weights)
            loss = loss + pred_cfg.coef * pred_loss
            metrics["train/predictor_mse"] = pred_loss.detach()
        else:  # DDP reduces every parameter's gradient each step: the head's must exist, at zero
            loss = loss + 0.0 * sum(p.sum() for p in self.head.parameters())
        metrics["train/loss"] = loss.detach()
        # A NaN or inf loss would reach AdamW's moment estimates and spoil every later step, so the
        # batch is dropped instead. Returning None makes Lightning skip this backward; with
        # accumulate_grad_batches=1 its zero_grad has left every grad None, so the optimizer step that
        # still runs changes no weight (with accumulation, the window's other micro-batches still count).
        finite = torch.isfinite(loss)
        metrics["train/skipped_nonfinite"] = (~finite).float()
        self._loss_skipped = self._loss_skipped or not bool(finite)
        self.log_dict(metrics, batch_size=batch.input_ids.shape[0])
        return loss if bool(finite) else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop a step whose gradients hold NaN or inf (a finite loss can still overflow in backward).

        Every grad is set to None rather than zero: AdamW skips parameters without a grad, so neither
        the weights, nor their moments, nor weight decay move. Runs before gradient clipping.
        """
        if self._rollout is not None:  # FSDP2 reduces the sharded policy's gradients, not the head's
            average_grads(list(self.head.parameters()))
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self._rollout is not None:
            finite = all_finite(grads, self.device)
        else:
            finite = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        self.log("train/skipped_nonfinite_grad", float(not finite))
        if not finite:
            optimizer.zero_grad(set_to_none=True)
        elif self.settings.hold_on_zero_gradient and self._rollout is None:
            held = self._hold_if_zero()
            self.log("train/held_zero_gradient", float(held))
        self._count_skipped(not finite or (self._loss_skipped and not grads))

    def _hold_if_zero(self) -> bool:
        """Drop the policy's gradients when all are exactly zero (AdamW then skips those parameters: no
        momentum step); True when it did. The head keeps its own. Gradients are already all-reduced
        under DDP, so every process decides alike; under FSDP2 (sharded) the check is not made."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if not grads or any(bool(g.any()) for g in grads):
            return False
        for p in self.policy.parameters():
            p.grad = None
        return True

    def _count_skipped(self, skipped: bool) -> None:
        """One skipped step is a bad batch; many in a row mean training has broken, so stop and say why."""
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        self._loss_skipped = False
        limit = self.settings.max_skipped_steps
        if limit is not None and self._skipped_in_a_row >= limit:
            raise NonFiniteTrainingError(
                f"{self._skipped_in_a_row} optimizer steps in a row were skipped for NaN/inf loss or "
                "gradients. Likely causes: a learning rate too high (optimizer.lr), a corrupt checkpoint "
                "resumed from (ckpt_path), or fp16 overflow (trainer.precision: use bf16-mixed or 32-true). "
                f"The limit is module.max_skipped_steps={limit}."
            )

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, except under FSDP2: torch's clip_grad_norm_ cannot mix the sharded
        policy's gradients with the replicated head's, so the norm is taken in sharding.clip_grad_norm."""
        if self._rollout is None or not gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient clipping by {gradient_clip_algorithm!r}: trainer=fsdp2 clips by norm only "
                "(trainer.gradient_clip_val); leave the Trainer's gradient_clip_algorithm at norm"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm(params, float(gradient_clip_val), self.device)

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        if self.reference is not None:
            return self._batch_forward(self.reference, batch)[0]
        with self.policy.disable_adapter():  # LoRA: the base model is the reference
            return self._batch_forward(self.policy, batch)[0]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Remember the MLflow run, so that resuming from this checkpoint continues the same run."""
        run_id = getattr(self.logger, "run_id", None)
        if run_id is not None:
            checkpoint["mlflow_run_id"] = run_id

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, RolloutBatch):  # tensors, and the packed rows (or None) as a whole
            return RolloutBatch(**{k: v if v is None else v.to(device) for k, v in vars(batch).items()})
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def configure_optimizers(self) -> Any:
        policy_params = [p for p in self.policy.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": policy_params}]
        if self.predictor_settings.coef > 0:  # else the head trains only in its own refit (data.py)
            groups.append({"params": list(self.head.parameters()), "lr": self.predictor_settings.lr})
        optimizer = self.optimizer_factory(groups)
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"},
        }


def _has_adapters(model: torch.nn.Module) -> bool:
    """A peft-wrapped model: its reference policy is the base with the adapters disabled."""
    return hasattr(model, "disable_adapter")
