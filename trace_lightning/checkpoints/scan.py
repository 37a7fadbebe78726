"""The floor every checkpoint module stands on: the error they raise and the pickle scan they share.

A checkpoint's pickle is read opcode by opcode (`pickletools` parses, it never executes) and every
global it imports must be in `ALLOWED_GLOBALS`: an ordered dict, a tensor and its storage. That is
all a Lightning checkpoint of this project holds; the rest is dicts, lists, str, int (numpy's RNG
state is big ints), float, bool and None. So a pickle planted in `checkpoints/` is refused before
it could run, whatever torch's own allow-list has been widened to by other libraries.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import IO

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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; `reason` is a short name, the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
