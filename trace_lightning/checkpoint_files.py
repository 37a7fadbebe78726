"""Moved to `trace_lightning.checkpoints.files` (issue 25); this path stays importable for old code."""

from trace_lightning.checkpoints.files import (
    MANIFEST,
    Manifest,
    clean_stale_temps,
    digest_path,
    pid_alive,
    sha256_file,
    temp_path,
    write_atomic,
)

__all__ = [
    "MANIFEST",
    "Manifest",
    "clean_stale_temps",
    "digest_path",
    "pid_alive",
    "sha256_file",
    "temp_path",
    "write_atomic",
]
