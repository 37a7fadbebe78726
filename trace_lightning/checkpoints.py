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

`checkpoint_io.AtomicCheckpointIO` writes each checkpoint atomically with its digest, lists it in the
folder's manifest (`checkpoint_files.Manifest`) and prunes old ones. `newest_valid_checkpoint`
(`ckpt_path=last`) considers only files in the manifest, so another run's file there is never chosen.

Resume is exact from an iteration boundary: the checkpoint written at the end of an epoch holds the
weights, optimizer, scheduler, callbacks and the DataModule state (allocation RNG, the torch RNG the
engine samples with, iteration counter, cold-start prior), so the next iteration is the one an
uninterrupted run would have sampled. A checkpoint taken on SIGTERM or SIGINT (`stopping.StopOnSignal`)
is written at a batch boundary inside an iteration; resuming from it drops the rest of that iteration's
batches (see `RolloutDataModule.train_dataloader`) and continues with the next iteration.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from trace_lightning.checkpoint_files import Manifest, digest_path, sha256_file

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
    if path.is_dir():  # a sharded checkpoint (trainer=fsdp2): the same checks, file by file
        from trace_lightning.checkpoint_shards import validate_folder

        return validate_folder(path)
    if not path.is_file():
        raise CheckpointError(
            "missing", f"checkpoint {path} does not exist; pass ckpt_path=<a .ckpt file> or ckpt_path=last"
        )
    _check_digest(path)
    _check_pickle(path)
    try:
        # mmap (copy-on-write): tensors are not copied into memory; the digest and NaN checks read them once
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
    return dict(ckpt)


def _check_digest(path: Path) -> None:
    digest = digest_path(path.resolve())
    if not digest.is_file():
        raise CheckpointError(
            "no_digest",
            f"checkpoint {path} has no digest {digest.name} beside it, so it was not written by this "
            "trainer (or its save was cut short); resume from another file (ckpt_path=last), or, for a "
            f"file you trust, write one: sha256sum {path} | cut -d' ' -f1 > {digest}",
        )
    if digest.read_text().strip() != sha256_file(path):
        raise CheckpointError(
            "digest_mismatch",
            f"checkpoint {path} does not match its SHA-256 digest {digest.name}: its bytes changed after "
            "it was written (disk corruption or tampering); resume from another file (ckpt_path=last)",
        )


def _check_pickle(path: Path) -> None:
    """Refuse any global outside ALLOWED_GLOBALS; pickletools only parses, it never executes."""
    refused = refused_global(path)
    if refused is not None:
        raise CheckpointError(
            "unsafe_pickle",
            f"checkpoint {path} refused: its pickle imports {refused!r}, which no checkpoint of this "
            "trainer holds (it may be a planted file that would run code); delete it",
        )


def refused_global(path: Path | IO[bytes]) -> str | None:
    """The first import in the checkpoint's pickle that is not allow-listed, or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith(".pkl")]
            if len(pickles) != 1 or not pickles[0].endswith("/data.pkl"):
                return f"<an archive with pickles {pickles}, not one torch.save wrote>"
            ops = list(pickletools.genops(archive.read(pickles[0])))
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
        raise CheckpointError(
            "corrupt", f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {err})"
        ) from err
    for op, arg, _ in ops:
        if op.name in _REFUSED_OPCODES or (op.name == "GLOBAL" and arg not in ALLOWED_GLOBALS):
            return str(arg or op.name)
    return None


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
