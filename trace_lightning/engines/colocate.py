"""One colocated engine per training process, and tensor-parallel groups of them.

Under DDP or FSDP2 every training process owns different prompts (Stage 1 deals them out) and plays a
different number of turns. Its engine must therefore generate on its own: any collective inside
`generate` would make the processes wait on each other, and a process with no prompts, or one that
finished its turns and went on to the tree gather, would block the others forever. That is what vLLM's
`data_parallel_size` did (every engine step all-reduced "is any rank still busy"), so it is not used.
Instead every engine is an *external* data-parallel replica: vLLM's `external_launcher` backend with
the training processes' own process group, and `tensor_parallel_size` processes per replica (1 by
default: each process an engine of its own, `generate` purely local).

With `tensor_parallel_size` > 1 the members of a group hold slices of one model and must run the very
same requests together. `GenerationGroup` does what that needs: it gathers the members' prompts (and
their sampling seeds, drawn by each member from its own stream) so all run the same list, each member
keeps its own slice of the results, and the runner's turn loop asks the group each round whether any
member still has work, so every member calls `generate` equally often (`ReActRunner`, `any_busy`).

Everything here is plain torch.distributed; engines/vllm.py passes in vLLM's tensor-parallel group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def training_processes() -> tuple[int, int]:
    """(rank, world size) of the training run's process group; (0, 1) without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def colocated_launch(tensor_parallel_size: int, on_gpu: bool) -> dict[str, Any]:
    """vLLM `LLM` arguments for an engine inside this training process (empty on a single process).

    vLLM's external launcher reads RANK, LOCAL_RANK and WORLD_SIZE from the environment; Lightning does
    not set all of them on every rank, so they are written here from the process group itself.

    Example: 2 DDP processes, tensor_parallel_size=1 -> each gets
    {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}, RANK=0 or 1.
    """
    rank, world = training_processes()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(
            f"engine.tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide the number of "
            f"training processes ({world}): each group of that many processes shares one engine"
        )
    if world == 1:
        return {}
    local_rank = torch.cuda.current_device() if on_gpu else int(os.environ.get("LOCAL_RANK", rank))
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world)})
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tensor_parallel_size}


@dataclass(frozen=True)
class GenerationGroup:
    """The processes whose `generate` calls run together: this one alone (`group` None), or the members
    of a tensor-parallel group (a gloo group, so gathering needs no accelerator)."""

    group: Any | None = None  # a torch.distributed ProcessGroup over the members
    size: int = 1
    rank: int = 0  # this process's place in the group

    def any(self, busy: bool) -> bool:
        """Whether any member is busy (a collective of the group; `busy` itself when alone)."""
        if self.group is None:
            return busy
        flag = torch.tensor([int(busy)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def gather(self, prompts: list[list[int]], seeds: list[int]) -> tuple[list[tuple[list[int], int]], slice]:
        """Every member's (prompt, seed) pairs in member order, and the slice that is this member's.

        Example: member 0 has prompts [a], member 1 [b, c] -> both get [a, b, c]; member 0 keeps
        slice(0, 1), member 1 slice(1, 3)."""
        mine = list(zip(prompts, seeds, strict=True))
        if self.group is None:
            return mine, slice(0, len(mine))
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        start = sum(len(part) for part in parts[: self.rank])
        return [pair for part in parts for pair in part], slice(start, start + len(mine))
