"""Checkpoints that a long RL run can trust: they cannot run code, and a damaged one is named, not used.

Loading never unpickles an arbitrary object. Before `torch.load(weights_only=True)` runs, the pickle
inside the checkpoint's zip is read opcode by opcode (nothing executes) and every global it imports
must be in `ALLOWED_GLOBALS`: an ordered dict, a tensor and its storage. That is all a Lightning
checkpoint of this project holds; the rest is dicts, lists, str, int (numpy's RNG state is big ints),
float, bool and None. So a pickle that model-written code planted in `checkpoints/` is refused before
it could run, whatever torch's own allow-list has been widened to by other libraries.

What else is checked before use (`validate_checkpoint`), each failure a `CheckpointError` whose
`reason` and message name the problem: the SHA-256 digest written beside the file, the Lightning
keys, and that no weight or optimizer tensor is NaN or inf. `check_resumable` then compares the
config fingerprint (model, adapter, allocator, env, predictor) and the weight shapes with this run's.

`AtomicCheckpointIO` writes each checkpoint to a temporary file in the same directory, renames it into
place, writes its digest, lists it in the folder's manifest (`checkpoint_files.Manifest`) and prunes
all but the newest `keep_last`. `newest_valid_checkpoint` (`ckpt_path=last`) considers only files in
the manifest, so another run's file in the folder is never chosen.

Resume is exact from an iteration boundary: the checkpoint written at the end of an epoch holds the
weights, optimizer, scheduler, callbacks and the DataModule state (allocation RNG, the torch RNG the
engine samples with, iteration counter, cold-start prior), so the next iteration is the one an
uninterrupted run would have sampled. A SIGTERM checkpoint is taken at a batch boundary inside an
iteration; resuming from it drops the rest of that iteration's batches (see
`RolloutDataModule.train_dataloader`) and continues with the next iteration.
"""

from __future__ import annotations

import os
import pickletools
import uuid
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trace_lightning.checkpoint_files import (
    Manifest,
    clean_stale_temps,
    digest_path,
    sha256_file,
    temp_path,
    write_atomic,
)

