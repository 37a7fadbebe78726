"""One cgroup per call of the python tool: memory, processes and CPU bounded for the whole call.

rlimits bind each process alone, so 12 children held 2.4 GiB, SysV shared memory held 1.2 GiB that no
process counted, and 781,000 empty files grew kernel memory by 780 MiB. A cgroup binds them together:
bwrap and the jail's init are moved into a group of their own before the program starts (bwrap waits on
`--block-fd`), so everything the program starts is born there. The group holds
- memory: `memory_mb` for all of it: anonymous memory, shared memory (SysV, memfd, mmap), the scratch
  tmpfs's pages, pipes, and the kernel memory charged with them (inodes, dentries). Measured on this
  project's cgroup v1 hosts (kernel 6.18): kernel memory counts in `memory.usage_in_bytes` (an inode flood
  in a 64 MiB group was OOM-killed at 64 MiB), while `memory.kmem.limit_in_bytes` accepts writes and
  ignores them. TCP buffers are counted apart (`memory.kmem.tcp.*`, active once a limit is set): 14
  processes filling loopback connections held 440 MiB there, so they get an eighth of `memory_mb` more;
- pids: `max_processes`, plus bwrap and the launcher;
- cpu: one core (quota = period), whatever the number of processes.

Both versions: under cgroup v1 (a hierarchy per controller) the group goes below the trainer's own group
in each of the memory, pids and cpu hierarchies (which needs root); under v2 (one hierarchy, delegated
to the trainer) below the trainer's delegated group (`_v2_parent`). Where neither can be used,
`CgroupUnavailableError` says how to get one, and the tool refuses to run (fail closed, like the jail).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trace_lightning.envs.sandbox.jail import JailUnavailableError

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000  # cpu quota = period: one core
TCP_SHARE = 8  # v1: TCP buffers get memory_mb / 8 on top of memory_mb (v2 counts them within it)
PREFIX = "trace-call-"  # the per-call groups: trace-call-<trainer pid>-<random>
TRAINER_LEAF = "trace-trainer"  # v2: the leaf the trainer moves into, so its group can have children
_KILL_SECONDS = 2.0
HINT = (
    "the python tool runs each program in a cgroup of its own, which it creates below the trainer's cgroup. "
    "On a cgroup v2 host, start the trainer alone in a delegated group with the memory, pids and cpu "
    "controllers, e.g. `systemd-run --user --scope -p Delegate=yes python -m trace_lightning.trainer ...` "
    "(in a container: a private cgroup namespace with a writable /sys/fs/cgroup); on a cgroup v1 host run "
    "the trainer as root. Only for trusted code: env.sandbox.jail=unsafe_no_jail_trusted_code_only runs "
    "it with no jail and no cgroup at all"
)
_log = logging.getLogger(__name__)


class CgroupUnavailableError(JailUnavailableError):
    """No cgroup can be made for a call here, so the python tool refuses to run model-written code."""


@dataclass(frozen=True)
class OwnGroups:
    """The trainer's own cgroup in each hierarchy, as directories (None where it cannot be reached)."""

    v1: dict[str, Path]  # controller -> the trainer's group in that controller's v1 hierarchy
    v2: Path | None  # the trainer's group in the v2 hierarchy


def own_groups(mountinfo: str, proc_cgroup: str) -> OwnGroups:
    """Where the trainer's groups are, from /proc/self/mountinfo and /proc/self/cgroup.

    Example: mountinfo line `35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory` and cgroup
    line `4:memory:/process_api/abc` give `v1["memory"] = /sys/fs/cgroup/memory/process_api/abc`.
    """
    v1_paths: dict[str, str] = {}
    v2_path = None
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            v2_path = path
        for controller in filter(None, controllers.split(",")):
            v1_paths[controller] = path
    v1: dict[str, Path] = {}
    v2 = None
    for mount_root, mount_point, fstype, options in _mounts(mountinfo):
        if fstype == "cgroup":
            for controller in set(options.split(",")) & set(CONTROLLERS) & set(v1_paths):
                reached = _below(mount_point, mount_root, v1_paths[controller])
                if reached is not None:
                    v1[controller] = reached
        elif fstype == "cgroup2" and v2_path is not None:
            v2 = _below(mount_point, mount_root, v2_path) or v2
    return OwnGroups(v1, v2)


