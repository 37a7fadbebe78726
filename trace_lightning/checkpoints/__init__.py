"""Checkpoints that a long RL run can trust: they cannot run code, and a damaged one is named, not used.

Loading never unpickles an arbitrary object: the pickle inside a checkpoint is read opcode by opcode
(nothing executes) and every global it imports must be allow-listed before `torch.load(weights_only=
True)` runs. A SHA-256 digest written beside each file, a fingerprint of the config that wrote it and
a manifest of the run's files say whether it may be resumed from. Every file is read once into
memory, and its digest, its scan and its load all use those bytes.

Resume is exact from an iteration boundary: the checkpoint written at the end of an epoch holds the
weights, optimizer, scheduler, callbacks and the DataModule state (allocation RNG, the torch RNG the
engine samples with, iteration counter, cold-start prior), so the next iteration is the one an
uninterrupted run would have sampled. A SIGTERM checkpoint is taken at a batch boundary inside an
iteration; resuming from it drops the rest of that iteration's batches (see
`RolloutDataModule.train_dataloader`) and continues with the next iteration.

The modules, each importing only those above it (moving what the old `checkpoints.py` and
`checkpoint_shards.py` shared into `scan` opened the circle between them):
- `scan`: `CheckpointError` and the allow-list scan of a pickle;
- `fingerprint`: whether a stored config fingerprint still describes this run, across upgrades;
- `files`: the files beside a checkpoint (digest, manifest, temporary files), atomic small writes;
- `frozen`: the weights a LoRA run never trains, left out of its checkpoints and named by digest;
- `shards`: sharded (FSDP2, torch.distributed.checkpoint) folders under the same rules;
- `reader`: loading a sharded folder through DCP from the bytes that were checked;
- `validate`: `validate_checkpoint`, the checks against this run, `newest_valid_checkpoint`;
- `plugin`: `AtomicCheckpointIO`, the Lightning plugin that writes, prunes and loads;
- `export`: `ModelArtifact`, the trained weights logged to MLflow once per run;
- `convert`: `python -m trace_lightning.checkpoints.convert`, a sharded folder as one file.

A checkpoint whose config names an old module path (`trace_lightning.checkpoint_io`, `checkpoint_files`,
`checkpoint_shards`) still resumes: `fingerprint.MOVED` maps them here. A checkpoint on SIGTERM or
SIGINT is `stopping.StopOnSignal`'s.
"""

from trace_lightning.checkpoints.plugin import AtomicCheckpointIO, plain_state
from trace_lightning.checkpoints.scan import ALLOWED_GLOBALS, REQUIRED_KEYS, CheckpointError, refused_global
from trace_lightning.checkpoints.validate import (
    ALLOW_CHANGE_KEY,
    check_resumable,
    check_shapes,
    newest_valid_checkpoint,
    validate_checkpoint,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "ALLOW_CHANGE_KEY",
    "REQUIRED_KEYS",
    "AtomicCheckpointIO",
    "CheckpointError",
    "check_resumable",
    "check_shapes",
    "newest_valid_checkpoint",
    "plain_state",
    "refused_global",
    "validate_checkpoint",
]
