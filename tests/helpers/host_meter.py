"""What a call takes from the host, sampled from outside while it runs.

`HostMeter` samples every 10 ms, from a thread of the test process:
- host free memory (`MemAvailable`) and kernel slab (`Slab`) from /proc/meminfo, host-wide;
- free disk (statvfs) of the file systems holding the temp dir and the checkout, and the blocks of the
  regular files the test process itself holds open (where round 2's stdout and stderr lived);
- the memory (and, on cgroup v1, kernel memory) charged to the test process's own memory cgroup, which
  holds the jail's processes wherever they are moved below it: the same figures without the noise of
  other users of the machine. On cgroup v2 the group above a `trace-trainer` leaf;
- with `cpu=True`, the CPU time of every descendant of the test process, summed over the last value seen
  for each (getrusage misses the jail's orphans, which its init reaps on its way out).

Each is read straight from the kernel's files here, never through the code under test. A figure is the
worst change from the value just before the call (the largest drop of free memory or disk, the largest
rise of slab or of the group's charge).
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
MiB = 2**20


@dataclass
class Taken:
    """The worst changes seen during a call, in bytes (0 when nothing moved that way)."""

    host_memory: int = 0  # largest drop of MemAvailable
    slab: int = 0  # largest rise of Slab
    disk: int = 0  # largest drop of free disk over the temp dir's and the checkout's file systems
    own_files: int = 0  # largest growth of the blocks of the regular files this process holds open
    group_memory: int | None = None  # largest rise of the test's memory cgroup charge (None: unreadable)
    group_kernel: int | None = None  # largest rise of its kernel memory (cgroup v1 kmem; v2 memory.stat)
    cpu_seconds: float = 0.0  # CPU time of the test's descendants (with cpu=True)
    samples: int = 0

    def describe(self) -> str:
        group = "n/a" if self.group_memory is None else f"{self.group_memory / MiB:.0f}"
        kernel = "n/a" if self.group_kernel is None else f"{self.group_kernel / MiB:.0f}"
        return (
            f"host memory {self.host_memory / MiB:.0f} MiB, slab {self.slab / MiB:.0f} MiB, disk "
            f"{self.disk / MiB:.0f} MiB (files held by the test {self.own_files / MiB:.0f} MiB), own cgroup "
            f"{group} MiB (kernel {kernel} MiB), {self.samples} samples"
        )


def _meminfo() -> dict[str, int]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0]) * 1024
    return values


def memory_group() -> tuple[Path, int] | None:
    """The test process's memory cgroup directory and its cgroup version, if readable."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/memory", path.lstrip("/"))
            if (directory / "memory.usage_in_bytes").exists():
                return directory, 1
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        directory = Path("/sys/fs/cgroup", path.lstrip("/"))
        if hierarchy == "0" and (directory / "memory.current").exists():
            return (directory.parent if directory.name == "trace-trainer" else directory), 2
    return None


def _group_charge(group: tuple[Path, int] | None) -> tuple[int | None, int | None]:
    if group is None:
        return None, None
    directory, version = group
    if version == 1:
        memory = int((directory / "memory.usage_in_bytes").read_text())
        kmem = directory / "memory.kmem.usage_in_bytes"
        return memory, int(kmem.read_text()) if kmem.exists() else None
    stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
    return int((directory / "memory.current").read_text()), int(stat.get("kernel", stat.get("slab", 0)))


def _free_disk() -> int:
    devices = {}
    for place in (tempfile.gettempdir(), str(CHECKOUT)):
        found = os.statvfs(place)
        devices[os.stat(place).st_dev] = found.f_bavail * found.f_frsize
    return sum(devices.values())


def _own_file_blocks() -> int:
    """Bytes allocated to the regular files this process has open (st_blocks, so fallocate counts)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if stat.S_ISREG(found.st_mode):
            total += found.st_blocks * 512
    return total


def _descendant_cpu(root: int) -> dict[int, float]:
    """{pid: user + system CPU seconds} of every live descendant of `root`, from /proc/<pid>/stat."""
    parents, cpu = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {pid: cpu[pid] for pid in found}


@dataclass
class HostMeter:
    """`with HostMeter() as meter: ...` then `meter.taken` (see the module's docstring)."""

    cpu: bool = False
    period: float = 0.01
    taken: Taken = field(default_factory=Taken)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> HostMeter:
        self._group = memory_group()
        self._cpu: dict[int, float] = {}
        self._base = self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record(self._sample())

    def _sample(self) -> tuple[int, int, int, int, int | None, int | None]:
        if self.cpu:
            self._cpu.update(_descendant_cpu(os.getpid()))
            self.taken.cpu_seconds = sum(self._cpu.values())
        info = _meminfo()
        return (
            info["MemAvailable"],
            info["Slab"],
            _free_disk(),
            _own_file_blocks(),
            *_group_charge(self._group),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._record(self._sample())

    def _record(self, sample: tuple[int, int, int, int, int | None, int | None]) -> None:
        base, taken = self._base, self.taken
        taken.samples += 1
        taken.host_memory = max(taken.host_memory, base[0] - sample[0])
        taken.slab = max(taken.slab, sample[1] - base[1])
        taken.disk = max(taken.disk, base[2] - sample[2])
        taken.own_files = max(taken.own_files, sample[3] - base[3])
        if sample[4] is not None and base[4] is not None:
            taken.group_memory = max(taken.group_memory or 0, sample[4] - base[4])
        if sample[5] is not None and base[5] is not None:
            taken.group_kernel = max(taken.group_kernel or 0, sample[5] - base[5])
