"""The floor every checkpoint module stands on: the error they raise, the pickle scan, the finite check.

A checkpoint is loaded from bytes already in memory (`load_archive`), never from a path that could
change between the check and the load. Its pickle is read opcode by opcode (`pickletools` parses, it
never executes) and every global it imports must be in `ALLOWED_GLOBALS`: an ordered dict, a tensor
and its storage. That is all a Lightning checkpoint of this project holds; the rest is dicts, lists,
str, int (numpy's RNG state is big ints), float, bool and None. So a pickle planted in
`checkpoints/` is refused before it could run, whatever torch's own allow-list has been widened to.

The pickle scanned is the one torch will unpickle: it is read with torch's own zip reader. Python's
`zipfile` and torch's reader (miniz, which looks names up case-insensitively) can read different
members of a crafted archive (e.g. `archive/data.pkl` and `archive/DATA.PKL`), so an archive in
which they could disagree is refused as ambiguous.
"""

from __future__ import annotations

import io
import math
import pickletools
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

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
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks for to choose its zip reader
# Lightning's ModelCheckpoint keeps +-inf as "no score yet"; these are sentinels, not training state.
_SENTINELS = frozenset({"best_model_score", "kth_value", "current_score"})


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; `reason` is a short name, the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_archive(data: bytes, where: str | Path) -> Any:
    """`torch.load(weights_only=True)` of a torch.save archive held in memory, after the scan refused
    nothing; `CheckpointError` naming `where` (a file, or a file and an item) otherwise."""
    refused = refused_global(data, where)
    if refused is not None:
        raise CheckpointError(
            "unsafe_pickle",
            f"checkpoint {where} refused: its pickle imports {refused!r}, which no checkpoint of this "
            "trainer holds (it may be a planted file that would run code); delete it",
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, wrong format: all mean the same to the user
        raise CheckpointError(
            "corrupt",
            f"checkpoint {where} is truncated or corrupt ({type(err).__name__}: {err}); "
            "delete it or resume from another file (ckpt_path=last skips corrupt ones)",
        ) from err


def refused_global(source: bytes | Path | IO[bytes], where: str | Path | None = None) -> str | None:
    """The first import in the archive's pickle that is not allow-listed (or a refused opcode), or None.

    Example: a torch.save of `{"w": torch.zeros(2)}` gives None; of `{"d": torch.device("cpu")}` gives
    'torch device' (torch's own weights_only list allows it; ours does not)."""
    data = source if isinstance(source, bytes) else _read(source)
    where = where if where is not None else (source if isinstance(source, Path) else "<buffer>")
    try:
        ops = list(pickletools.genops(torch_pickle(data, where)))
    except (ValueError, EOFError) as err:
        raise CheckpointError(
            "corrupt", f"checkpoint {where} has a truncated or corrupt pickle ({err})"
        ) from err
    for op, arg, _ in ops:
        if op.name in _REFUSED_OPCODES or (op.name == "GLOBAL" and arg not in ALLOWED_GLOBALS):
            return str(arg or op.name)
    return None


def _read(source: Path | IO[bytes]) -> bytes:
    if isinstance(source, Path):
        return source.read_bytes()
    source.seek(0)
    return source.read()


def torch_pickle(data: bytes, where: str | Path) -> bytes:
    """The pickle torch.load would unpickle from this archive, read with torch's own reader.
    (`torch._C.PyTorchFileReader` is what `torch.serialization._open_zipfile_reader` wraps; torch is
    pinned, see pyproject.toml.)"""
    if not data.startswith(_ZIP_MAGIC):  # torch would take its legacy path; torch.save never writes it
        raise CheckpointError(
            "corrupt", f"checkpoint {where} is not a torch zip archive (truncated or corrupt)"
        )
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records, pickle_bytes = reader.get_all_records(), reader.get_record("data.pkl")
    except RuntimeError as err:
        raise CheckpointError("corrupt", f"checkpoint {where} is truncated or corrupt ({err})") from err
    _refuse_ambiguous(data, records, pickle_bytes, where)
    return bytes(pickle_bytes)


def _refuse_ambiguous(data: bytes, records: list[str], pickle_bytes: bytes, where: str | Path) -> None:
    """Python's zipfile must see exactly the members torch sees, names distinct even ignoring case,
    one pickle, and the same pickle bytes: otherwise two readers could disagree about the content."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            pickles = [n for n in names if n.lower().endswith(".pkl")]
            same_pickle = len(pickles) == 1 and archive.read(pickles[0]) == pickle_bytes
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
        raise CheckpointError("corrupt", f"checkpoint {where} is truncated or corrupt ({err})") from err
    folded = {n.lower() for n in names}
    members = sorted(n.split("/", 1)[-1] for n in names)
    if len(folded) != len(names) or members != sorted(records) or not same_pickle:
        raise CheckpointError(
            "ambiguous_archive",
            f"checkpoint {where} refused: its zip archive has members that readers could take for one "
            f"another ({sorted(names)[:6]}); torch.save never writes such an archive (a crafted file?): "
            "delete it",
        )


def non_finite(state: Any, name: str = "") -> str | None:
    """Where the first NaN or inf is in a nested state (tensors and Python floats), or None.

    Example: non_finite({"prior": {"a": [0.5, float("nan")]}}) == "['prior']['a'][1]"."""
    if isinstance(state, torch.Tensor):
        bad = (state.is_floating_point() or state.is_complex()) and not bool(torch.isfinite(state).all())
        return name if bad else None
    if isinstance(state, float):
        return None if math.isfinite(state) else name
    if isinstance(state, dict):
        return next((w for k, v in state.items() if (w := non_finite(v, f"{name}[{k!r}]")) is not None), None)
    if isinstance(state, list | tuple):
        return next(
            (w for i, v in enumerate(state) if (w := non_finite(v, f"{name}[{i}]")) is not None), None
        )
    return None


def refuse_non_finite(where: str | Path, state: Any) -> None:
    """NaN in weights, optimizer moments, the prior, the predictor's replay or its refit optimizer would
    make later steps non-finite (and skipped) or poison the allocation: refuse the checkpoint."""
    found = non_finite(_without_sentinels(state))
    if found is not None:
        raise CheckpointError(
            "non_finite",
            f"checkpoint {where} holds NaN or inf in {found}; the run that wrote it had diverged or the "
            "file is corrupt: resume from an earlier checkpoint",
        )


def _without_sentinels(state: Any) -> Any:
    """The checkpoint without ModelCheckpoint's score sentinels (the callbacks' states, top level)."""
    if not isinstance(state, dict) or not isinstance(state.get("callbacks"), dict):
        return state
    callbacks = {
        key: {k: v for k, v in value.items() if k not in _SENTINELS} if isinstance(value, dict) else value
        for key, value in state["callbacks"].items()
    }
    return {**state, "callbacks": callbacks}