REQUIRED_KEYS = ("state_dict", "epoch", "global_step")
_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
ALLOWED_GLOBALS = frozenset(
    {
        "collections OrderedDict",  # a module's state_dict
        "torch._utils _rebuild_tensor_v2",
        "torch._utils _rebuild_parameter",
        *(f"torch {t}Storage" for t in _STORAGES),
    }
)
# Opcodes that import or build objects without naming them in a GLOBAL: torch.save never writes them.
_REFUSED_OPCODES = frozenset({"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"})
ALLOW_CHANGE_KEY = "checkpoints.allow_config_change"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; `reason` is a short name, the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def validate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint on the CPU after every check above, or raise `CheckpointError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            "missing", f"checkpoint {path} does not exist; pass ckpt_path=<a .ckpt file> or ckpt_path=last"
        )
    _check_digest(path)
    _check_pickle(path)
    try:
        # mmap: tensors stay on disk, so loading a multi-GB checkpoint costs an index read, not a copy
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated zip, bad pickle, wrong format: all mean the same to the user
        raise CheckpointError(
            "corrupt",
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {err}); "
            "delete it or resume from another file (ckpt_path=last skips corrupt ones)",
        ) from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(
            "not_lightning", f"checkpoint {path} is not a Lightning checkpoint (missing {missing})"
        )
    _check_finite(path, ckpt)
    return ckpt


def _check_digest(path: Path) -> None:
    digest = digest_path(path.resolve())
    if not digest.is_file():
        raise CheckpointError(
            "no_digest",
            f"checkpoint {path} has no digest {digest.name} beside it, so it was not written by this "
            "trainer (or its save was cut short); resume from another file (ckpt_path=last)",
        )
    if digest.read_text().strip() != sha256_file(path):
        raise CheckpointError(
            "digest_mismatch",
            f"checkpoint {path} does not match its SHA-256 digest {digest.name}: its bytes changed after "
            "it was written (disk corruption or tampering); resume from another file (ckpt_path=last)",
        )


def _check_pickle(path: Path) -> None:
    """Refuse any global outside ALLOWED_GLOBALS; pickletools only parses, it never executes."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith(".pkl")]
            if len(pickles) != 1 or not pickles[0].endswith("/data.pkl"):
                raise CheckpointError(
                    "unsafe_pickle", f"checkpoint {path} is not a torch.save archive (pickles: {pickles})"
                )
            ops = list(pickletools.genops(archive.read(pickles[0])))
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
        raise CheckpointError(
            "corrupt", f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {err})"
        ) from err
    for op, arg, _ in ops:
        if op.name in _REFUSED_OPCODES or (op.name == "GLOBAL" and arg not in ALLOWED_GLOBALS):
            raise CheckpointError(
                "unsafe_pickle",
                f"checkpoint {path} refused: its pickle imports {arg or op.name!r}, which no checkpoint "
                "of this trainer holds (it may be a planted file that would run code); delete it",
            )


def _check_finite(path: Path, ckpt: dict[str, Any]) -> None:
    """NaN weights or Adam moments would make every later step non-finite (and skipped)."""
    parts = {"state_dict": ckpt["state_dict"], "optimizer_states": ckpt.get("optimizer_states", [])}
    for name, tensor in _tensors(parts):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                "non_finite",
                f"checkpoint {path} holds NaN or inf in {name}; the run that wrote it had diverged or "
                "the file is corrupt: resume from an earlier checkpoint",
            )


def _tensors(obj: Any, name: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(v, f"{name}[{k!r}]")]
    if isinstance(obj, list | tuple):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f"{name}[{i}]")]
    return []


def check_resumable(
    path: str | Path,
    ckpt: dict[str, Any],
    fingerprint: dict[str, str],
    allow_config_change: bool = False,
) -> None:
    """The checkpoint was written by a run of this config (unless `allow_config_change`)."""
    stored = (ckpt.get("trace_run") or {}).get("fingerprint")
    if allow_config_change:
        return
    if stored is None:
        raise CheckpointError(
            "config_mismatch",
            f"checkpoint {path} has no config fingerprint (written by an older trainer); "
            f"set {ALLOW_CHANGE_KEY}=true to resume from it anyway",
        )
    differ = sorted(k for k in fingerprint.keys() | stored.keys() if stored.get(k) != fingerprint.get(k))
    if differ:
        details = "; ".join(f"{k}: checkpoint {stored.get(k)} vs now {fingerprint.get(k)}" for k in differ)
        raise CheckpointError(
            "config_mismatch",
            f"checkpoint {path} was written with another {', '.join(differ)} config ({details}); "
            f"resume with the same config, or set {ALLOW_CHANGE_KEY}=true to resume anyway",
        )


def check_shapes(path: str | Path, ckpt: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Weights of another model size fail here, naming the tensors, rather than deep inside `fit`."""
    saved = ckpt["state_dict"]
    wrong = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}"
        for k, v in state.items()
        if k in saved and saved[k].shape != v.shape
    ]
    absent = sorted(state.keys() - saved.keys())
    if wrong or absent:
        raise CheckpointError(
            "shape_mismatch",
            f"checkpoint {path} holds another model: {len(wrong)} tensors differ in shape "
            f"({'; '.join(wrong[:3])}) and {len(absent)} are missing ({absent[:3]}); "
            "resume with the model= and adapter= it was trained with",
        )


def newest_valid_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint listed in `directory`'s manifest that passes `validate_checkpoint`."""
    manifest = Manifest.read(Path(directory))
    for name in reversed(manifest.files if manifest else []):
        try:
            validate_checkpoint(Path(directory) / name)
        except CheckpointError:
            continue
        return Path(directory) / name
    return None


def plain_state(obj: Any) -> Any:
    """numpy values as plain Python (exact: int64 and float64 are Python's int and float), so the file
    needs no numpy globals; lists and dicts are rebuilt, tensors kept."""
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, dict):
        return type(obj)((k, plain_state(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(plain_state(v) for v in obj)
    return obj


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
    """Save: torch.save to `.<file>.tmp-<pid>`, fsync, rename; then digest, manifest, pruning.
    Load: `validate_checkpoint`, whatever `weights_only` Lightning asks for.

    Args:
        run: the id of the run that owns the checkpoint folder (kept across resumes).
        fingerprint: this run's config fingerprint, stored in every checkpoint.
        keep_last: how many of the run's newest checkpoints to keep (None: all).
    """

    def __init__(
        self, run: str | None = None, fingerprint: dict[str, str] | None = None, keep_last: int | None = None
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"checkpoints.keep_last={keep_last} must be >= 1 (or null to keep all)")
        self.run, self.fingerprint, self.keep_last = run or uuid.uuid4().hex, fingerprint, keep_last
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
        checkpoint = {
            **plain_state(checkpoint),
            "trace_run": {"run": self.run, "fingerprint": self.fingerprint},
        }
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            digest = sha256_file(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        # a crash here leaves a file without a matching digest: refused, and `last` takes the one before
        write_atomic(digest_path(path), f"{digest}\n".encode())
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


def _unlink_with_digest(path: Path) -> None:
    path.unlink(missing_ok=True)
    digest_path(path).unlink(missing_ok=True)
