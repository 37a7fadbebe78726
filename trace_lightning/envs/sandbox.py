"""Run model-written Python in a separate, limited process and report what it printed.

Model text never runs in the trainer's process. `run_python` starts `python -I -S -B` on this very
file (the *launcher*, stdlib only) in a fresh scratch directory with a three-variable environment,
and the launcher forks the *worker* that runs the program. The layers, outermost first:

1. Kernel namespaces (needs root or CAP_SYS_ADMIN; skipped when `unshare` fails): a new network
   namespace (no interfaces but a down loopback, so no network, not even the trainer's localhost
   servers) and a new PID namespace (the worker is its PID 1: it cannot see or signal the trainer, and
   when it exits the kernel kills every process it left behind, daemons included).
2. rlimits on the worker: CPU seconds, address space, processes, file size (1 MiB), open files, no
   core dumps. RLIMIT_NPROC counts every process of the user and Linux does not enforce it for root,
   so fork bombs are also stopped by the audit hook, the PID namespace and the process-group kill.
3. Time: the launcher kills the worker at `wall_seconds`; the trainer kills the launcher's whole
   process group at `wall_seconds + 2` as a backstop, and always kills the group at the end.
4. An audit hook (PEP 578) in the worker, installed before the program runs, that refuses sockets,
   processes, signals (`os.kill(os.getppid(), 9)` would otherwise work for the same user), ctypes,
   writes outside the scratch directory, and reads outside it and the standard library (so
   `/etc/passwd` and token files in the home directory are refused). It is defence in depth, not a
   security boundary: Python code can get around audit hooks (monkeypatching the modules the hook
   uses, `os.open` with `dir_fd`, modules already loaded). Where namespaces are unavailable it is the
   only guard on network, signals and processes; on every machine it is the only guard on the
   filesystem, and as root a program that escapes it could write anywhere.

Output goes to unnamed files capped by RLIMIT_FSIZE, and at most `max_output_chars` of it is read
back. The standard library is all a program can import (`-S`: no site-packages).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, NoReturn

PROGRAM = "main.py"  # the program's file name in the scratch dir (what tracebacks show)
_MAX_FILE_BYTES = 2**20  # RLIMIT_FSIZE: stdout, stderr and any file the program writes
_MAX_OPEN_FILES = 64
_BACKSTOP_SECONDS = 2.0  # grace for interpreter start-up before the trainer kills the launcher
_TRUNCATED = "[output truncated]"
_CLONE_NEWNET, _CLONE_NEWPID = 0x40000000, 0x20000000
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use (config group `env.sandbox`)."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space, so it bounds every allocation, touched or not
    max_output_chars: int = 2000  # of stdout, and separately of the error (stderr tail)
    max_processes: int = 32  # RLIMIT_NPROC; counts all of the user's processes, not enforced for root

    def __post_init__(self) -> None:
        _check_range("wall_seconds", self.wall_seconds, 0.1, 600, (int, float))
        _check_range("cpu_seconds", self.cpu_seconds, 1, 600, (int,))
        _check_range("memory_mb", self.memory_mb, 64, 65536, (int,))
        _check_range("max_output_chars", self.max_output_chars, 100, 1_000_000, (int,))
        _check_range("max_processes", self.max_processes, 1, 4096, (int,))


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
    namespaces: bool = False  # the network and PID namespaces were in place


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a standalone program in the sandbox and return what it printed.

    Example: `run_python("print(6 * 7)")` gives `SandboxResult(ok=True, output="42\\n", ...)`, and
    `run_python("while True: pass")` returns after `wall_seconds` with `timed_out=True`.
    """
    return _run(code, limits)


