"""FSDP2 (`trainer=fsdp2`): the policy's decoder layers sharded over the processes, the head replicated.

Lightning's `ModelParallelStrategy` runs the process group (gloo on CPU, NCCL on GPUs) and calls
`TraceModule.configure_model`, which calls `shard_policy` here: `fully_shard` on every decoder layer,
then on the policy itself (embeddings, final norm, LM head). The success head stays a plain replicated
module, since the predictor refit (collector.py) trains it identically on every process outside the
optimizer; its gradients from the joint loss are averaged here (`average_grads`).

Rollouts cannot run through the sharded policy: each process rolls out its own prompts for its own
number of turns, and every forward of a sharded module is a collective (an all-gather per layer), so
the processes would wait on each other forever. TraceModule therefore keeps an unsharded copy,
`RolloutCopy` (made before sharding), that the engine samples with and the predictor scores with;
before each iteration's sampling it is refreshed from the gathered full state (only the adapter with
LoRA). The old
log-probs and the training step use the sharded policy, on the same number of micro-batches
everywhere (collector.py pads with idle batches).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trace_lightning.checkpoints import AtomicCheckpointIO, validate_checkpoint
from trace_lightning.checkpoints.files import clean_stale_temps, temp_path
from trace_lightning.checkpoints.reader import load_sharded
from trace_lightning.checkpoints.shards import RANK_STATES, VERIFIED
from trace_lightning.checkpoints.validate import check_strategy
from trace_lightning.rendezvous import open_local_group


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` as pure data-parallel sharding over `devices * num_nodes` processes.

    `ModelParallelStrategy` writes distributed checkpoints itself, past any CheckpointIO plugin, so
    `save_checkpoint` and `load_checkpoint` are where this run's checkpoint rules are applied to them:
    written into a temporary folder, checked, digested, renamed, listed in the manifest and pruned
    (`checkpoints.shards`), and validated before any of it is loaded.
    """

    def __init__(self, devices: int, num_nodes: int = 1) -> None:
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(
                f"trainer.devices={devices!r}: with trainer=fsdp2 give the number of processes per node, "
                "e.g. trainer.devices=2 (one per GPU, or CPU processes)"
            )
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"trainer.num_nodes={num_nodes!r} must be a number of nodes >= 1")
        super().__init__(
            data_parallel_size=devices * num_nodes, tensor_parallel_size=1, save_distributed_checkpoint=True
        )

    def _setup_distributed(self) -> None:
        """The process group of a one-machine run on a store bound to MASTER_ADDR (`rendezvous`)."""
        self.set_world_ranks()
        device = {"device_id": self.root_device} if self.root_device.type != "cpu" else {}
        open_local_group(self, timeout=self._timeout, **device)
        super()._setup_distributed()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        io = self.checkpoint_io
        if not isinstance(io, AtomicCheckpointIO):  # a Trainer built without the CLI's plugin
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        staging = Path(self.broadcast(str(temp_path(path))))  # rank 0's name, shared by every rank
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            clean_stale_temps(path.parent)
        self.barrier()
        super().save_checkpoint(io.stamp(self._with_rank_states(checkpoint)), staging, storage_options)
        self.barrier()  # every rank's shards are on disk before rank 0 checks and publishes the folder
        if self.is_global_zero:
            io.publish_folder(staging, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """ModelParallelStrategy's load, but from the bytes that were checked: the folder as
        `validate_checkpoint` saw it (at build, or now), each file read once and used only if its digest
        is unchanged, with no `pickle.load` or `torch.load(weights_only=False)` (checkpoints/shards.py)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        io = self.checkpoint_io
        checked = isinstance(io, AtomicCheckpointIO)  # the build's validation is reused when unchanged
        validated = io.load_checkpoint(path) if checked else validate_checkpoint(path)
        check_strategy(path, validated, self.world_size)  # a single file, or another process count: named
        checkpoint = {k: v for k, v in validated.items() if k not in (VERIFIED, "state_dict")}  # shapes only
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        assert self.lightning_module is not None
        load_sharded(validated[VERIFIED], self.model, optimizers, strict=self.lightning_module.strict_loading)
        states, key = checkpoint.pop(RANK_STATES, None), self._datamodule_key()
        if states is not None and key is not None:
            checkpoint[key] = states[self.global_rank]
        return checkpoint

    def _datamodule_key(self) -> str | None:
        """Where Lightning keeps the DataModule's state in a checkpoint: its class name."""
        datamodule = self.lightning_module.trainer.datamodule if self.lightning_module is not None else None
        return None if datamodule is None else type(datamodule).__qualname__

    def _with_rank_states(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Every process's DataModule state beside rank 0's: the torch RNG each samples with has drawn a
        different number of tokens, so a resume that gave all of them rank 0's would not be exact."""
        key = self._datamodule_key()
        if key is None or key not in checkpoint:
            return checkpoint
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, checkpoint[key])
        return {**checkpoint, RANK_STATES: states}


@dataclass
class RolloutCopy:
    """An unsharded copy of the policy for sampling and scoring, refreshed from the sharded one.

    `adapter_only`: with LoRA only the trainable adapter weights are gathered and loaded; the frozen
    base weights of the copy are the ones it was made with, which never change."""

    module: torch.nn.Module
    adapter_only: bool

    @staticmethod
    def of(policy: torch.nn.Module) -> RolloutCopy:
        """A frozen copy of the (still unsharded) policy; LoRA when some weights are frozen."""
        frozen = any(not p.requires_grad for p in policy.parameters())
        return RolloutCopy(copy.deepcopy(policy).eval().requires_grad_(False), adapter_only=frozen)

    def refresh(self, policy: torch.nn.Module, device: torch.device) -> None:
        """Gather the full weights (a collective: every process calls it at the same point) and load them."""
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=self.adapter_only)
        state = get_model_state_dict(policy, options=options)  # plain tensors, all-gathered on every rank
        self.module.to(device)
        result = self.module.load_state_dict(state, strict=not self.adapter_only)
        if result.unexpected_keys:
            raise RuntimeError(f"the rollout copy lacks gathered weights {result.unexpected_keys[:3]}")


