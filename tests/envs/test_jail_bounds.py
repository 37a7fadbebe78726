"""What one call of the python tool can take from the host: memory, disk, kernel memory.

Each program in `GREEDY` goes after a host resource the rlimits of round 1 did not bound, through
`MathToolEnv.step` as the runner calls it, with the audit hook off (the jail and the cgroup alone, the harder
case). A `HostMeter` samples from outside, every 10 ms during the call: host free memory, free disk and
kernel slab, the blocks of the files the test holds open, and the charge of the test's own memory cgroup
(which holds the call's group). The bounds:
- memory: the call's `memory_mb` (its cgroup) plus `MARGIN`, on the test's own cgroup (host free memory
  moves with the machine's other users, so it binds only where no cgroup can be read);
- disk: no file the test holds grows, and host free disk does not drop by `HOST_SLACK` (others write too;
  the programs try 3 GiB);
- kernel memory: within the memory bound, and with the scratch capped in files (a root trainer) nearly none.
The programs were all unbounded on main at 6395ee8 (or made `step` raise).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers import require_bwrap
from helpers.host_meter import HostMeter, MiB, Taken

from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import SandboxLimits

LIMITS = SandboxLimits(
    wall_seconds=3.0, cpu_seconds=3, memory_mb=256, scratch_mb=8, max_processes=16, audit_hook=False
)
INODE_CAP = (
    LIMITS.scratch_mb * 64
)  # the scratch's nr_inodes (limits.INODES_PER_MB), where the trainer is root
MARGIN = 64 * MiB  # the test process's own allocations while it samples, and the call's page cache
HOST_SLACK = 2048 * MiB  # host-wide figures move with the machine's other users; the attacks take 3 GiB
DEADLINE = LIMITS.wall_seconds + 4.0
CAPPED_FILES = os.geteuid() == 0  # the trainer may set the scratch's nr_inodes only as root


@dataclass(frozen=True)
class Greedy:
    kind: str  # the row in docs/reliability.md
    name: str
    code: str
    shows: str | None = None  # in the observation
    check: Callable[[str], None] | None = None
    kernel_cap: int | None = None  # a tighter bound on kernel memory than the memory limit (bytes)


def _count_at_most(pattern: str, limit: int) -> Callable[[str], None]:
    def check(observation: str) -> None:
        found = re.search(pattern, observation)
        assert found is not None and int(found.group(1)) <= limit, observation

    return check


def _ended(pattern: str) -> Callable[[str], None]:
    def check(observation: str) -> None:
        assert re.search(pattern, observation), observation

    return check


_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
_FALLOCATE = _LIBC + "libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]\n"
_CHILDREN = (
    "import os, time\nkids = []\nfor i in range({n}):\n    pid = os.fork()\n    if pid == 0:\n"
    "        try:\n{body}\n        finally:\n            os._exit(0)\n    kids.append(pid)\n"
    "print('children', sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids))\n"
)
_FLOOD = (
    "import os, time\nn, start = 0, time.time()\ntry:\n    while time.time() - start < 2.5:\n"
    "        for _ in range(200):\n            {make}; n += 1\n"
    "except OSError as err: print('stopped after', n, err.strerror)\nelse: print('made', n)\n"
)

GREEDY = [
    # -- many processes, each within its own rlimits ------------------------------------------------------
    Greedy(
        "many processes",
        "8 children touch 150 MB each",
        _CHILDREN.format(n=8, body="            block = b'x' * (150 << 20)\n            time.sleep(1)"),
        check=_ended(r"children|memory limit|timed out"),
    ),
    Greedy(
        "many processes",
        "12 children fill 50 memfds of 1 MiB each",
        _CHILDREN.format(
            n=12,
            body="            fds = [os.memfd_create('m') for _ in range(50)]\n"
            "            for fd in fds: os.write(fd, b'x' * (1 << 20))\n            time.sleep(1)",
        ),
        check=_ended(r"children|memory limit|timed out"),
    ),
    # -- shared memory outside every process ------------------------------------------------------------
    Greedy(
        "shared memory",
        "SysV segments touched and detached",
        _LIBC + "libc.shmat.restype = ctypes.c_void_p\nheld = 0\nfor _ in range(24):\n"
        "    sid = libc.shmget(0, 64 << 20, 0o1600)\n"
        "    if sid < 0: print('shmget refused, errno', ctypes.get_errno()); break\n"
        "    addr = libc.shmat(sid, None, 0)\n    ctypes.memset(addr, 1, 64 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(addr)); held += 64\nprint('held', held, 'MiB')\n"
        "import time; time.sleep(1)",
        "shmget refused, errno 1",
    ),
    Greedy(
        "shared memory",
        "SysV message queues full of messages",
        _LIBC + "buf = ctypes.create_string_buffer(8 + 8000)\nctypes.c_long.from_buffer(buf).value = 1\n"
        "queued = 0\nfor _ in range(30000):\n    q = libc.msgget(0, 0o1600)\n"
        "    if q < 0: print('msgget refused, errno', ctypes.get_errno()); break\n"
        "    for _ in range(2): queued += 8000 * (libc.msgsnd(q, buf, 8000, 0o4000) == 0)\n"
        "print('queued', queued >> 20, 'MiB')\nimport time; time.sleep(1)",
        "msgget refused, errno 1",
    ),
    Greedy(
        "shared memory",
        "semaphore sets",
        _LIBC + "made = 0\nfor _ in range(30000):\n    if libc.semget(0, 250, 0o1600) < 0:\n"
        "        print('semget refused, errno', ctypes.get_errno()); break\n"
        "    made += 1\nprint('sets', made)",
        "semget refused, errno 1",
    ),
    # -- host files that grow -------------------------------------------------------------------------------
    Greedy(
        "host files",
        "fallocate 3 GiB on stdout",
        _FALLOCATE + "r = libc.fallocate(1, 1, 0, 3 << 30)  # FALLOC_FL_KEEP_SIZE\n"
        "print('fallocate', r, 'errno', ctypes.get_errno())\nimport time; time.sleep(0.5)",
        "fallocate -1 errno",
    ),
    Greedy(
        "host files",
        "3 children fallocate 1 GiB each on stderr",
        _FALLOCATE
        + _CHILDREN.format(
            n=3,
            body="            r = libc.fallocate(2, 1, i << 30, 1 << 30)\n"
            "            print(i, 'fallocate', r, ctypes.get_errno(), flush=True)\n"
            "            time.sleep(0.5)",
        ),
        "fallocate -1",
    ),
    Greedy(
        "host files",
        "zero-range 3 GiB on stdout",
        _FALLOCATE + "r = libc.fallocate(1, 0x10 | 1, 0, 3 << 30)  # FALLOC_FL_ZERO_RANGE | KEEP_SIZE\n"
        "print('zero range', r, 'errno', ctypes.get_errno())\nimport time; time.sleep(0.5)",
        "zero range -1 errno",
    ),
    # -- kernel memory through inodes ---------------------------------------------------------------------
    Greedy(
        "inode floods",
        "empty files in scratch",
        _FLOOD.format(make="os.close(os.open(f'f{n}', os.O_CREAT | os.O_WRONLY))"),
        check=_count_at_most(r"stopped after (\d+)", INODE_CAP) if CAPPED_FILES else None,
        kernel_cap=32 * MiB if CAPPED_FILES else None,
    ),
    Greedy(
        "inode floods",
        "directories in scratch",
        _FLOOD.format(make="os.mkdir(f'd{n}')"),
        check=_count_at_most(r"stopped after (\d+)", INODE_CAP) if CAPPED_FILES else None,
        kernel_cap=32 * MiB if CAPPED_FILES else None,
    ),
    Greedy(
        "inode floods",
        "hard links to one file",
        "open('a', 'w').close()\n" + _FLOOD.format(make="os.link('a', f'l{n}')"),
        check=_count_at_most(r"stopped after (\d+)", INODE_CAP) if CAPPED_FILES else None,
        kernel_cap=32 * MiB if CAPPED_FILES else None,
    ),
    # -- odd exit statuses and text --------------------------------------------------------------------
    Greedy(
        "exit statuses and text",
        "a real-time signal on itself",
        "import signal\nprint('raising 39', flush=True)\nsignal.raise_signal(39)",
        "killed by SIGRTMIN+5",
    ),
    Greedy(
        "exit statuses and text",
        "a child kills it with signal 63",
        "import os, signal, time\nif os.fork() == 0:\n"
        "    os.kill(os.getppid(), 63); os._exit(0)\ntime.sleep(5)",
        "killed by SIGRTMIN+29",
    ),
    Greedy(
        "exit statuses and text",
        "a lone surrogate in the program",
        "print('half a pair: \ud800')",
        "the program is not valid text",
    ),
]


@pytest.fixture(scope="module")
def env() -> MathToolEnv:
    require_bwrap()
    return MathToolEnv(n_tasks=1, python_tool=True, sandbox=LIMITS)


def _assert_bounded(taken: Taken, memory_mb: int, kernel_cap: int | None = None) -> None:
    bound = memory_mb * MiB + MARGIN
    # without a readable cgroup, host free memory stands in, less what other users may take meanwhile
    memory = taken.group_memory if taken.group_memory is not None else taken.host_memory - HOST_SLACK
    kernel = taken.group_kernel if taken.group_kernel is not None else taken.slab
    assert memory < bound and kernel < (kernel_cap or bound), taken.describe()
    assert taken.own_files < MiB and taken.disk < HOST_SLACK, taken.describe()


@pytest.mark.parametrize("row", GREEDY, ids=[f"{row.kind}: {row.name}" for row in GREEDY])
def test_greedy_program_is_bounded(row: Greedy, env: MathToolEnv) -> None:
    start = time.monotonic()
    with HostMeter() as meter:
        step = env.step(env.tasks()[0], (0,), f"<python>\n{row.code}\n</python>")
    seconds = time.monotonic() - start
    assert step.tool == "python" and not step.done and step.state == (1,)
    assert seconds < DEADLINE, f"took {seconds:.1f} s"
    print(f"{row.name}: {meter.taken.describe()}; {step.observation[:200]!r}")
    _assert_bounded(meter.taken, LIMITS.memory_mb, row.kernel_cap)
    if row.shows is not None:
        assert row.shows in step.observation, step.observation
    if row.check is not None:
        row.check(step.observation)


def test_the_table_covers_every_class_of_the_issue() -> None:
    kinds = {row.kind for row in GREEDY}
    assert len(GREEDY) >= 12
    assert kinds == {
        "many processes",
        "shared memory",
        "host files",
        "inode floods",
        "exit statuses and text",
    }


# -- docs/reliability.md's figures: the most one call took at the default limits ----------------------

_SOCKET_FLOOD = """
import os, socket, time
for i in range(30):
    if os.fork() == 0:
        pairs = []
        try:
            for _ in range(30):
                a, b = socket.socketpair()
                a.setblocking(False)
                a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
                try:
                    while True: a.send(b'x' * 65536)
                except BlockingIOError: pairs.append((a, b))
        except OSError: pass
        time.sleep(2); os._exit(0)
