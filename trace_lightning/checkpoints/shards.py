"""Sharded (distributed) checkpoints under the same rules as file checkpoints (see validate.py).

Under trainer=fsdp2 a checkpoint `<name>.ckpt` is a folder that Lightning's ModelParallelStrategy
writes with torch.distributed.checkpoint (DCP): one `__<rank>_0.distcp` file of shards per process,
the DCP index `.metadata`, and `meta.pt` (loops, callbacks, DataModule state, the run's fingerprint).
Beside the folder, `<name>.ckpt.sha256` lists the SHA-256 of every file in it.

DCP's own reader unpickles `.metadata` with `pickle.load` and every non-tensor item (optimizer
hyperparameters) with `torch.load(weights_only=False)`. Neither runs here: `.metadata` is
unpickled with only DCP's index classes allowed, every item is a torch.save archive loaded by
`scan.load_archive`, and both validation and loading (reader.py) read each file once into memory
through a `VerifiedFolder`, which uses it only if its bytes have the SHA-256 the digest list gave at
validation, so a file rewritten between the check and the load is refused, not loaded. The folder
may hold only the files its digest list names, plain files, no links; every file the index names
must be one of them. A failure is a `CheckpointError` naming the file (and the item).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trace_lightning.checkpoints.files import check_plain_entry, digest_path
from trace_lightning.checkpoints.scan import REQUIRED_KEYS, CheckpointError, load_archive, refuse_non_finite

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state of a distributed checkpoint
INDEX_FILE = ".metadata"  # DCP's
RANK_STATES = "trace_rank_datamodule"  # meta.pt key: each process's DataModule state, by rank
VERIFIED = "trace_verified_shards"  # key of the `VerifiedFolder` in what `validate_folder` returns
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP: one per rank (and writer thread)
# The classes DCP's index is made of (torch 2.13), and the builtins their fields use.
_DCP = "torch.distributed.checkpoint.metadata"
INDEX_GLOBALS = frozenset(
    {
        *(
            (_DCP, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a tensor layout by name, from a fixed table
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        *(("torch", t) for t in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool")),
    }
)


def write_digests(folder: Path) -> bytes:
    """`<sha256>  <file>` for every file of the folder, sorted: the text of `<folder>.sha256`."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return "".join(f"{_sha256(p.read_bytes())}  {p.name}\n" for p in files).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class VerifiedFolder:
    """A sharded checkpoint folder and the SHA-256 of each of its files, as validated. `read` returns a
    file's bytes only if they still have that digest (`digests` None: a staging folder at save, whose
    digests are not written yet, read as it is)."""

    path: Path
    digests: Mapping[str, str] | None

    @property
    def processes(self) -> int:
        """How many processes wrote it: DCP writes one `__<rank>_0.distcp` file per rank."""
        names = self.digests.keys() if self.digests is not None else os.listdir(self.path)
        return len({m.group(1) for n in names if (m := _SHARD_FILE.match(n))})

    def read(self, name: str) -> bytes:
        if self.digests is not None and name not in self.digests:
            raise CheckpointError(
                "unlisted_file",
                f"sharded checkpoint {self.path} names {name!r}, which its digest list does not cover "
                "(a path out of the folder, or a file added later): delete this checkpoint",
            )
        try:
            data = (self.path / name).read_bytes()
        except OSError as err:
            raise CheckpointError("missing", f"shard file {self.path / name} cannot be read ({err})") from err
        if self.digests is not None and _sha256(data) != self.digests[name]:
            raise CheckpointError(
                "digest_mismatch",
                f"shard file {self.path / name} is missing or does not match its SHA-256 in "
                f"{digest_path(self.path).name}: its bytes changed after it was written (disk corruption or "
                "tampering); resume from another checkpoint (ckpt_path=last)",
            )
        return data

    def index(self) -> Metadata:
        """DCP's index, unpickled from the checked bytes with only DCP's own classes allowed."""
        file = self.path / INDEX_FILE
        try:
            index = _IndexUnpickler(io.BytesIO(self.read(INDEX_FILE))).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                "unsafe_pickle", f"sharded checkpoint index {file} refused ({err}): it may be a planted file"
            ) from err
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                "corrupt", f"sharded checkpoint index {file} is unreadable ({err})"
            ) from err
        if not isinstance(index, Metadata):
            raise CheckpointError("corrupt", f"sharded checkpoint index {file} is not a DCP index")
        _check_storage(self, index)
        return index


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in INDEX_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP index")
        return super().find_class(module, name)


