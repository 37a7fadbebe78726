"""Run model-written Python in a bubblewrap jail and report what it printed.

Model-written code is treated as hostile. `run_python` never runs it in the trainer's process: it
starts `bwrap` (see `jail.py` for what the jail isolates) around the system python in isolated mode
(`-I -S -B`, standard library only), which runs the launcher of `sandbox_worker.py`; the launcher forks
the worker that sets the rlimits and runs the program. Time is bounded twice: the launcher kills the
worker at `wall_seconds`, and the trainer kills the jail's init (which takes every process of the
jail's pid namespace with it) at `wall_seconds + 2` as a backstop.

Fail closed: where bwrap is missing or cannot build its namespaces, `check_sandbox` and `run_python`
raise `JailUnavailableError` with the way to get one. Running without a jail takes
`jail="unsafe_no_jail_trusted_code_only"` and logs a warning on every call.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trace_lightning.envs import sandbox_worker
from trace_lightning.envs.jail import (
    INSTALL_HINT,
    JAIL_UID,
    LAUNCHER,
    JailUnavailableError,
    bwrap_command,
    host_uid,
    seccomp_program,
)

UNSAFE_NO_JAIL = "unsafe_no_jail_trusted_code_only"
JAILS = ("bwrap", UNSAFE_NO_JAIL)
_BACKSTOP_SECONDS = 2.0  # grace for jail and interpreter start-up before the trainer kills the jail
_TRUNCATED = "[output truncated]"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use, and the jail it runs in (config group `env.sandbox`)."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space, so it bounds every allocation, touched or not
    max_output_chars: int = 2000  # of stdout, and separately of the error (stderr tail)
    max_processes: int = 32  # RLIMIT_NPROC of the jail's (non-root) user
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


def check_sandbox(limits: SandboxLimits) -> None:
    """Refuse to start (JailUnavailableError) unless a program really runs jailed as uid 65534."""
    if limits.jail == UNSAFE_NO_JAIL:
        _warn_unjailed()
        return
    result = run_python("import os; print(os.getuid(), os.geteuid())", limits)
    if result.output != f"{JAIL_UID} {JAIL_UID}\n":
        raise JailUnavailableError(
            f"a probe program in the jail did not run as uid {JAIL_UID} (output {result.output!r}, "
            f"error {result.error!r}). To fix: {INSTALL_HINT}"
        )


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a standalone program in the jail and return what it printed.

    Example: `run_python("print(6 * 7)")` gives `SandboxResult(ok=True, output="42\\n", ...)`, and
    `run_python("while True: pass")` returns after `wall_seconds` with `timed_out=True`.
    """
    if limits.jail == UNSAFE_NO_JAIL:
        _warn_unjailed()
        return _run_unjailed(code, limits)
    return _run_jailed(code, limits)


def _warn_unjailed() -> None:
    _log.warning(
        "env.sandbox.jail=%s: model-written code runs with NO jail, with the trainer's user and files. "
        "Use it for trusted code only.",
        UNSAFE_NO_JAIL,
    )


def _run_jailed(code: str, limits: SandboxLimits) -> SandboxResult:
    bwrap = shutil.which(limits.bwrap)
    if bwrap is None:
        raise JailUnavailableError(
            f"env.sandbox.bwrap={limits.bwrap!r} is not an executable: the python tool runs model-written "
            f"code only inside bubblewrap. To fix: {INSTALL_HINT}"
        )
    with contextlib.ExitStack() as stack:
        out, err = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(2))
        sources = {"launcher": _launcher_source(), "program": code.encode(), "seccomp": seccomp_program()}
        fds = {name: stack.enter_context(_memfd(name, data)) for name, data in sources.items()}
        info_read, fds["info"] = os.pipe()
        stack.callback(os.close, info_read)
        command = [*bwrap_command(bwrap, limits.python, limits.scratch_mb * 2**20, fds), limits.python]
        command += ["-I", "-S", "-B", LAUNCHER, json.dumps(_worker_config(limits))]
        started, status = _spawn_and_wait(command, "/", limits, out, err, fds, info_read)
        if not started:
            raise JailUnavailableError(
                f"bubblewrap could not set up the jail or start env.sandbox.python={limits.python!r} in it: "
                f"{_read_bounded(err, 500, tail=True).strip()!r}. To fix: {INSTALL_HINT}"
            )
        return _result(status, limits, out, err, jailed=True)


