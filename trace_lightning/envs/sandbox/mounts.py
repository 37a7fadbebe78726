"""What the jail's file system shows of the host, and the scratch's file cap.

- `/proc`: a new procfs shows the jail's own processes, but its top-level files are host-wide: the kernel
  command line, disk counters, interrupts, slab and zone figures, lock tables, and under `/proc/sys` the
  boot id and every sysctl. `proc_masks` hides all of them (an empty read-only file or folder over each)
  but the jail's own entries: `self`, `thread-self`, `net` and `sysvipc` (its own namespaces), `mounts`.
- `/usr`: bound read-only for the interpreter and its libraries; `/usr/local`, `/usr/etc` and the Python
  package folders (Debian's dist-packages) are hidden under empty folders (`usr_masks`).
- `/scratch`: bubblewrap sizes a tmpfs but has no option for its number of files, so the trainer sets
  `nr_inodes` itself while bwrap waits to start the program (`cap_scratch_inodes`).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import time

SCRATCH = "/scratch"
_JAIL_OWN = frozenset({"self", "thread-self", "net", "sysvipc", "mounts"})  # namespaced, or the jail's
_PYTHON_PACKAGES = (
    "/usr/lib/python3*/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/usr/lib64/python3*/site-packages",
)
_FSPICK, _FSCONFIG = 433, 431  # the same numbers on every architecture (Linux >= 5.2)
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_RECONFIGURE, _FSPICK_CLOEXEC = 1, 7, 1
_AT_FDCWD = -100
_log = logging.getLogger(__name__)


@functools.cache
def proc_masks() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders, files) of /proc to hide in the jail: every top-level entry but processes and the jail's own.

    Read from the trainer's /proc (the same kernel as the jail's), e.g. `/proc/cmdline`, `/proc/diskstats`,
    `/proc/sys` (the boot id, sysctls).
    """
    dirs: list[str] = []
    files: list[str] = []
    for name in sorted(os.listdir("/proc")):
        path = f"/proc/{name}"
        if name.isdigit() or name in _JAIL_OWN or os.path.islink(path):
            continue
        (dirs if os.path.isdir(path) else files).append(path)
    return tuple(dirs), tuple(files)


def usr_masks(python: str) -> tuple[str, ...]:
    """bwrap arguments hiding /usr/local, /usr/etc and Python package folders under empty read-only folders,
    except where the jail's interpreter lives."""
    interpreter = os.path.realpath(python)
    candidates = ["/usr/local", "/usr/etc"]
    for pattern in _PYTHON_PACKAGES:
        candidates += sorted(glob.glob(pattern))
    hidden = [path for path in candidates if os.path.isdir(path) and not interpreter.startswith(path + "/")]
    return tuple(arg for path in hidden for arg in ("--tmpfs", path, "--remount-ro", path))


def cap_scratch_inodes(child: int, inodes: int, deadline: float) -> bool:
    """Set the jail's scratch tmpfs to at most `inodes` files (its nr_inodes), reached through
    /proc/<child>/root while bwrap waits on its block fd; True when it is set.

    It takes CAP_SYS_ADMIN (a trainer running as root): elsewhere it returns False, and the scratch's files
    are bounded by the call's cgroup memory alone (a tmpfs file costs about 1 KiB of kernel memory, charged
    to the call).
    """
    if os.geteuid() != 0:
        return False
    scratch = _jail_scratch(child, deadline)
    if scratch is None:
        return False  # bwrap failed before it reached its final root; the caller sees it exit
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_FSPICK, _AT_FDCWD, scratch.encode(), _FSPICK_CLOEXEC)
    if fd < 0:
        _log.debug("fspick on the jail's scratch: errno %d", ctypes.get_errno())
        return False
    try:
        value = str(inodes).encode()
        done = libc.syscall(_FSCONFIG, fd, _FSCONFIG_SET_STRING, b"nr_inodes", value, 0) == 0
        return done and bool(libc.syscall(_FSCONFIG, fd, _FSCONFIG_CMD_RECONFIGURE, None, None, 0) == 0)
    finally:
        os.close(fd)


def _jail_scratch(child: int, deadline: float) -> str | None:
    """/proc/<child>/root/scratch once the jail's init has its final root (not the host's, with the program
    in place), or None if it exits first or `deadline` (time.monotonic) passes."""
    host_root = os.stat("/")
    while time.monotonic() < deadline:
        try:
            root = os.stat(f"/proc/{child}/root")
            if (root.st_dev, root.st_ino) != (host_root.st_dev, host_root.st_ino):
                os.stat(f"/proc/{child}/root{SCRATCH}/main.py")
                return f"/proc/{child}/root{SCRATCH}"
        except OSError:  # not there yet, or the process is gone
            if not os.path.exists(f"/proc/{child}"):
                return None
        time.sleep(0.001)
    return None
