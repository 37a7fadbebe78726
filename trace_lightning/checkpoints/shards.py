"""Sharded (distributed) checkpoints under the same rules as file checkpoints (see validate.py).

Under trainer=fsdp2 a checkpoint `<name>.ckpt` is a folder that Lightning's ModelParallelStrategy
writes with torch.distributed.checkpoint (DCP): one `__<rank>_0.distcp` file of shards per process,
the DCP index `.metadata`, and `meta.pt` (loops, callbacks, DataModule state, the run's fingerprint).
Beside the folder, `<name>.ckpt.sha256` lists the SHA-256 of every file in it.

DCP itself unpickles `.metadata` with `pickle.load` and every non-tensor item (optimizer
hyperparameters) with `torch.load(weights_only=False)`, so each of those is checked before DCP reads
anything: `.metadata` is unpickled with only DCP's own index classes allowed, and every item in the
shard files must be a torch.save pickle of allow-listed globals (`scan.refused_global`).
Tensor items must be finite. A failure is a `CheckpointError` naming the file (and the item).
"""

from __future__ import annotations

import io
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from trace_lightning.checkpoints.files import digest_path, sha256_file
from trace_lightning.checkpoints.scan import REQUIRED_KEYS, CheckpointError, refused_global

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state of a distributed checkpoint
INDEX_FILE = ".metadata"  # DCP's
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
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return "".join(f"{sha256_file(p)}  {p.relative_to(folder)}\n" for p in files).encode()


def validate_folder(path: Path, check_digests: bool = True, check_finite: bool = True) -> dict[str, Any]:
    """The checkpoint's `meta.pt` content plus "state_dict": {name: meta tensor of the saved shape}, after
    every check in the module docstring; `CheckpointError` naming the file otherwise."""
    if check_digests:
        _check_digests(path)
    meta = _load_meta(path)
    index = _load_index(path)
    _check_items(path, index, check_finite)
    return {**meta, "state_dict": _shapes(index)}


def _check_digests(path: Path) -> None:
    listing = digest_path(path.resolve())
    if not listing.is_file():
        raise CheckpointError(
            "no_digest",
            f"sharded checkpoint {path} has no digest list {listing.name} beside it, so it was not written "
            "by this trainer (or its save was cut short); resume from another one (ckpt_path=last)",
        )
    expected = dict(reversed(line.split("  ", 1)) for line in listing.read_text().splitlines() if line)
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    for name in sorted(present - expected.keys()):
        raise CheckpointError("digest_mismatch", f"{path / name} is not listed in {listing.name}: delete it")
    for name, digest in sorted(expected.items()):
        if name not in present or sha256_file(path / name) != digest:
            raise CheckpointError(
                "digest_mismatch",
                f"shard file {path / name} is missing or does not match its SHA-256 in {listing.name}: its "
                "bytes changed after it was written (disk corruption or tampering); resume from another "
                "checkpoint (ckpt_path=last)",
            )


def _load_meta(path: Path) -> dict[str, Any]:
    file = path / META_FILE
    _refuse(file, file)
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError("corrupt", f"checkpoint file {file} is truncated or corrupt ({err})") from err
    missing = [k for k in REQUIRED_KEYS if k != "state_dict" and k not in meta]
    if missing:
        raise CheckpointError("not_lightning", f"{file} is not a Lightning checkpoint (missing {missing})")
    return dict(meta)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in INDEX_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP index")
        return super().find_class(module, name)


def _load_index(path: Path) -> Any:
    file = path / INDEX_FILE
    try:
        with open(file, "rb") as f:
            return _IndexUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            "unsafe_pickle", f"sharded checkpoint index {file} refused ({err}): it may be a planted file"
        ) from err
    except Exception as err:
        raise CheckpointError("corrupt", f"sharded checkpoint index {file} is unreadable ({err})") from err


def _check_items(path: Path, index: Any, check_finite: bool) -> None:
    """Every item DCP would read: an allow-listed torch.save pickle, and a finite tensor where it is one."""
    by_file: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for key, info in index.storage_data.items():
        by_file[info.relative_path].append((key, info))
    for name, items in sorted(by_file.items()):
        file = path / name
        with open(file, "rb") as f:
            for key, info in sorted(items, key=lambda item: item[1].offset):
                f.seek(info.offset)
                data = f.read(info.length)
                _check_item(file, key.fqn, data, check_finite)


def _check_item(file: Path, fqn: str, data: bytes, check_finite: bool) -> None:
    _refuse(io.BytesIO(data), file, fqn)
    if not check_finite:
        return
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError("corrupt", f"shard file {file} is corrupt at {fqn} ({err})") from err
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ):
        raise CheckpointError(
            "non_finite",
            f"shard file {file} holds NaN or inf in {fqn}; the run that wrote it had diverged or the file is "
            "corrupt: resume from an earlier checkpoint",
        )


def _refuse(source: Any, file: Path, item: str = "") -> None:
    where = f"{file} ({item})" if item else str(file)
    try:
        refused = refused_global(source)
    except CheckpointError as err:
        raise CheckpointError("corrupt", f"checkpoint file {where} is truncated or corrupt") from err
    if refused is not None:
        raise CheckpointError(
            "unsafe_pickle",
            f"checkpoint file {where} refused: its pickle imports {refused!r}, which no checkpoint of this "
            "trainer holds (it may be a planted file that would run code); delete it",
        )


def _shapes(index: Any) -> dict[str, torch.Tensor]:
    """The saved model weights' shapes, as meta tensors under their module names (for check_shapes)."""
    prefix = "state_dict."
    return {
        key[len(prefix) :]: torch.empty(tuple(entry.size), device="meta")
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
