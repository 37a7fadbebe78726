"""The files beside a checkpoint: its SHA-256 digest, the folder's manifest, and temporary files.

A checkpoint folder holds, for every checkpoint `<name>.ckpt` a run wrote, a digest `<name>.ckpt.sha256`
and one entry in `manifest.json` (oldest first), which also names the run that owns the folder. An
entry is a plain name in that folder, never a path or a link out of it (a `../`, absolute
or symlinked entry led `ckpt_path=last` into another run's checkpoint). Every
one of these files is written to `.<name>.tmp-<pid>` and renamed into place, so a crash leaves either
the old file or the new one, plus at worst a temporary file that `clean_stale_temps` removes later.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from trace_lightning.checkpoints.scan import CheckpointError

MANIFEST = "manifest.json"
_TMP = re.compile(r"^\..+\.tmp-(\d+)$")


def temp_path(path: Path) -> Path:
    """Where `path` is staged: the same folder (a rename across filesystems would be a copy)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename: readers see the old content or the new, never a part."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def clean_stale_temps(directory: Path) -> list[Path]:
    """Remove `.<name>.tmp-<pid>` files whose writer is dead (a kill during a save leaves them)."""
    removed = []
    for path in directory.glob(".*.tmp-*") if directory.is_dir() else []:
        match = _TMP.match(path.name)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            if path.is_dir() and not path.is_symlink():  # a sharded checkpoint's staging folder
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def check_plain_entry(directory: Path, name: str, listing: Path) -> None:
    """`name`, listed in `listing`, must be a file or folder directly in `directory`: no separator, no
    `..`, not absolute, not a symbolic link (our writers never list anything else)."""
    plain = name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
    if not plain or (directory / name).is_symlink():
        raise CheckpointError(
            "unsafe_entry",
            f"{listing} lists {name!r}, which is not a plain file in {directory} (a path, a `..` or a "
            "symbolic link leading out of the folder; this trainer never writes one): the listing was "
            "edited; delete that entry, or resume from an explicit ckpt_path=<file>",
        )


@dataclass
class Manifest:
    """The checkpoints one run wrote into a folder, oldest first; `ckpt_path=last` reads only these."""

    run: str
    files: list[str] = field(default_factory=list)

    @staticmethod
    def read(directory: Path) -> Manifest | None:
        path = directory / MANIFEST
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            manifest = Manifest(run=str(raw["run"]), files=[str(f) for f in raw["files"]])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a checkpoint manifest ({err}); delete it to start over") from err
        for name in manifest.files:
            check_plain_entry(directory, name, path)
        return manifest

    def write(self, directory: Path) -> None:
        write_atomic(directory / MANIFEST, json.dumps({"run": self.run, "files": self.files}).encode())

    def add(self, name: str) -> None:
        """A rewritten file (same name) moves to the end: it is now the newest."""
        self.files = [f for f in self.files if f != name] + [name]