def shard_policy(policy: torch.nn.Module, mesh: Any, rollout: torch.nn.Module) -> None:
    """`fully_shard` every decoder layer, then the rest of the policy. `rollout`, the unsharded copy,
    must have been made already: sharding replaces the policy's weights by their shards."""
    if rollout is policy:
        raise RuntimeError("shard_policy: make the rollout copy (RolloutCopy.of) before sharding")
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers names as never to be split (its `_no_split_modules`): decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"trainer=fsdp2: {type(model).__name__} names no decoder layer class (_no_split_modules); "
            "FSDP2 here needs a transformers causal LM that does (Llama, Qwen, SmolLM, Gemma, ...)"
        )
    return layers


def is_sharded(params: list[torch.Tensor]) -> bool:
    return any(isinstance(p, DTensor) for p in params)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def average_grads(params: list[torch.Tensor]) -> None:
    """All-reduce (mean) the gradients of replicated parameters, as DDP would (FSDP2 reduces only its own)."""
    world = dist.get_world_size()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


def all_finite(grads: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every gradient is finite on every process: all must agree to skip a step, or the
    sharded optimizer state and the next collective would diverge."""
    local = all(bool(torch.isfinite(_local(g)).all()) for g in grads)
    flag = torch.tensor([0.0 if local else 1.0], device=device)  # NCCL reduces only GPU tensors
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() == 0.0)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """torch's clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), at most 1) over sharded and
    replicated gradients together: the squares of each process's shards are summed over the processes,
    those of replicated gradients (the same on all) are counted once."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = sum((_local(g).double().pow(2).sum() for g in grads if isinstance(g, DTensor)), torch.zeros(()))
    replicated = sum((g.double().pow(2).sum() for g in grads if not isinstance(g, DTensor)), torch.zeros(()))
    sharded = sharded.to(device)
    dist.all_reduce(sharded, op=dist.ReduceOp.SUM)
    total = (sharded + replicated.to(sharded.device)).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(_local(g).dtype))
    return total


def trainable_sum(module: torch.nn.Module) -> float:
    """Sum of the trainable weights, the same number on every process: the shards' sums are added up
    over the processes, replicated weights counted once. A collective when anything is sharded."""
    params = [p for p in module.parameters() if p.requires_grad]
    plain = sum((p.detach().double().sum() for p in params if not isinstance(p, DTensor)), torch.zeros(()))
    if not is_sharded(params):
        return float(plain)
    shards = sum(
        (_local(p.detach()).double().sum() for p in params if isinstance(p, DTensor)), torch.zeros(())
    )
    shards = shards.to(_local(params[0]).device)
    dist.all_reduce(shards, op=dist.ReduceOp.SUM)
    return float(plain) + float(shards)
