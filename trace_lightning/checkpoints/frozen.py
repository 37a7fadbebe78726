"""The weights a run never trains, left out of its checkpoints and named instead.

With LoRA only the adapter and the predictor head train: the base model's weights (and a frozen
companion or reference model's) are the ones loaded from the model folder at start-up and never
change. A checkpoint therefore holds the trainable weights, the optimizer and scheduler state and the
DataModule state, and names the frozen weights by the folder they came from and a SHA-256 of their
values; a resume loads the same folder and refuses to continue if the digest differs. For SmolLM2 +
LoRA that is ~25 MB per checkpoint instead of 564 MB. A full-weights run has no frozen weights (a
KL reference copy aside), so its checkpoints stay full.

Example: `FrozenWeights.of(module, "outputs/warm_start/model")` on a LoRA policy lists the base's
`...base_layer.weight`, embedding and norm keys; on a full-weights module without a reference, None.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trace_lightning.checkpoints.scan import CheckpointError

BASE_KEY = "base"  # in a checkpoint's trace_run: {"path", "sha256", "frozen"} of its left-out weights


@dataclass(frozen=True)
class FrozenWeights:
    """The state_dict keys of a module's frozen parameters, where they were loaded from, their digest."""

    keys: frozenset[str]
    path: str
    sha256: str

    @staticmethod
    def of(module: torch.nn.Module, path: str | Path) -> FrozenWeights | None:
        """The frozen parameters of `module` (None when every parameter trains). Call it before FSDP2
        shards the module: the digest reads every frozen tensor whole (~1 s per 500 MB)."""
        state = module.state_dict(keep_vars=True)
        keys = sorted(
            k for k, v in state.items() if isinstance(v, torch.nn.Parameter) and not v.requires_grad
        )
        if not keys:
            return None
        return FrozenWeights(frozenset(keys), str(path), digest(state, keys))

    def stamp(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "frozen": len(self.keys)}

    def trained_only(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A state_dict without the frozen weights (the order kept)."""
        return {k: v for k, v in state.items() if k not in self.keys}


def digest(state: Mapping[str, torch.Tensor], keys: list[str]) -> str:
    """SHA-256 over each key's name, dtype, shape and bytes, in the order given."""
    h = hashlib.sha256()
    for key in keys:
        tensor = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy
    return h.hexdigest()


def check_base(path: str | Path, ckpt: dict[str, Any], frozen: FrozenWeights | None) -> bool:
    """Whether the checkpoint left its frozen weights out (then they must be this run's, unchanged);
    `CheckpointError` naming both bases when they differ. A checkpoint written before checkpoints left
    out the frozen base, or by a full-weights run, holds every weight and returns False."""
    base = (ckpt.get("trace_run") or {}).get(BASE_KEY)
    if base is None:
        return False
    if frozen is not None and base.get("sha256") == frozen.sha256:
        return True
    now = (
        "no frozen weights (full fine-tuning)"
        if frozen is None
        else f"{frozen.path} (sha256 {frozen.sha256[:12]})"
    )
    raise CheckpointError(
        "base_changed",
        f"checkpoint {path} holds only the trained weights (LoRA adapter and head); it was trained on the "
        f"base model {base.get('path')} (sha256 {str(base.get('sha256'))[:12]}), but this run's is {now}: "
        "the base model changed since. Resume with the base it was trained on (the same model= or "
        "model.warm_start= folder, unmodified), or start a new run",
    )
