"""The call's cgroup: made below the trainer's, holding every process of the call, removed after.

The first tests watch a real call from outside (cgroup files read here, not through the code under test);
they need bubblewrap and a usable cgroup (root on a cgroup v1 host, or v2 delegation). The rest check how a
group is placed and refused on fake cgroup trees, for v1 and for v2 (which these machines cannot run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import require_bwrap
from helpers.host_meter import HostMeter, memory_group

from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import SandboxLimits, cgroup, run_python
from trace_lightning.envs.sandbox.cgroup import CgroupUnavailableError, OwnGroups, create_group, own_groups

LIMITS = SandboxLimits(wall_seconds=3.0, cpu_seconds=3, memory_mb=200, max_processes=12, audit_hook=False)
MiB = 2**20


def _own_v1_group(controller: str) -> Path | None:
    """The test process's group in a v1 hierarchy, read from /proc/self/cgroup (None where not v1)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            directory = Path("/sys/fs/cgroup", controller, path.lstrip("/"))
            return directory if directory.is_dir() else None
    return None


def _call_groups() -> list[Path]:
    """The per-call groups below the test's own memory group (v1), or beside its v2 leaf."""
    found = memory_group()
    return sorted(found[0].glob("trace-call-*")) if found else []


def _read(path: Path) -> str:
    return path.read_text().strip()


