"""Moved to `trace_lightning.checkpoints.plugin` (issue 25); this path stays importable for old code."""

from trace_lightning.checkpoints.plugin import AtomicCheckpointIO, plain_state

__all__ = ["AtomicCheckpointIO", "plain_state"]