time.sleep(3)
"""
_DISK_FILL = """
import os
for fd in (1, 2):
    print(fd, libc.fallocate(fd, 1, 0, 8 << 30))
blob, n = b'x' * (1 << 20), 0
try:
    while True:
        open(f'fill{n}', 'wb').write(blob); n += 1
except OSError as err: print('scratch full after', n, 'MiB:', err.strerror)
"""
AT_DEFAULTS = {
    "memory": _CHILDREN.format(
        n=30, body="            block = b'x' * (180 << 20)\n            time.sleep(1)"
    ),
    "kernel memory": _SOCKET_FLOOD,
    "disk": _FALLOCATE + _DISK_FILL,
    "files": _FLOOD.format(make="os.close(os.open(f'f{n}', os.O_CREAT | os.O_WRONLY))"),
}


@pytest.mark.slow
@pytest.mark.parametrize("resource", list(AT_DEFAULTS))
def test_at_the_default_limits_a_call_takes_at_most_its_memory_limit(resource: str) -> None:
    """With `SandboxLimits()` (512 MB, 32 processes, 64 MB scratch, 5 s): 30 children touching 180 MB each,
    30 processes filling unix socket buffers, fallocate of 8 GiB on stdout and stderr plus a full scratch,
    and a file flood. Run with `-s` to see the figures docs/reliability.md quotes."""
    require_bwrap()
    limits = SandboxLimits(audit_hook=False)
    env = MathToolEnv(n_tasks=1, python_tool=True, sandbox=limits)
    with HostMeter() as meter:
        step = env.step(env.tasks()[0], (0,), f"<python>\n{AT_DEFAULTS[resource]}\n</python>")
    print(f"defaults, {resource}: {meter.taken.describe()}; {step.observation[-160:]!r}")
    _assert_bounded(meter.taken, limits.memory_mb)
    if resource == "files" and CAPPED_FILES:
        _count_at_most(r"stopped after (\d+)", limits.scratch_inodes)(step.observation)