def _run_unjailed(code: str, limits: SandboxLimits) -> SandboxResult:
    """The launcher straight on the host, in a temporary directory: rlimits and the audit hook only."""
    scratch = tempfile.mkdtemp(prefix=f"trace_unjailed_{os.getpid()}_")
    try:
        Path(scratch, sandbox_worker.PROGRAM).write_text(code, encoding="utf-8")
        with tempfile.TemporaryFile(dir=scratch) as out, tempfile.TemporaryFile(dir=scratch) as err:
            command = [
                sys.executable,
                "-I",
                "-S",
                "-B",
                sandbox_worker.__file__,
                json.dumps(_worker_config(limits)),
            ]
            _, status = _spawn_and_wait(command, scratch, limits, out, err, {}, None)
            return _result(status, limits, out, err, jailed=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _worker_config(limits: SandboxLimits) -> dict[str, Any]:
    keys = ("wall_seconds", "cpu_seconds", "memory_mb", "max_processes", "audit_hook")
    return {key: getattr(limits, key) for key in keys}


@functools.cache
def _launcher_source() -> bytes:
    return Path(sandbox_worker.__file__).read_bytes()


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


def _spawn_and_wait(
    command: list[str],
    cwd: str,
    limits: SandboxLimits,
    out: IO[bytes],
    err: IO[bytes],
    fds: dict[str, int],
    info_read: int | None,
) -> tuple[bool, dict[str, Any]]:
    """Start the command, wait for it (at most wall + backstop), leave nothing of it alive.

    Returns whether the launcher started, and its report (or what the trainer saw when it had none).
    """
    status_read, status_write = os.pipe()
    uid = host_uid() if info_read is not None else None  # the unjailed launcher keeps the trainer's user
    try:
        try:
            proc = subprocess.Popen(
                [*command, str(status_write)],
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"},  # no inherited secrets
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(status_write, *fds.values()),
                start_new_session=True,  # its own process group, so the whole group can be killed
                user=uid,
                group=uid,
                extra_groups=None if uid is None else [],
            )
        except OSError as err:  # e.g. a bwrap that the jail's host user (nobody) may not execute
            raise JailUnavailableError(
                f"could not start {command[0]!r}: {err}. To fix: {INSTALL_HINT}"
            ) from err
        finally:
            os.close(status_write)
            if "info" in fds:
                os.close(fds.pop("info"))
        exited = _exited_within(proc.pid, limits.wall_seconds + _BACKSTOP_SECONDS)
        if not exited and info_read is not None:
            _kill_jail_init(info_read)  # bwrap then exits: its child, the jail's init, is gone
            _exited_within(proc.pid, _BACKSTOP_SECONDS)
        _kill_group(proc.pid)  # the leader is not reaped yet, so its group id cannot have been reused
        proc.wait()
        data = _read_available(status_read)
        started = data.startswith(sandbox_worker.STARTED)
        return started, _parse_report(data[len(sandbox_worker.STARTED) :], exited)
    finally:
        os.close(status_read)


def _parse_report(data: bytes, exited: bool) -> dict[str, Any]:
    """The launcher's report; a missing or malformed one (the program can reach the pipe through
    /proc/<launcher>/fd) reads as "killed before it reported"."""
    with contextlib.suppress(ValueError):
        report = json.loads(data)
        if isinstance(report, dict) and set(report) == {"timed_out", "exit_code", "cpu_seconds"}:
            types_ok = isinstance(report["exit_code"], int) and isinstance(report["cpu_seconds"], float | int)
            if types_ok and isinstance(report["timed_out"], bool):
                return report
    return {"timed_out": not exited, "exit_code": None, "cpu_seconds": 0.0}


def _kill_jail_init(info_read: int) -> None:
    """SIGKILL the jail's pid-1 (bwrap writes its host pid to --info-fd); the kernel then kills the rest."""
    with contextlib.suppress(ValueError, KeyError, ProcessLookupError):
        info = json.loads(_read_available(info_read) or b"{}")
        # bwrap waits on its child, so this pid is not reaped (and not reused) while bwrap lives.
        os.kill(int(info["child-pid"]), signal.SIGKILL)


def _exited_within(pid: int, seconds: float) -> bool:
    """Wait for `pid` to exit without reaping it (a pidfd becomes readable when its process exits)."""
    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()  # not select.select: a trainer may hold more than 1024 descriptors
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(seconds * 1000))
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)


def _read_available(fd: int) -> bytes:
    """What the pipe holds now (all writers are gone or dead, so nothing more is coming)."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _result(
    status: dict[str, Any], limits: SandboxLimits, out: IO[bytes], err: IO[bytes], *, jailed: bool
) -> SandboxResult:
    timed_out, exit_code = bool(status["timed_out"]), status["exit_code"]
    ok = exit_code == 0 and not timed_out
    output = _read_bounded(out, limits.max_output_chars, tail=False)
    stderr = _read_bounded(err, limits.max_output_chars, tail=True)
    error = None if ok else _describe_failure(status, stderr, limits)
    return SandboxResult(ok, output, error, timed_out, exit_code, jailed)


def _read_bounded(file: IO[bytes], max_chars: int, *, tail: bool) -> str:
    """At most `max_chars` characters of the head (stdout) or the tail (stderr) of `file`."""
    size = os.fstat(file.fileno()).st_size
    budget = 4 * max_chars  # a UTF-8 character takes at most 4 bytes
    file.seek(max(0, size - budget) if tail else 0)
    text = file.read(budget).decode("utf-8", errors="replace")
    if size <= budget and len(text) <= max_chars:
        return text
    keep = max_chars - len(_TRUNCATED) - 1
    return f"{_TRUNCATED}\n{text[-keep:]}" if tail else f"{text[:keep]}\n{_TRUNCATED}"


def _describe_failure(status: dict[str, Any], stderr: str, limits: SandboxLimits) -> str:
    exit_code = status["exit_code"]
    if status["timed_out"]:
        return f"timed out after {limits.wall_seconds:g} s"
    # rusage samples CPU time more coarsely than the rlimit check, so it may read a little short.
    if exit_code == -signal.SIGKILL and status["cpu_seconds"] >= 0.8 * limits.cpu_seconds:
        return f"killed at the CPU time limit ({limits.cpu_seconds} s)"
    if exit_code is None:
        return "the jail's launcher was killed before it could report (the program may have killed it)"
    if exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return stderr.strip() or f"exit code {exit_code}"


def format_observation(result: SandboxResult) -> str:
    """The tool's reply to the model: what the program printed, then the error if it failed."""
    output = result.output.rstrip("\n")
    if result.ok:
        return f"<observation>{output or '(no output: print the values you need)'}</observation>"
    body = f"{output}\nerror: {result.error}" if output else f"error: {result.error}"
    return f"<observation>{body}</observation>"