def _mounts(mountinfo: str) -> Iterator[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of each line of a mountinfo file (proc(5))."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            yield _unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2]


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _below(mount_point: str, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup `path` in a hierarchy mounted at `mount_point` from `mount_root`."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None  # outside what this mount shows (another cgroup namespace)
    return Path(mount_point, path[len(root) :].lstrip("/"))


@dataclass(frozen=True)
class CallGroup:
    """The cgroup of one call: one directory per hierarchy (v1: memory, pids, cpu; v2: one)."""

    dirs: tuple[Path, ...]
    version: int

    def add(self, pid: int) -> None:
        """Move process `pid` into the group (in every hierarchy)."""
        try:
            for directory in self.dirs:
                _write(directory / "cgroup.procs", str(pid))
        except OSError as err:
            raise CgroupUnavailableError(
                f"could not move the jail into {self.dirs}: {err}. To fix: {HINT}"
            ) from err

    def oom_kills(self) -> int:
        """How many processes the kernel killed at the group's memory limit (0 if it cannot tell)."""
        memory = self.dirs[0]
        try:
            text = _read(memory / ("memory.oom_control" if self.version == 1 else "memory.events"))
        except OSError:
            return 0
        found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(found.group(1)) if found else 0

    def close(self) -> None:
        """Kill whatever is left in the group and remove it; a failure is logged, never raised."""
        try:
            if not self._kill_all():
                _log.warning("processes of the python tool's cgroup %s survived SIGKILL", self.dirs[0])
            for directory in self.dirs:
                _remove(directory)
        except OSError as err:
            _log.warning("could not remove the python tool's cgroup %s: %s", self.dirs[0], err)

    def _kill_all(self) -> bool:
        kill_file = self.dirs[0] / "cgroup.kill"  # v2, Linux >= 5.14: the whole group at once
        if self.version == 2 and kill_file.exists():
            _write(kill_file, "1")
        deadline = time.monotonic() + _KILL_SECONDS
        while pids := _pids(self.dirs[0]):
            for pid in pids:  # each was listed in the group just now: it is the jail's, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


@contextlib.contextmanager
def call_group(memory_bytes: int, max_pids: int) -> Iterator[CallGroup]:
    """A fresh cgroup for one call, removed (with anything left in it) on exit."""
    group = create_group(memory_bytes, max_pids, _own_groups())
    try:
        yield group
    finally:
        group.close()


def _own_groups() -> OwnGroups:
    return own_groups(_read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")))


def create_group(memory_bytes: int, max_pids: int, own: OwnGroups) -> CallGroup:
    """Make a call's group below the trainer's own (v2 where it has our controllers, else v1)."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if own.v2 is not None and set(CONTROLLERS) <= _controllers(own.v2):
            return _make_v2(_v2_parent(own.v2) / name, memory_bytes, max_pids)
        if set(CONTROLLERS) <= set(own.v1):
            return _make_v1({c: own.v1[c] / name for c in CONTROLLERS}, memory_bytes, max_pids)
    except OSError as err:
        raise CgroupUnavailableError(f"could not create the call's cgroup: {err}. To fix: {HINT}") from err
    found = f"v2 group {own.v2}" if own.v2 else "no v2 group"
    raise CgroupUnavailableError(
        f"no cgroup with the {', '.join(CONTROLLERS)} controllers here ({found}; v1 controllers "
        f"{sorted(own.v1) or 'none'}). To fix: {HINT}"
    )


def _controllers(group: Path) -> set[str]:
    """The controllers a v2 group may use (none where it cannot be read)."""
    try:
        return set(_read(group / "cgroup.controllers").split())
    except OSError:
        return set()


def _make_v1(dirs: dict[str, Path], memory_bytes: int, max_pids: int) -> CallGroup:
    group = CallGroup(tuple(dirs[c] for c in CONTROLLERS), version=1)
    try:
        for directory in group.dirs:
            _remove_stale(directory.parent)
            directory.mkdir()
        memory = dirs["memory"]
        _write(memory / "memory.limit_in_bytes", str(memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting, where the kernel has it
            _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
        if (memory / "memory.kmem.tcp.limit_in_bytes").exists():  # counted apart from the limit above
            _write(memory / "memory.kmem.tcp.limit_in_bytes", str(memory_bytes // TCP_SHARE))
        _write(dirs["pids"] / "pids.max", str(max_pids))
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(CPU_PERIOD_US))
    except OSError:
        group.close()
        raise
    return group


def _make_v2(path: Path, memory_bytes: int, max_pids: int) -> CallGroup:
    _remove_stale(path.parent)
    path.mkdir()
    group = CallGroup((path,), version=2)
    try:
        _write(path / "memory.max", str(memory_bytes))
        if (path / "memory.swap.max").exists():
            _write(path / "memory.swap.max", "0")
        _write(
            path / "memory.oom.group", "1"
        )  # at the limit the kernel kills the whole call, not one process
        _write(path / "pids.max", str(max_pids))
        _write(path / "cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}")
    except OSError:
        group.close()
        raise
    return group


def _v2_parent(own: Path) -> Path:
    """The v2 group the call groups go in: the trainer's delegated group, with our controllers enabled for
    its children. cgroup v2 lets only a group without processes of its own have children with controllers,
    so the trainer first moves itself into a leaf `trace-trainer` below its group, which it may do only when
    it is the group's one process (as `systemd-run --scope -p Delegate=yes` starts it). Processes it starts
    afterwards (DDP ranks) are born in that leaf, and use its parent too.
    """
    if own.name == TRAINER_LEAF:
        own = own.parent
    if set(CONTROLLERS) <= set(_read(own / "cgroup.subtree_control").split()):
        return own
    others = _pids(own) - {os.getpid()}
    if others:
        raise CgroupUnavailableError(
            f"the trainer's cgroup {own} also holds processes {sorted(others)[:5]}, so it cannot give the "
            f"memory, pids and cpu controllers to a group per call (cgroup v2 keeps processes out of inner "
            f"groups). To fix: {HINT}"
        )
    (own / TRAINER_LEAF).mkdir(exist_ok=True)
    _write(own / TRAINER_LEAF / "cgroup.procs", str(os.getpid()))
    _write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    _log.info("python tool: moved the trainer into %s to give each call a cgroup", own / TRAINER_LEAF)
    return own


def _remove_stale(parent: Path) -> None:
    """Remove the (empty) groups of calls whose trainer died before it could remove them."""
    for path in parent.glob(f"{PREFIX}*"):
        owner = path.name[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            with contextlib.suppress(OSError):
                path.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(directory: Path) -> None:
    """rmdir a group; the kernel may take a moment to let go of processes just killed."""
    deadline = time.monotonic() + _KILL_SECONDS
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _pids(directory: Path) -> set[int]:
    return {int(pid) for pid in _read(directory / "cgroup.procs").split()}


def _read(path: Path) -> str:
    return path.read_text(encoding="ascii")


def _write(path: Path, value: str) -> None:
    with open(path, "w", encoding="ascii") as file:  # one write(2): cgroup files take one value per write
        file.write(value)
