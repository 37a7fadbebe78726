"""The trained weights as one loadable MLflow artifact per run, not a copy of every checkpoint.

Lightning's `MLFlowLogger(log_model=True)` copied each iteration's checkpoint (564 MB for SmolLM2,
base weights included) into the artifact store. `ModelArtifact` instead writes, when fit ends,
`<output_dir>/final/` (and with `best=<metric>`, `<output_dir>/best/` each time that metric reaches a
new best), and logs each to the MLflow run as `model/final` and `model/best`:
- with LoRA, the adapter as peft saves it (`adapter_config.json`, `adapter_model.safetensors`, a few
  MB), loadable onto its base with `peft.PeftModel.from_pretrained(base_model, folder)`; with full
  weights, the whole model (`AutoModelForCausalLM.from_pretrained(folder)`);
- the tokenizer, the predictor head's weights (`head.safetensors`), and `trace_lightning.json`: the
  base model's folder and digest (frozen.py), and the metric when it is the best.

Example (LoRA):
    base = AutoModelForCausalLM.from_pretrained(info["base_model"])   # info: trace_lightning.json
    policy = peft.PeftModel.from_pretrained(base, "<run_dir>/model/final")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from safetensors.torch import save_file

from trace_lightning.checkpoints.plugin import AtomicCheckpointIO

INFO_FILE = "trace_lightning.json"
HEAD_FILE = "head.safetensors"


class ModelArtifact(L.Callback):
    """The final (and optionally the best) trained weights, written once and logged to MLflow.

    Args:
        output_dir: where the folders `final/` and `best/` are written (`${run_dir}/model`).
        best: a metric in `trainer.callback_metrics` (e.g. `eval/pass_at_1`, which
            `callbacks.HeldOutSuccess` publishes there) whose best value's weights to keep too; None: off.
        mode: "max" or "min": which values of `best` are better.
    """

    def __init__(self, output_dir: str, best: str | None = None, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"callbacks.model_artifact.mode={mode!r} must be 'max' or 'min'")
        self.output_dir, self.best, self.mode = Path(output_dir), best, mode
        self.best_value: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._keep_if_best(trainer, pl_module)  # an evaluation before training may already have run

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._keep_if_best(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        final = self._write(trainer, pl_module, "final", {})
        best = self.output_dir / "best"
        for folder in [final] + ([best] if final is not None and best.is_dir() else []):
            if folder is not None:
                _log(trainer, folder, f"model/{folder.name}")

    def _keep_if_best(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.best) if self.best is not None else None
        better = value is not None and (
            self.best_value is None
            or (float(value) > self.best_value if self.mode == "max" else float(value) < self.best_value)
        )
        if trainer.strategy.broadcast(better):  # every process takes part in the write's gather
            assert value is not None and self.best is not None
            self.best_value = float(value)
            self._write(trainer, pl_module, "best", {self.best: self.best_value})

    def _write(self, trainer: L.Trainer, module: Any, name: str, extra: dict[str, Any]) -> Path | None:
        """The weights as they are now into `<output_dir>/<name>/` (process 0; the others only join
        the gather an FSDP2 run needs to assemble them)."""
        module.sync_rollout_policy()  # FSDP2: the unsharded copy gets the trained weights; else nothing
        if not trainer.is_global_zero:
            return None
        folder = self.output_dir / name
        shutil.rmtree(folder, ignore_errors=True)
        policy = module.rollout_policy
        policy.save_pretrained(folder)  # peft: the adapter only; transformers: the whole model
        module.tokenizer.save_pretrained(folder)
        head = {k: v.detach().cpu().contiguous() for k, v in module.head.state_dict().items()}
        save_file(head, folder / HEAD_FILE)
        (folder / INFO_FILE).write_text(json.dumps(_info(trainer, policy) | extra, indent=1))
        return folder


def _info(trainer: L.Trainer, policy: torch.nn.Module) -> dict[str, Any]:
    io = trainer.strategy.checkpoint_io
    frozen = io.frozen if isinstance(io, AtomicCheckpointIO) else None
    return {
        "adapter": hasattr(policy, "peft_config"),
        "base_model": frozen.path if frozen is not None else None,
        "base_sha256": frozen.sha256 if frozen is not None else None,
        "head": HEAD_FILE,
        "global_step": trainer.global_step,
    }


def _log(trainer: L.Trainer, folder: Path, artifact_path: str) -> None:
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and logger.run_id is not None:
            logger.experiment.log_artifacts(logger.run_id, str(folder), artifact_path=artifact_path)
