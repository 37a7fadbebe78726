"""The launcher and the worker: the part of the sandbox that runs model-written code (stdlib only).

`run.py` starts `python -I -S -B` on this file (inside the bubblewrap jail it is copied to
`/jail/launcher.py`; nothing else of the checkout is visible there). The launcher forks the *worker*,
kills it at `wall_seconds`, and reports how it ended on a status pipe: one byte when it starts (so the
trainer can tell a jail that failed to start from a program that failed), then a JSON report.

The worker sets the rlimits (CPU, address space, processes, file size, open files, no core dumps) and,
unless `audit_hook` is false, installs an audit hook (PEP 578) before the program runs. The hook is a
second layer only: Python code can get around it (frames, `dir_fd`, monkeypatching), and the tests
show the jail holds with the hook switched off.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

PROGRAM = "main.py"  # the program's file name in the scratch dir (what tracebacks show)
MAX_FILE_BYTES = 2**20  # RLIMIT_FSIZE: any one file the program writes (stdout and stderr are pipes)
STARTED = b"S"  # the launcher's first byte on the status pipe
_MAX_OPEN_FILES = 64
_PR_SET_PDEATHSIG = 1


def _launch(config: dict[str, Any], status_fd: int) -> NoReturn:
    """Fork the worker, enforce the wall limit, and report to the trainer."""
    os.write(status_fd, STARTED)
    worker = os.fork()
    if worker == 0:
        os.close(status_fd)
        os._exit(_worker(config))
    ready = _exited_within(worker, config["wall_seconds"])
    if not ready:
        os.kill(worker, signal.SIGKILL)
    _, wait_status, usage = os.wait4(worker, 0)
    report = {
        "timed_out": not ready,
        "exit_code": os.waitstatus_to_exitcode(wait_status),
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    }
    os.write(status_fd, json.dumps(report).encode())
    # In the jail this process is the pid namespace's init (bwrap --as-pid-1): as it exits, the kernel
    # kills and reaps what the program left, daemons included. Orphans are reparented to it and stay
    # zombies until then (counted by RLIMIT_NPROC, which only bounds the program further).
    os._exit(0)


def _exited_within(pid: int, seconds: float) -> bool:
    """Wait for `pid` to exit without reaping it (a pidfd becomes readable when its process exits)."""
    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(seconds * 1000))
    finally:
        os.close(fd)


def _worker(config: dict[str, Any]) -> int:
    try:
        os.setpgid(0, 0)  # its own group, so `kill(0, sig)` in the program does not reach the launcher
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
    # Hard = soft: SIGKILL at the limit, which no handler can catch.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # Counts the jail user's processes in the jail's user namespace; binds because that user is not root.
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
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
        except OSError:  # e.g. the trainer closed a pipe after reading its cap
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
