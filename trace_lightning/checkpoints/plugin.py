"""`AtomicCheckpointIO`: how the trainer writes, removes and loads checkpoint files (a Lightning plugin).

Save: plain state (no numpy), torch.save to `.<file>.tmp-<pid>` in the same folder (a rename across
filesystems would be a copy that a crash can leave half-written), fsync, a check that the loader
would accept it, rename; then the digest, the manifest entry, and pruning to `keep_last`.
Load: `validate.validate_checkpoint` (one read into memory; digest, scan and load from those bytes),
whatever `weights_only` Lightning asks for; the state checked at build is reused if the file is unchanged.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from trace_lightning.checkpoints.files import (
    Manifest,
    clean_stale_temps,
    digest_path,
    sha256_file,
    temp_path,
    write_atomic,
)
from trace_lightning.checkpoints.frozen import BASE_KEY, FrozenWeights
from trace_lightning.checkpoints.scan import CheckpointError, refused_global
from trace_lightning.checkpoints.shards import validate_folder, write_digests
from trace_lightning.checkpoints.validate import validate_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Save: torch.save to `.<file>.tmp-<pid>`, fsync, rename; then digest, manifest, pruning.
    Load: `validate_checkpoint`, whatever `weights_only` Lightning asks for.

    Args:
        run: the id of the run that owns the checkpoint folder (kept across resumes).
        fingerprint: this run's config fingerprint, stored in every checkpoint.
        keep_last: how many of the run's newest checkpoints to keep (None: all).
        frozen: the weights this run never trains (LoRA's base), left out of its checkpoints.
    """

    def __init__(
        self,
        run: str | None = None,
        fingerprint: dict[str, str] | None = None,
        keep_last: int | None = None,
        frozen: FrozenWeights | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"checkpoints.keep_last={keep_last} must be >= 1 (or null to keep all)")
        self.run, self.fingerprint, self.keep_last = run or uuid.uuid4().hex, fingerprint, keep_last
        self.frozen = frozen  # weights left out of every checkpoint, named by digest (frozen.py)
        self.resume_from: str | None = None  # the checkpoint this run starts from (set by trainer.build)
        self._validated: tuple[tuple[str, tuple[int, int, int]], dict[str, Any]] | None = None

    def remember(self, path: str | Path, ckpt: dict[str, Any]) -> str:
        """Keep a checkpoint `validate_checkpoint` returned, so loading the unchanged file reuses it."""
        self._validated = ((str(path), _stamp(path)), ckpt)
        return str(path)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(path.parent)
        checkpoint = self.stamp(checkpoint)
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            _refuse_unloadable(tmp, path)
            digest = sha256_file(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        # a crash here leaves a file without a matching digest: refused, and `last` takes the one before
        write_atomic(digest_path(path), f"{digest}\n".encode())
        self._record(path)

    def stamp(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The state as saved: plain values, this run's id and config fingerprint, and without the frozen
        weights (then named by path and digest) when the run has some."""
        stamp = {**checkpoint.get("trace_run", {}), "run": self.run, "fingerprint": self.fingerprint}
        state = plain_state(checkpoint)
        if self.frozen is not None and "state_dict" in state:
            state["state_dict"] = self.frozen.trained_only(state["state_dict"])
            stamp[BASE_KEY] = self.frozen.stamp()
        return {**state, "trace_run": stamp}

    def publish_folder(self, staging: Path, path: Path) -> None:
        """A sharded checkpoint written to `staging` (sharding.FSDP2Strategy): checked as the loader
        would check it, renamed to `path`, its files' digests written beside it, listed and pruned."""
        validate_folder(staging, check_digests=False, check_finite=False)
        listing = write_digests(staging)
        _unlink_with_digest(path)  # a rewritten iteration replaces its folder
        os.replace(staging, path)
        write_atomic(digest_path(path), listing)
        self._record(path)

    def _record(self, path: Path) -> None:
        manifest = Manifest.read(path.parent)
        if manifest is None or manifest.run != self.run:
            manifest = Manifest(self.run)
        manifest.add(path.name)
        pruned = manifest.files[: -self.keep_last] if self.keep_last else []
        manifest.files = [f for f in manifest.files if f not in pruned]
        manifest.write(path.parent)  # first, so that a crash below leaves files unlisted, never listed-gone
        for name in pruned:
            _unlink_with_digest(path.parent / name)

    def remove_checkpoint(self, path: Any) -> None:
        path = Path(path)
        manifest = Manifest.read(path.parent)
        if manifest is not None and path.name in manifest.files:
            manifest.files.remove(path.name)
            manifest.write(path.parent)
        _unlink_with_digest(path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if self._validated is not None and self._validated[0] == (str(path), _stamp(path)):
            return self._validated[1]
        return validate_checkpoint(path)


def _stamp(path: str | Path) -> tuple[int, int, int]:
    """Inode, size and mtime: a file replaced or rewritten since it was validated has another stamp."""
    st = Path(path).stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _refuse_unloadable(tmp: Path, path: Path) -> None:
    """A checkpoint the loader would refuse is an error now, at save, not at the resume that needs it."""
    refused = refused_global(tmp)
    if refused is not None:
        raise CheckpointError(
            "unsafe_pickle",
            f"cannot save {path}: the checkpoint holds a {refused!r}, which the loader refuses. State put "
            "in a checkpoint (state_dict() of the module, DataModule or callbacks) must be dicts, lists, "
            "str, int, float, bool, None or tensors (numpy values are converted by plain_state)",
        )


def _unlink_with_digest(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # a sharded checkpoint
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    digest_path(path).unlink(missing_ok=True)


def plain_state(obj: Any) -> Any:
    """numpy values as plain Python (exact: int64 and float64 are Python's int and float), dict and
    tuple subclasses as dict and tuple, so the file needs no global beyond ALLOWED_GLOBALS; tensors kept."""
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, OrderedDict):  # allow-listed: a module's state_dict
        return OrderedDict((k, plain_state(v)) for k, v in obj.items())
    if isinstance(obj, dict):  # other dict subclasses would need their class allow-listed
        return {k: plain_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain_state(v) for v in obj]
    if isinstance(obj, tuple):  # a named tuple would import its class
        return tuple(plain_state(v) for v in obj)
    return obj
