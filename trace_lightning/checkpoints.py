"""Checkpoints that a long RL run can trust: found, validated, and saved on SIGTERM.

`AtomicCheckpointIO` writes each checkpoint to a temporary file in the same directory and renames it
into place (Lightning's own fsspec transaction stages in the system temp dir, and a move across
filesystems is a copy that a crash can leave half-written). `validate_checkpoint` tells a truncated
or corrupt file from a good one with an error that names the file, and `newest_valid_checkpoint`
skips such files for `ckpt_path=last`.

Resume is exact from an iteration boundary: the checkpoint written at the end of an epoch holds the
weights, optimizer, scheduler, callbacks and the DataModule state (allocation RNG, the torch RNG the
engine samples with, iteration counter, cold-start prior), so the next iteration is the one an
uninterrupted run would have sampled. A SIGTERM checkpoint is taken at a batch boundary inside an
iteration; resuming from it drops the rest of that iteration's batches (see
`RolloutDataModule.train_dataloader`) and continues with the next iteration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

REQUIRED_KEYS = ("state_dict", "epoch", "global_step")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


def validate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint on the CPU, or raise `CheckpointError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass ckpt_path=<a .ckpt file> or ckpt_path=last"
        )
    try:
        # mmap: tensors stay on disk, so validating a multi-GB checkpoint costs an index read, not a copy
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # truncated zip, bad pickle, wrong format: all mean the same to the user
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {err}); "
            "delete it or resume from another file (ckpt_path=last skips corrupt ones)"
        ) from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a Lightning checkpoint (missing {missing})")
    return ckpt


def newest_valid_checkpoint(directory: str | Path) -> Path | None:
    """The most recently written checkpoint in `directory` that loads, or None if there is none."""
    candidates = sorted(Path(directory).glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            validate_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


class SaveOnSigterm(L.Callback):
    """On SIGTERM Lightning stops at the next batch boundary with a SIGTERMException; save first."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, SIGTERMException):
            self.dirpath.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.dirpath / "sigterm.ckpt")


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to `<file>.tmp` beside the target, fsync, then os.replace: all or nothing."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
