"""Starting one call's processes with their files and pipes, and waiting for them to end.

`run.py` decides what runs; this module does the plumbing: the pipes (stdout, stderr, the launcher's status
report, and for the jail bwrap's --info-fd and --block-fd), the in-memory files bwrap reads, the start as
the jail's host user, and the wait that drains the pipes and, past `wall_seconds + 2`, kills the jail.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lightning.envs.sandbox import worker
from trace_lightning.envs.sandbox.jail import INSTALL_HINT, JailUnavailableError, seccomp_program
from trace_lightning.envs.sandbox.mounts import proc_masks
from trace_lightning.envs.sandbox.output import Capture, drain, read_available

BACKSTOP_SECONDS = 2.0  # grace for jail and interpreter start-up before the trainer kills the jail


@dataclass
class Pipes:
    """The pipes of one call. The trainer keeps the read ends of stdout, stderr, the launcher's status and
    bwrap's info report, and the write end of bwrap's block pipe; `child_ends` go to the child process.
    Each descriptor is closed exactly once (a number closed twice may already be another thread's file)."""

    stdout: Capture
    stderr: Capture
    status: int
    info: int  # -1 unjailed
    block: int  # -1 unjailed
    child_ends: dict[str, int]  # stdout, stderr, status (+ info, block): what the child gets

    @classmethod
    def open(cls, keep: int, *, jailed: bool) -> Pipes:
        """Pipes whose captures keep `keep` bytes each (stdout's head, stderr's tail)."""
        names = ("stdout", "stderr", "status", *(("info", "block") if jailed else ()))
        ends = {name: os.pipe() for name in names}
        child = {name: ends[name][1] for name in ("stdout", "stderr", "status", "info") if name in ends}
        if jailed:
            child["block"] = ends["block"][0]  # bwrap reads it; the trainer writes
        stdout = Capture(ends["stdout"][0], keep, tail=False)
        stderr = Capture(ends["stderr"][0], keep, tail=True)
        info, block = (ends["info"][0], ends["block"][1]) if jailed else (-1, -1)
        return cls(stdout, stderr, ends["status"][0], info, block, child)

    def close_child_ends(self) -> None:
        for fd in self.child_ends.values():
            os.close(fd)
        self.child_ends = {}

    def close(self) -> None:
        self.close_child_ends()
        self.stdout.close()
        self.stderr.close()
        for fd in (self.status, self.info, self.block):
            if fd >= 0:
                os.close(fd)
        self.status = self.info = self.block = -1


def open_pipes(stack: contextlib.ExitStack, max_output_chars: int, *, jailed: bool) -> Pipes:
    pipes = Pipes.open(4 * max_output_chars, jailed=jailed)  # a UTF-8 character takes at most 4 bytes
    stack.callback(pipes.close)
    return pipes


def jail_files(stack: contextlib.ExitStack, program: bytes) -> dict[str, int]:
    """In-memory files bwrap reads: the launcher, the program, the seccomp filter, and an empty file per
    masked /proc file (bwrap closes each after reading it)."""
    sources = {"launcher": launcher_source(), "program": program, "seccomp": seccomp_program()}
    fds = {name: stack.enter_context(_memfd(name, data)) for name, data in sources.items()}
    for path in proc_masks()[1]:
        fds[f"mask:{path}"] = stack.enter_context(_memfd("empty", b""))
    return fds


@functools.cache
def launcher_source() -> bytes:
    return Path(worker.__file__).read_bytes()


@contextlib.contextmanager
def _memfd(name: str, data: bytes) -> Any:
    """An anonymous in-memory file holding `data`, read by bwrap from its start."""
    fd = os.memfd_create(f"trace-{name}")
    try:
        view = memoryview(data)
        while view:  # a write may be partial
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def start(
    command: list[str], cwd: str, pipes: Pipes, fds: list[int], uid: int | None
) -> subprocess.Popen[bytes]:
    """Start the command with the pipes' child ends (closed here once the child has them)."""
    ends = pipes.child_ends
    try:
        return subprocess.Popen(
            [*command, str(ends["status"])],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"},  # no inherited secrets
            stdin=subprocess.DEVNULL,
            stdout=ends["stdout"],
            stderr=ends["stderr"],
            pass_fds=(ends["status"], *fds),
            start_new_session=True,  # its own process group, so the whole group can be killed
            user=uid,
            group=uid,
            extra_groups=None if uid is None else [],
        )
    except OSError as err:  # e.g. a bwrap that the jail's host user (nobody) may not execute
        raise JailUnavailableError(f"could not start {command[0]!r}: {err}. To fix: {INSTALL_HINT}") from err
    finally:
        pipes.close_child_ends()  # the child has its copies; ours would keep the pipes open forever


def jail_init(info: int, deadline: float) -> int | None:
    """The host pid of the jail's init, from bwrap's --info-fd report; None if bwrap ends without one
    before `deadline` (time.monotonic)."""
    poller = select.poll()
    poller.register(info, select.POLLIN)
    data = b""
    while not data.rstrip().endswith(b"}"):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(info, 4096)
        if not chunk:  # bwrap exited before it made the jail
            return None
        data += chunk
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return int(json.loads(data)["child-pid"])
    return None


def wait(pid: int, pipes: Pipes, deadline: float, jail_init: int | None) -> tuple[bool, dict[str, Any]]:
    """Drain the pipes until the launcher's process exits (at most until `deadline`, wall + backstop from its
    start; then the jail's init is killed, which ends the jail). Returns whether the launcher started, and
    its report (or what the trainer saw when it had none)."""
    process_fd = os.pidfd_open(pid)
    try:
        captures = [pipes.stdout, pipes.stderr]
        exited = drain(process_fd, captures, deadline - time.monotonic())
        if not exited:
            if jail_init is not None:
                _kill(jail_init)  # bwrap waits on it, so the pid is not reaped (nor reused) while bwrap lives
            kill_group(pid)
            drain(process_fd, captures, BACKSTOP_SECONDS)
    finally:
        os.close(process_fd)
    data = read_available(pipes.status)
    started = data.startswith(worker.STARTED)
    return started, _parse_report(data[len(worker.STARTED) :], exited)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Leave nothing of the call alive: its process group, then the process itself."""
    kill_group(proc.pid)
    proc.wait()


def _parse_report(data: bytes, exited: bool) -> dict[str, Any]:
    """The launcher's report; a missing or malformed one (the program can reach the pipe through
    /proc/<launcher>/fd) reads as "killed before it reported"."""
    with contextlib.suppress(ValueError):
        report = json.loads(data)
        if isinstance(report, dict) and set(report) == {"timed_out", "exit_code", "cpu_seconds"}:
            exit_code, cpu = report["exit_code"], report["cpu_seconds"]
            numbers_ok = type(exit_code) is int and type(cpu) in (int, float)  # not bool, not nan-strings
            if numbers_ok and isinstance(report["timed_out"], bool):
                return report
    return {"timed_out": not exited, "exit_code": None, "cpu_seconds": 0.0}


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group a call's process leads (it has its own session). Call it before the leader
    is reaped: until then its group id cannot have been reused."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)
