"""Moved to `trace_lightning.checkpoints.shards` (issue 25); this path stays importable for old code."""

from trace_lightning.checkpoints.shards import (
    INDEX_FILE,
    INDEX_GLOBALS,
    META_FILE,
    validate_folder,
    write_digests,
)

__all__ = ["INDEX_FILE", "INDEX_GLOBALS", "META_FILE", "validate_folder", "write_digests"]
