"""Loading a sharded checkpoint through torch.distributed.checkpoint (DCP), from the bytes that were
checked.

DCP's `FileSystemReader` opens the files itself, unpickles `.metadata` with `pickle.load` and every
non-tensor item with `torch.load(weights_only=False)`. `_VerifiedReader` is that reader with every
file taken from `VerifiedFolder.read` (read once into memory, used only if its SHA-256 is the one
validation saw), the index from the allow-listed unpickler and every item from `scan.load_archive`;
`_SafePlanner` is DCP's planner with the same safe load for non-tensor items. `load_sharded` does what
Lightning's ModelParallelStrategy does to resume, and `load_full` what DCP's `dcp_to_torch_save` does
to read everything into one process (checkpoints/convert.py).
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from trace_lightning.checkpoints.scan import CheckpointError, load_archive
from trace_lightning.checkpoints.shards import VerifiedFolder, item_bytes


class _VerifiedReader(FileSystemReader):
    """DCP's file reader, but every file comes from `VerifiedFolder.read` (digest-checked, in memory),
    the index through the allow-listed unpickler and every item through `scan.load_archive`."""

    def __init__(self, folder: VerifiedFolder) -> None:
        super().__init__(folder.path)
        self.folder = folder

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.folder.index()
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for request in plan.items:
            per_file[self.storage_data[request.storage_index].relative_path].append(request)
        for name, requests in per_file.items():
            data = self.folder.read(name)
            for request in requests:
                where = f"{self.folder.path / name} ({request.storage_index.fqn})"
                chunk = item_bytes(data, self.storage_data[request.storage_index], where)
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(chunk))  # _SafePlanner: load_archive
                    continue
                tensor = narrow_tensor_by_index(
                    load_archive(chunk, where), request.storage_offsets, request.lengths
                )
                target = planner.resolve_tensor(request).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(
                        "shape_mismatch", f"{where}: {tuple(tensor.size())} vs {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(request, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, whose `torch.load(weights_only=False)` is `scan.load_archive` here."""
    loaded = load_archive(value.getvalue(), read_item.dest_index.fqn)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner for a state of known keys, its non-tensor items loaded safely."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index (dcp_to_torch_save's), loaded safely."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


def load_sharded(
    folder: VerifiedFolder,
    module: torch.nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    strict: bool,
) -> None:
    """What Lightning's ModelParallelStrategy does to load a sharded checkpoint (its `_load_checkpoint`),
    reading from checked bytes: the weights into `module`, each optimizer's state by its key
    (`optimizer_<i>`). With `strict` off, weights the checkpoint does not hold (a LoRA checkpoint's
    frozen base) keep their values."""
    saved = {k.removeprefix("state_dict.") for k in folder.index().state_dict_metadata}
    weights = {k: v for k, v in get_model_state_dict(module).items() if strict or k in saved}
    state: dict[str, Any] = {"state_dict": weights}
    dcp_load(state, storage_reader=_VerifiedReader(folder), planner=_SafePlanner())
    module.load_state_dict(state["state_dict"], strict=strict)
    for key, optimizer in optimizers.items():
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(optim_state, storage_reader=_VerifiedReader(folder), planner=_SafePlanner())
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=options)


def load_full(folder: VerifiedFolder) -> dict[str, Any]:
    """Everything DCP saved, unsharded, in this one process: {"state_dict": {...}, "optimizer_0": ...}
    (what `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` reads, from checked bytes)."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=_VerifiedReader(folder), planner=_SafeEmptyPlanner(), no_dist=True)
    return state
