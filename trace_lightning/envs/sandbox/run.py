"""Run model-written Python in a bubblewrap jail, in a cgroup of its own, and report what it printed.

Model-written code is treated as hostile. `run_python` never runs it in the trainer's process: it starts
`bwrap` (see `jail.py` for what the jail isolates) around the system python in isolated mode (`-I -S -B`,
standard library only), which runs the launcher of `worker.py`; the launcher forks the worker that sets
the rlimits and runs the program. Before the launcher starts, bwrap waits (`--block-fd`) while the trainer
moves it into the call's cgroup (`cgroup.py`: memory, processes and CPU of the whole call) and caps the
scratch's files (`mounts.py`). stdout and stderr are pipes the trainer drains and bounds (`output.py`).
Time is bounded twice: the launcher kills the worker at `wall_seconds`, and the trainer kills the jail's
init (which takes every process of the jail's pid namespace with it) at `wall_seconds + 2` as a backstop.

Fail closed: where bwrap is missing or cannot build its namespaces, or no cgroup can be made for a call,
`check_sandbox` and `run_python` raise `JailUnavailableError` with the way to get one. Running without a
jail takes `jail="unsafe_no_jail_trusted_code_only"` and logs a warning on every call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trace_lightning.envs.sandbox import spawn, worker
from trace_lightning.envs.sandbox.cgroup import CallGroup, call_group
from trace_lightning.envs.sandbox.jail import (
    INSTALL_HINT,
    JAIL_UID,
    LAUNCHER,
    JailUnavailableError,
    bwrap_command,
    host_uid,
)
from trace_lightning.envs.sandbox.limits import EXTRA_PIDS, UNSAFE_NO_JAIL, SandboxLimits, SandboxResult
from trace_lightning.envs.sandbox.mounts import cap_scratch_inodes
from trace_lightning.envs.sandbox.spawn import BACKSTOP_SECONDS, Pipes

_PROBE = "import os; print(os.getuid(), os.geteuid(), os.statvfs('.').f_files)"
_log = logging.getLogger(__name__)


def check_sandbox(limits: SandboxLimits) -> None:
    """Refuse to start (JailUnavailableError) unless a program really runs jailed as uid 65534."""
    if limits.jail == UNSAFE_NO_JAIL:
        _warn_unjailed()
        return
    result = run_python(_PROBE, limits)
    uid, euid, files = [*result.output.split(), "", "", ""][:3]
    if (uid, euid) != (str(JAIL_UID), str(JAIL_UID)):
        raise JailUnavailableError(
            f"a probe program in the jail did not run as uid {JAIL_UID} (output {result.output!r}, "
            f"error {result.error!r}). To fix: {INSTALL_HINT}"
        )
    capped = files == str(limits.scratch_inodes)
    _log.info(
        "python tool: jailed, a cgroup per call (memory %d MB, %d processes, 1 CPU), scratch %d MB with %s",
        limits.memory_mb,
        limits.max_processes,
        limits.scratch_mb,
        f"at most {files} files"
        if capped
        else "no file cap (setting it takes a root trainer): the memory limit bounds its inodes",
    )


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a standalone program in the jail and return what it printed.

    Example: `run_python("print(6 * 7)")` gives `SandboxResult(ok=True, output="42\\n", ...)`, and
    `run_python("while True: pass")` returns after `wall_seconds` with `timed_out=True`.
    """
    jailed = limits.jail != UNSAFE_NO_JAIL
    try:
        program = code.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate: text no file or pipe can carry
        error = f"the program is not valid text: {err.reason} at character {err.start}; it did not run"
        return SandboxResult(False, "", error, False, None, jailed)
    if not jailed:
        _warn_unjailed()
        return _run_unjailed(program, limits)
    return _run_jailed(program, limits)


def _warn_unjailed() -> None:
    _log.warning(
        "env.sandbox.jail=%s: model-written code runs with NO jail, with the trainer's user and files. "
        "Use it for trusted code only.",
        UNSAFE_NO_JAIL,
    )


def _run_jailed(program: bytes, limits: SandboxLimits) -> SandboxResult:
    bwrap = shutil.which(limits.bwrap)
    if bwrap is None:
        raise JailUnavailableError(
            f"env.sandbox.bwrap={limits.bwrap!r} is not an executable: the python tool runs model-written "
            f"code only inside bubblewrap. To fix: {INSTALL_HINT}"
        )
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(call_group(limits.memory_mb * 2**20, limits.max_processes + EXTRA_PIDS))
        pipes = spawn.open_pipes(stack, limits.max_output_chars, jailed=True)
        fds = spawn.jail_files(stack, program)
        fds.update(info=pipes.child_ends["info"], block=pipes.child_ends["block"])
        command = [*bwrap_command(bwrap, limits.python, limits.scratch_mb * 2**20, fds), limits.python]
        command += ["-I", "-S", "-B", LAUNCHER, json.dumps(_worker_config(limits))]
        proc = spawn.start(command, "/", pipes, list(fds.values()), host_uid())
        stack.callback(spawn.reap, proc)
        deadline = time.monotonic() + limits.wall_seconds + BACKSTOP_SECONDS  # the trainer's own clock
        jail_init = _enter_group(proc.pid, pipes, group, limits, deadline)
        started, status = spawn.wait(proc.pid, pipes, deadline, jail_init)
        if not started and not (jail_init is not None and status["timed_out"]):
            # bwrap ended by itself before the launcher ran: the jail is broken. (A jail built but killed at
            # the deadline before its launcher ran, on a machine too loaded to start it, is a time-out.)
            raise JailUnavailableError(
                f"bubblewrap could not set up the jail or start env.sandbox.python={limits.python!r} in it: "
                f"{pipes.stderr.text(500).strip()!r}. To fix: {INSTALL_HINT}"
            )
        return _result(status, pipes, limits, oom_kills=group.oom_kills(), jailed=True)


