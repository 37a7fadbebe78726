"""`python -m trace_lightning.checkpoints.convert <sharded folder> [<file>]`: a sharded (trainer=fsdp2)
checkpoint as one file, which a run without trainer=fsdp2 (one process, or DDP) resumes.

The folder is validated and read as a resume reads it (checked bytes, nothing unpickled beyond the
allow-lists); the file is written as every checkpoint is (atomically, with its digest, listed in the
folder's manifest under the same run id), so `ckpt_path=last` in that run_dir now takes it. DCP keys
optimizer state by parameter name; torch.optim keys it by position, which is restored here. The
DataModule state kept is rank 0's (the others' sampling RNGs have no place in a one-process run).

Example:
    python -m trace_lightning.checkpoints.convert outputs/train/run/checkpoints/iteration-0003.ckpt
    # writes outputs/train/run/checkpoints/iteration-0003-single.ckpt (and its .sha256)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trace_lightning.checkpoints.plugin import AtomicCheckpointIO
from trace_lightning.checkpoints.reader import load_full
from trace_lightning.checkpoints.scan import CheckpointError
from trace_lightning.checkpoints.shards import RANK_STATES, VERIFIED
from trace_lightning.checkpoints.validate import validate_checkpoint


def to_single_file(folder: Path, out: Path | None = None) -> Path:
    """Write the sharded checkpoint `folder` as one file (default: `<name>-single.ckpt` beside it)."""
    ckpt = validate_checkpoint(folder)
    if VERIFIED not in ckpt:
        raise CheckpointError(
            "not_sharded", f"{folder} is a single-file checkpoint already; nothing to convert"
        )
    full = load_full(ckpt[VERIFIED])
    meta = {k: v for k, v in ckpt.items() if k not in (VERIFIED, "state_dict", RANK_STATES)}
    optimizers = sorted((k for k in full if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    single = {
        **meta,
        "state_dict": full["state_dict"],
        "optimizer_states": [by_position(full[k]) for k in optimizers],
    }
    out = out or folder.with_name(f"{folder.name.removesuffix('.ckpt')}-single.ckpt")
    run = meta.get("trace_run") or {}
    AtomicCheckpointIO(run=run.get("run"), fingerprint=run.get("fingerprint")).save_checkpoint(single, out)
    return out


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP) keyed by position instead (torch.optim): the
    positions run through the param groups in order, as `Optimizer.state_dict` numbers them.

    Example: param_groups [{"params": ["a", "b"]}, {"params": ["c"]}], state {"b": s} ->
    param_groups [{"params": [0, 1]}, {"params": [2]}], state {1: s}."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folder", type=Path, help="a sharded checkpoint folder (<name>.ckpt) of trainer=fsdp2"
    )
    parser.add_argument("out", type=Path, nargs="?", help="the file to write (default: <name>-single.ckpt)")
    args = parser.parse_args(argv)
    print(to_single_file(args.folder, args.out))


if __name__ == "__main__":
    main()