def _run(
    code: str, limits: SandboxLimits, *, namespaces: bool = True, audit_hook: bool = True
) -> SandboxResult:
    """`run_python` with layers switchable, so tests can show each one holds on its own."""
    scratch = tempfile.mkdtemp(prefix=f"trace_sandbox_{os.getpid()}_")
    try:
        with open(os.path.join(scratch, PROGRAM), "w", encoding="utf-8") as program:
            program.write(code)
        # Unnamed files: the program cannot find them by name, and they vanish with their handles.
        with tempfile.TemporaryFile(dir=scratch) as out, tempfile.TemporaryFile(dir=scratch) as err:
            config = {"namespaces": namespaces, "audit_hook": audit_hook, **limits.__dict__}
            status = _spawn_and_wait(scratch, config, out, err)
            return _result(status, limits, out, err)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _spawn_and_wait(scratch: str, config: dict[str, Any], out: IO[bytes], err: IO[bytes]) -> dict[str, Any]:
    """Start the launcher, wait for it, kill its process group, and return its status report."""
    status_read, status_write = os.pipe()
    try:
        try:
            launcher = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)]
            proc = subprocess.Popen(
                [*launcher, str(status_write)],
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"},  # no inherited secrets
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(status_write,),
                start_new_session=True,  # its own process group, so the whole group can be killed
            )
        finally:
            os.close(status_write)
        exited = _exited_within(proc.pid, config["wall_seconds"] + _BACKSTOP_SECONDS)
        _kill_group(proc.pid)  # the launcher is not reaped yet, so its group id cannot have been reused
        proc.wait()
        report = _read_status(status_read)
        return report or {"timed_out": not exited, "exit_code": None, "namespaces": False, "cpu_seconds": 0.0}
    finally:
        os.close(status_read)


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


def _read_status(fd: int) -> dict[str, Any] | None:
    os.set_blocking(fd, False)  # a worker that outlived the launcher must not make us wait
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        return None
    return json.loads(data) if data else None


def _result(status: dict[str, Any], limits: SandboxLimits, out: IO[bytes], err: IO[bytes]) -> SandboxResult:
    timed_out, exit_code = bool(status["timed_out"]), status["exit_code"]
    ok = exit_code == 0 and not timed_out
    output = _read_bounded(out, limits.max_output_chars, tail=False)
    stderr = _read_bounded(err, limits.max_output_chars, tail=True)
    error = None if ok else _describe_failure(status, stderr, limits)
    return SandboxResult(ok, output, error, timed_out, exit_code, bool(status["namespaces"]))


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
    if exit_code is not None and exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return stderr.strip() or f"exit code {exit_code}"


def format_observation(result: SandboxResult) -> str:
    """The tool's reply to the model: what the program printed, then the error if it failed."""
    output = result.output.rstrip("\n")
    if result.ok:
        return f"<observation>{output or '(no output: print the values you need)'}</observation>"
    body = f"{output}\nerror: {result.error}" if output else f"error: {result.error}"
    return f"<observation>{body}</observation>"


# ---------------------------------------------------------------------------------------------------------
# Everything below runs inside the sandbox: first in the launcher, then in the worker it forks.


def _launch(config: dict[str, Any], status_fd: int) -> NoReturn:
    """Enter the namespaces, fork the worker, enforce the wall limit, and report to the trainer."""
    namespaces = config["namespaces"] and _libc_call("unshare", _CLONE_NEWNET | _CLONE_NEWPID) == 0
    worker = os.fork()  # with a new PID namespace, the worker is its PID 1
    if worker == 0:
        os.close(status_fd)
        os._exit(_worker(config, namespaces))
    ready = _exited_within(worker, config["wall_seconds"])
    if not ready:
        os.kill(worker, signal.SIGKILL)
    # Waiting on a namespace's PID 1 also waits until the kernel has killed everything inside it.
    _, wait_status, usage = os.wait4(worker, 0)
    report = {
        "timed_out": not ready,
        "exit_code": os.waitstatus_to_exitcode(wait_status),
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "namespaces": namespaces,
    }
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def _worker(config: dict[str, Any], namespaces: bool) -> int:
    try:
        if namespaces:
            os.setpgid(0, 0)  # its own group, so `kill(0, sig)` in the program cannot reach the launcher
        _libc_call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the launcher
        _set_limits(config)
        scratch = os.getcwd()
        if config["audit_hook"]:
            _disarm_modules()
            roots = tuple(os.path.realpath(p) for p in (scratch, *sys.path) if p)
            sys.addaudithook(_audit_hook(os.path.realpath(scratch), roots))
        return _run_program(PROGRAM)
    except BaseException:  # a bug in the sandbox itself: report it like a program error
        traceback.print_exc()
        return 1