def _enter_group(
    bwrap_pid: int, pipes: Pipes, group: CallGroup, limits: SandboxLimits, deadline: float
) -> int | None:
    """While bwrap waits on its block pipe, with the jail built but the launcher not started: move bwrap and
    the jail's init into the call's group (so all the program starts is born there), cap the scratch's
    files, then let it go. Returns the jail's init (host pid), or None if bwrap failed before making it;
    a bwrap that is not in the group is never let go (the wait then finds it killed, and never started)."""
    jail_init = spawn.jail_init(pipes.info, deadline)
    if jail_init is None:
        spawn.kill_group(bwrap_pid)
        return None
    group.add(bwrap_pid)
    group.add(jail_init)
    cap_scratch_inodes(jail_init, limits.scratch_inodes, deadline)
    with contextlib.suppress(BrokenPipeError):  # bwrap died in its set-up; the wait sees it
        os.write(pipes.block, b"go")
    return jail_init


def _run_unjailed(program: bytes, limits: SandboxLimits) -> SandboxResult:
    """The launcher straight on the host, in a temporary directory: rlimits and the audit hook only."""
    scratch = tempfile.mkdtemp(prefix=f"trace_unjailed_{os.getpid()}_")
    try:
        Path(scratch, worker.PROGRAM).write_bytes(program)
        with contextlib.ExitStack() as stack:
            pipes = spawn.open_pipes(stack, limits.max_output_chars, jailed=False)
            command = [sys.executable, "-I", "-S", "-B", worker.__file__, json.dumps(_worker_config(limits))]
            proc = spawn.start(command, scratch, pipes, [], None)
            stack.callback(spawn.reap, proc)
            deadline = time.monotonic() + limits.wall_seconds + BACKSTOP_SECONDS
            _, status = spawn.wait(proc.pid, pipes, deadline, None)
            return _result(status, pipes, limits, oom_kills=0, jailed=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _worker_config(limits: SandboxLimits) -> dict[str, Any]:
    keys = ("wall_seconds", "cpu_seconds", "memory_mb", "max_processes", "audit_hook")
    return {key: getattr(limits, key) for key in keys}


def _result(
    status: dict[str, Any], pipes: Pipes, limits: SandboxLimits, *, oom_kills: int, jailed: bool
) -> SandboxResult:
    timed_out, exit_code = bool(status["timed_out"]), status["exit_code"]
    ok = exit_code == 0 and not timed_out
    output = pipes.stdout.text(limits.max_output_chars)
    stderr = pipes.stderr.text(limits.max_output_chars)
    error = None if ok else describe_failure(status, stderr, limits, oom_kills)
    return SandboxResult(ok, output, error, timed_out, exit_code, jailed)


def describe_failure(status: dict[str, Any], stderr: str, limits: SandboxLimits, oom_kills: int = 0) -> str:
    """Why the program failed, for the model: any exit status or signal becomes a sentence.

    Example: a report `{"timed_out": False, "exit_code": -39, "cpu_seconds": 0.0}` (a real-time signal,
    which `signal.Signals` does not name) gives "killed by SIGRTMIN+5".
    """
    reason = _exit_reason(status, stderr, limits, oom_kills)
    if oom_kills and not reason.startswith("killed at the memory limit"):
        reason += f" ({oom_kills} of its processes were killed at the memory limit, {limits.memory_mb} MB)"
    return reason


def _exit_reason(status: dict[str, Any], stderr: str, limits: SandboxLimits, oom_kills: int) -> str:
    exit_code = status["exit_code"]
    if status["timed_out"]:
        return f"timed out after {limits.wall_seconds:g} s"
    if oom_kills and (exit_code is None or exit_code < 0):
        return (
            f"killed at the memory limit ({limits.memory_mb} MB for the whole call: its processes, files in "
            "scratch, shared memory and kernel memory)"
        )
    # rusage samples CPU time more coarsely than the rlimit check, so it may read a little short.
    if exit_code == -signal.SIGKILL and status["cpu_seconds"] >= 0.8 * limits.cpu_seconds:
        return f"killed at the CPU time limit ({limits.cpu_seconds} s)"
    if exit_code is None:
        return "the jail's launcher was killed before it could report (the program may have killed it)"
    if exit_code < 0:
        return f"killed by {signal_name(-exit_code)}"
    return stderr.strip() or f"exit code {exit_code}"


def signal_name(number: int) -> str:
    """ "SIGKILL" for 9, "SIGRTMIN+5" for 39 on Linux, "signal 200" for a number no signal has."""
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    if signal.SIGRTMIN < number < signal.SIGRTMAX:
        return f"SIGRTMIN+{number - signal.SIGRTMIN}"
    return f"signal {number}"


def format_observation(result: SandboxResult) -> str:
    """The tool's reply to the model: what the program printed, then the error if it failed."""
    output = result.output.rstrip("\n")
    if result.ok:
        return f"<observation>{output or '(no output: print the values you need)'}</observation>"
    body = f"{output}\nerror: {result.error}" if output else f"error: {result.error}"
    return f"<observation>{body}</observation>"