def _check_storage(folder: VerifiedFolder, index: Metadata) -> None:
    """Every file the index names is a plain file of the folder covered by the digest list, and no
    item asks for a stream transform (DCP's extensions; this trainer never writes one)."""
    listing = digest_path(folder.path)
    for info in index.storage_data.values():
        check_plain_entry(folder.path, info.relative_path, folder.path / INDEX_FILE)
        if folder.digests is not None and info.relative_path not in folder.digests:
            raise CheckpointError(
                "unlisted_file",
                f"sharded checkpoint index {folder.path / INDEX_FILE} names {info.relative_path!r}, which "
                f"{listing.name} does not cover: delete this checkpoint",
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError("corrupt", f"{folder.path / INDEX_FILE} asks for stream transforms")


def validate_folder(path: Path, check_digests: bool = True, check_finite: bool = True) -> dict[str, Any]:
    """The checkpoint's `meta.pt` content plus "state_dict": {name: meta tensor of the saved shape} and,
    under `VERIFIED`, the folder with its digests (what `load_sharded` reads from), after every check in
    the module docstring; `CheckpointError` naming the file otherwise."""
    folder = VerifiedFolder(path, _read_listing(path) if check_digests else None)
    _check_contents(folder)
    meta = load_archive(folder.read(META_FILE), path / META_FILE)
    missing = [
        k for k in REQUIRED_KEYS if k != "state_dict" and (not isinstance(meta, dict) or k not in meta)
    ]
    if missing:
        raise CheckpointError(
            "not_lightning", f"{path / META_FILE} is not a Lightning checkpoint (missing {missing})"
        )
    if check_finite:
        refuse_non_finite(path / META_FILE, meta)
    index = folder.index()
    _check_items(folder, index, check_finite)
    return {**meta, "state_dict": _shapes(index), VERIFIED: folder}


def _read_listing(path: Path) -> dict[str, str]:
    listing = digest_path(path.resolve())
    if not listing.is_file():
        raise CheckpointError(
            "no_digest",
            f"sharded checkpoint {path} has no digest list {listing.name} beside it, so it was not written "
            "by this trainer (or its save was cut short); resume from another one (ckpt_path=last)",
        )
    lines = [line.split("  ", 1) for line in listing.read_text().splitlines() if line]
    if any(len(parts) != 2 for parts in lines):
        raise CheckpointError("corrupt", f"digest list {listing} is not `<sha256>  <file>` lines")
    for _, name in lines:
        check_plain_entry(path, name, listing)
    return {name: digest for digest, name in lines}


def _check_contents(folder: VerifiedFolder) -> None:
    """Plain files only (no links, no subfolders), exactly the ones the digest list names."""
    with os.scandir(folder.path) as entries:
        found = {e.name: e.is_file(follow_symlinks=False) for e in entries}
    odd = sorted(name for name, plain in found.items() if not plain)
    unlisted = sorted(found.keys() - folder.digests.keys()) if folder.digests is not None else []
    if odd or unlisted:
        raise CheckpointError(
            "digest_mismatch",
            f"sharded checkpoint {folder.path} holds {(odd + unlisted)[:3]}, not plain files listed in "
            f"{digest_path(folder.path).name}: delete them, or resume from another checkpoint",
        )


def _check_items(folder: VerifiedFolder, index: Metadata, check_finite: bool) -> None:
    """Every item DCP would read: an allow-listed torch.save archive, finite where it holds floats."""
    by_file: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for key, info in index.storage_data.items():
        by_file[info.relative_path].append((key, info))
    for name, items in sorted(by_file.items()):
        data = folder.read(name)
        for key, info in sorted(items, key=lambda item: item[1].offset):
            where = f"{folder.path / name} ({key.fqn})"
            value = load_archive(item_bytes(data, info, where), where)
            if check_finite:
                refuse_non_finite(where, value)


def item_bytes(data: bytes, info: Any, where: str) -> bytes:
    """One item's bytes in its file's bytes (bounds checked: the index is input too)."""
    if info.offset < 0 or info.length < 0 or info.offset + info.length > len(data):
        raise CheckpointError("corrupt", f"shard item {where} lies outside its file (truncated or corrupt)")
    return data[info.offset : info.offset + info.length]


def _shapes(index: Metadata) -> dict[str, torch.Tensor]:
    """The saved model weights' shapes, as meta tensors under their module names (for check_shapes)."""
    prefix = "state_dict."
    return {
        key[len(prefix) :]: torch.empty(tuple(entry.size), device="meta")
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
