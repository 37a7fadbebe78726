"""What one call of the python tool may use (`SandboxLimits`, config group `env.sandbox`) and what it gave.

Every limit binds on the host, not only inside the jail: `memory_mb` is also the call's cgroup memory limit
(every process, scratch files, shared memory and the kernel memory they take), `max_processes` its pids
limit, and `scratch_mb` sizes both the scratch tmpfs and its inode cap (`scratch_inodes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

UNSAFE_NO_JAIL = "unsafe_no_jail_trusted_code_only"
JAILS = ("bwrap", UNSAFE_NO_JAIL)
INODES_PER_MB = 64  # the scratch's inode cap: one file per 16 KiB of scratch (4096 files in 64 MB)
EXTRA_PIDS = 2  # bwrap outside the jail and the launcher (the jail's init) come on top of max_processes


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use, and the jail it runs in (config group `env.sandbox`)."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 5  # per process (RLIMIT_CPU); the call's cgroup also holds all of them to one core
    memory_mb: int = 512  # per process address space, and the whole call's memory (cgroup), scratch included
    max_output_chars: int = 2000  # of stdout, and separately of the error (stderr tail)
    max_processes: int = 32  # RLIMIT_NPROC of the jail's (non-root) user, and the call's pids limit
    scratch_mb: int = 64  # the tmpfs at /scratch, the only writable place in the jail
    jail: str = "bwrap"  # or "unsafe_no_jail_trusted_code_only": no isolation, for trusted code only
    bwrap: str = "bwrap"  # the bubblewrap binary (a name looked up on PATH, or a path)
    python: str = "/usr/bin/python3"  # the jail's interpreter; under /usr, which the jail binds read-only
    audit_hook: bool = True  # a second layer inside the jail (PEP 578); the jail holds without it

    def __post_init__(self) -> None:
        _check_range("wall_seconds", self.wall_seconds, 0.1, 600, (int, float))
        _check_range("cpu_seconds", self.cpu_seconds, 1, 600, (int,))
        _check_range("memory_mb", self.memory_mb, 64, 65536, (int,))
        _check_range("max_output_chars", self.max_output_chars, 100, 1_000_000, (int,))
        _check_range("max_processes", self.max_processes, 1, 4096, (int,))
        _check_range("scratch_mb", self.scratch_mb, 1, 4096, (int,))
        if self.jail not in JAILS:
            raise ValueError(f"env.sandbox.jail must be one of {JAILS}, got {self.jail!r}")
        if not os.path.realpath(self.python).startswith("/usr/"):
            raise ValueError(
                f"env.sandbox.python={self.python!r} must be an interpreter under /usr (the only host "
                "directory the jail binds), e.g. /usr/bin/python3"
            )
        if not isinstance(self.audit_hook, bool):
            raise ValueError(f"env.sandbox.audit_hook must be true or false, got {self.audit_hook!r}")

    @property
    def scratch_inodes(self) -> int:
        """The most files and directories the scratch tmpfs may hold (its nr_inodes)."""
        return self.scratch_mb * INODES_PER_MB


# The class's public path: Hydra's `_target_` (config.schema_of reads `__module__`) is part of the checkpoint
# fingerprint, and checkpoints written before the jail moved into this package name this path.
SandboxLimits.__module__ = "trace_lightning.envs.sandbox"


def _check_range(name: str, value: object, low: float, high: float, kinds: tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:  # type: ignore[operator]
        kind = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"env.sandbox.{name} must be a {kind} in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited 0 within the limits
    output: str  # stdout, at most max_output_chars
    error: str | None  # None when ok; else the timeout, the killing limit, or the stderr tail
    timed_out: bool
    exit_code: int | None  # negative: killed by that signal; None when the launcher itself was killed
    jailed: bool = True  # False only under jail="unsafe_no_jail_trusted_code_only"