def _libc_call(name: str, *args: int) -> int:
    """0 on success, else the errno. ctypes is imported here only, and removed before the program runs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if getattr(libc, name)(*args) == 0 else ctypes.get_errno()


def _set_limits(config: dict[str, Any]) -> None:
    cpu, memory, processes = config["cpu_seconds"], config["memory_mb"] * 2**20, config["max_processes"]
    # Hard = soft: SIGKILL at the limit. SIGXCPU would not do: a namespace's PID 1 ignores it.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_MAX_OPEN_FILES, _MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# Native code and process creation that have no audit event of their own: refused at import.
_BLOCKED_MODULES = frozenset(
    {"ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing"}
)
_BLOCKED_EVENTS = frozenset(
    {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen"}
    | {"os.kill", "os.killpg", "signal.pthread_kill"}  # the trainer runs as the same user
    | {"gc.get_objects", "gc.get_referrers", "gc.get_referents"}  # the way to find this hook and edit it
)
_BLOCKED_PREFIXES = ("socket.", "ctypes.")
_PATH_EVENTS = frozenset(
    {"os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.symlink", "os.link", "os.chmod", "os.chown"}
    | {"os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree", "os.mkfifo", "os.mknod"}
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _disarm_modules() -> None:
    """Drop modules the launcher loaded, so that the program must import them again (and is refused)."""
    for name in [m for m in sys.modules if m.partition(".")[0] in _BLOCKED_MODULES]:
        del sys.modules[name]
    # pidfd_open + pidfd_send_signal can signal a process with no audit event in Python 3.11.
    for module, attribute in ((os, "pidfd_open"), (signal, "pidfd_send_signal")):
        if hasattr(module, attribute):
            delattr(module, attribute)
    if hasattr(sys.modules["posix"], "pidfd_open"):
        del sys.modules["posix"].pidfd_open


def _audit_hook(scratch: str, read_roots: tuple[str, ...]) -> Callable[[str, tuple[Any, ...]], None]:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        reason = _refusal(event, args, scratch, read_roots)
        if reason is not None:
            raise PermissionError(f"blocked by the sandbox: {reason}")

    return hook


def _refusal(event: str, args: tuple[Any, ...], scratch: str, read_roots: tuple[str, ...]) -> str | None:
    """Why `event` is refused, or None. Writes may go to the scratch dir only, reads also to the stdlib."""
    if event in _BLOCKED_EVENTS or event.startswith(_BLOCKED_PREFIXES):
        return f"{event} (the sandbox has no network, subprocesses or signals)"
    if event == "import" and args[0].partition(".")[0] in _BLOCKED_MODULES:
        return f"import {args[0]}"
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            (flags or 0) & _WRITE_FLAGS
        )
        if writes and not _inside(path, (scratch,)):
            return f"writing {path!r} (only the working directory is writable)"
        if not _inside(path, read_roots):
            return f"reading {path!r} (only the working directory and the standard library are readable)"
    if event in _PATH_EVENTS and not all(_inside(a, (scratch,)) for a in args if isinstance(a, str | bytes)):
        return f"{event} outside the working directory"
    if event in ("os.listdir", "os.scandir") and not _inside("." if args[0] is None else args[0], read_roots):
        return f"listing {args[0]!r} (only the working directory is readable)"
    if event == "object.__setattr__" and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
        return f"setting {args[1]}"
    return None


def _inside(path: object, roots: tuple[str, ...]) -> bool:
    if isinstance(path, int):  # an already-open descriptor: it was checked when it was opened
        return True
    if not isinstance(path, str | bytes | os.PathLike):
        return False
    real = os.path.realpath(os.fsdecode(path))  # resolves "..", and symlinks pointing out of the root
    return any(real == root or real.startswith(root + os.sep) for root in roots)


def _run_program(path: str) -> int:
    """Run the program as `__main__` and return its exit code; tracebacks leave out this frame."""
    with open(path, encoding="utf-8") as file:
        source = file.read()
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(source, path, "exec"), main.__dict__)
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException as err:
        _print_traceback(err)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # e.g. the output file reached RLIMIT_FSIZE
            code = code or 120  # what Python itself exits with when flushing fails
    return code


def _print_traceback(err: BaseException) -> None:
    """The traceback without the sandbox's own frames (the launcher's `exec`, the audit hook)."""
    report: traceback.TracebackException | None = traceback.TracebackException.from_exception(err)
    top = report
    while report is not None:
        frames = [frame for frame in report.stack if frame.filename != __file__]
        report.stack = traceback.StackSummary.from_list(frames)
        report = report.__cause__ or report.__context__
    print("".join(top.format()) if top else "", end="", file=sys.stderr)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # `sys.exit("message")` prints the message and exits 1
    return 1


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]), int(sys.argv[2]))