def test_each_call_runs_in_a_cgroup_of_its_own_then_it_is_removed() -> None:
    """While a program sleeps: one group, with the call's limits, holding bwrap and the jail's processes."""
    require_bwrap()
    assert _call_groups() == []
    seen: list[dict[str, object]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for group in _call_groups():
                try:
                    seen.append({"name": group.name, **_describe(group)})
                except (OSError, ValueError):  # made, not yet given its limits ("max"), or removed meanwhile
                    continue
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code = "import os, time\nchild = os.fork()\ntime.sleep(1.5)\nprint('slept') if child else os._exit(0)"
        result = run_python(code, LIMITS)
    finally:
        done.set()
        watcher.join()
    assert result.output == "slept\n" and result.ok
    assert len({snapshot["name"] for snapshot in seen}) == 1, seen
    observed = max(seen, key=lambda snapshot: snapshot["jail processes"])  # type: ignore[arg-type,return-value]
    assert observed["memory"] == LIMITS.memory_mb * MiB
    assert observed["pids"] == LIMITS.max_processes + 2  # the program's processes, bwrap and the launcher
    assert observed["cpu"] == 1.0  # quota / period: one core
    assert observed["jail processes"] == 4, observed  # bwrap, the launcher, the worker and its fork
    assert _call_groups() == []


def _describe(group: Path) -> dict[str, object]:
    """The limits of a call's group and how many processes running the jail's launcher it holds."""
    procs = _read(group / "cgroup.procs").split()
    if (group / "memory.limit_in_bytes").exists():  # v1: pids and cpu are groups of the same name elsewhere
        pids_group, cpu_group = (_own_v1_group(c) / group.name for c in ("pids", "cpu"))  # type: ignore[operator]
        memory = int(_read(group / "memory.limit_in_bytes"))
        pids = int(_read(pids_group / "pids.max"))
        cpu = int(_read(cpu_group / "cpu.cfs_quota_us")) / int(_read(cpu_group / "cpu.cfs_period_us"))
    else:
        memory, pids = int(_read(group / "memory.max")), int(_read(group / "pids.max"))
        quota, period = _read(group / "cpu.max").split()
        cpu = int(quota) / int(period)
    return {"memory": memory, "pids": pids, "cpu": cpu, "jail processes": len(procs)}


def test_a_stale_group_of_a_dead_trainer_is_removed_at_the_next_call() -> None:
    require_bwrap()
    parent = _own_v1_group("memory")
    if parent is None:
        pytest.skip("needs a cgroup v1 memory hierarchy (these machines and CI have one)")
    dead = _dead_pid()
    stale = parent / f"trace-call-{dead}-stale"
    stale.mkdir()
    try:
        assert run_python("print(1)", LIMITS).ok
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_the_call_gets_one_core_however_many_processes_it_starts() -> None:
    """4 processes spin for the whole wall clock; together they get at most `wall_seconds` of CPU time
    (sampled from /proc: with 2 free cores they took about twice that before the cgroup)."""
    require_bwrap()
    with HostMeter(cpu=True) as meter:
        code = "import os\nfor _ in range(3):\n    if os.fork() == 0: break\nwhile True: pass"
        result = run_python(code, SandboxLimits(**{**LIMITS.__dict__, "cpu_seconds": 10}))
    cpu = meter.taken.cpu_seconds
    print(f"4 spinning processes: {cpu:.2f} s of CPU in {LIMITS.wall_seconds} s of wall clock")
    assert result.timed_out
    assert cpu < LIMITS.wall_seconds + 0.5


def test_without_a_usable_cgroup_the_tool_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail closed, like the jail without bwrap: a named error that says how to get a cgroup."""
    monkeypatch.setattr(cgroup, "_own_groups", lambda: OwnGroups({}, None))
    limits = SandboxLimits(bwrap=sys.executable)  # any executable: the cgroup is made before bwrap starts
    with pytest.raises(CgroupUnavailableError, match=r"no cgroup with the memory, pids, cpu .*Delegate=yes"):
        MathToolEnv(n_tasks=1, python_tool=True, sandbox=limits)


# -- where a group goes, on fake cgroup trees ---------------------------------------------------------

HYBRID_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"


def test_own_groups_reads_v1_and_v2_from_proc() -> None:
    found = own_groups(HYBRID_MOUNTS, HYBRID_CGROUP)
    assert found.v1 == {
        "memory": Path("/sys/fs/cgroup/memory/process_api/abc"),
        "pids": Path("/sys/fs/cgroup/pids"),
        "cpu": Path("/sys/fs/cgroup/cpu"),
    }
    assert found.v2 == Path("/sys/fs/cgroup/unified")
    unified = "29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    assert own_groups(unified, "0::/user.slice/app.scope\n") == OwnGroups(
        {}, Path("/sys/fs/cgroup/user.slice/app.scope")
    )
    # a hierarchy mounted from a sub-group (a container's bind mount) shows only what lies below it
    bound = "50 40 0:26 /docker/x /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert own_groups(bound, "0::/docker/x/app\n").v2 == Path("/sys/fs/cgroup/app")
    assert own_groups(bound, "0::/elsewhere\n").v2 is None


def _fake_v2(root: Path, procs: list[int], controllers: str = "cpu io memory pids") -> Path:
    own = root / "app.scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text(controllers + "\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in procs))
    return own


def test_v2_the_trainer_alone_in_its_group_moves_into_a_leaf_and_delegates(tmp_path: Path) -> None:
    own = _fake_v2(tmp_path, [os.getpid()])
    group = create_group(256 * MiB, 34, OwnGroups({}, own))
    assert (own / "trace-trainer" / "cgroup.procs").read_text() == str(os.getpid())
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    (call,) = group.dirs
    assert call.parent == own and call.name.startswith(f"trace-call-{os.getpid()}-")
    files = {
        name: (call / name).read_text() for name in ("memory.max", "memory.oom.group", "pids.max", "cpu.max")
    }
    assert files == {
        "memory.max": str(256 * MiB),
        "memory.oom.group": "1",
        "pids.max": "34",
        "cpu.max": "100000 100000",
    }


def test_v2_a_trainer_already_in_its_leaf_puts_calls_beside_it(tmp_path: Path) -> None:
    own = _fake_v2(tmp_path, [])
    (own / "cgroup.subtree_control").write_text("cpu memory pids\n")
    leaf = own / "trace-trainer"
    leaf.mkdir()
    (leaf / "cgroup.controllers").write_text("cpu memory pids\n")
    group = create_group(64 * MiB, 3, OwnGroups({}, leaf))
    assert group.dirs[0].parent == own and group.version == 2


def test_v2_a_group_shared_with_other_processes_is_refused(tmp_path: Path) -> None:
    own = _fake_v2(tmp_path, [os.getpid(), 1])
    with pytest.raises(CgroupUnavailableError, match=r"also holds processes \[1\].*systemd-run"):
        create_group(64 * MiB, 3, OwnGroups({}, own))
    assert not (own / "trace-trainer").exists()


def test_v2_without_the_controllers_falls_back_to_v1_or_refuses(tmp_path: Path) -> None:
    own = _fake_v2(tmp_path / "v2", [os.getpid()], controllers="io")
    with pytest.raises(
        CgroupUnavailableError, match=r"v1 controllers none.*cgroup v1 host run the trainer as root"
    ):
        create_group(64 * MiB, 3, OwnGroups({}, own))
    v1 = {name: tmp_path / name for name in ("memory", "pids", "cpu")}
    for directory in v1.values():
        directory.mkdir()
    group = create_group(64 * MiB, 3, OwnGroups(v1, own))
    memory, pids, cpu = group.dirs
    assert group.version == 1 and [d.parent for d in group.dirs] == [v1["memory"], v1["pids"], v1["cpu"]]
    assert (memory / "memory.limit_in_bytes").read_text() == str(64 * MiB)
    assert not (memory / "memory.memsw.limit_in_bytes").exists()  # written only where the kernel has it
    assert (pids / "pids.max").read_text() == "3"
    assert (cpu / "cpu.cfs_quota_us").read_text() == (cpu / "cpu.cfs_period_us").read_text() == "100000"
