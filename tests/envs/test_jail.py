"""The python tool's jail contains hostile programs, and refuses to run without a jail.

Each program in `HOSTILE` runs through `MathToolEnv.step`
with a `<python>` action, as the runner calls it, in two configurations: the default (jail + audit
hook) and the jail alone (`audit_hook=False`). Most programs first beat the audit hook through its
frames (`ESCAPE`), so that with the hook on they, too, meet the jail itself. After every program:
the host canary file, /etc/shadow, the checkout and a host process's environment did not leak into
the observation; no host file was created; nothing connected to the host's listeners; the host
process is alive; no process of the jail is left (no descendant of this test, no process with the
program's token in its command line); and the call returned within the wall limit + 3 s.
"""

import os
import re
import secrets
import signal
import socket
import string
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import require_bwrap, require_cgroup

from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import UNSAFE_NO_JAIL, SandboxLimits, jail, run_python, spawn
from trace_lightning.envs.sandbox.jail import JailUnavailableError

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_mb=256, scratch_mb=8, max_processes=16)
DEADLINE = LIMITS.wall_seconds + 3.0  # the 2 s backstop, plus start-up on a shared 2-core machine
SECRET = f"secret-{secrets.token_hex(8)}"
CANARY = f"canary-{secrets.token_hex(8)}"
CHECKOUT = Path(__file__).resolve().parents[2]
CHECKOUT_MARK = next(
    line for line in (CHECKOUT / "pyproject.toml").read_text().splitlines() if "name =" in line
)
SYSCALLS = {"x86_64": (250, 321), "aarch64": (219, 280)}  # (keyctl, bpf) by machine
ESCAPE = """
def _escape():
    # The audit hook raises from its own frame: its module globals are one traceback step away.
    try:
        open("/etc/hostname")
    except PermissionError as err:
        tb = err.__traceback__
        while tb is not None:
            if "_refusal" in tb.tb_frame.f_globals:
                tb.tb_frame.f_globals["_refusal"] = lambda *args: None
                return "hook disabled"
            tb = tb.tb_next
        return "hook not found"
    except OSError:
        return "no hook"
    return "no hook"
print(_escape(), flush=True)
"""


@dataclass(frozen=True)
class Hostile:
    kind: str  # the class of attack (a row of docs/reliability.md's table)
    name: str
    code: str  # a string.Template: $canary, $port, $victim, ... (see World.fill)
    shows: str | None = None  # in the observation: the attempt ran and the kernel refused it
    prelude: bool = True  # start with ESCAPE, which disables the audit hook when there is one
    beats_hook: bool | None = None  # gets past the hook (so `shows` holds with it on); default: prelude
    check: Callable[[str], None] | None = None  # more about the observation


def _at_most(pattern: str, limit: int) -> Callable[[str], None]:
    def check(observation: str) -> None:
        found = re.search(pattern, observation)
        assert found is not None and int(found.group(1)) <= limit, observation

    return check


def _never(*texts: str) -> Callable[[str], None]:
    def check(observation: str) -> None:
        assert not any(text in observation for text in texts), observation

    return check


_SHOW_ERRORS = "except OSError as err: print(path, type(err).__name__, err.strerror)"
_WRITE_EACH = (
    "for path in {paths}:\n    try: open(path, 'w').write('pwned'); print('WROTE', path)\n    " + _SHOW_ERRORS
)
_READ_EACH = "for path in {paths}:\n    try: print(open(path).read())\n    " + _SHOW_ERRORS

HOST_WIDE_PROC = ["/proc/cmdline", "/proc/sys/kernel/random/boot_id", "/proc/diskstats", "/proc/partitions"]
USR_HIDDEN = ("/usr/etc", "/usr/lib/python3/dist-packages", "/usr/local")


def _hides_host_proc(observation: str) -> None:
    """The host's kernel command line, boot id and disk names (read here, outside) are not shown."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    cmdline = Path("/proc/cmdline").read_text().strip()[:40]
    disks = [line.split()[2] for line in Path("/proc/diskstats").read_text().splitlines() if line.split()]
    for leaked in (boot_id, cmdline, *(f" {disk} " for disk in disks)):
        assert not leaked.strip() or leaked not in observation, f"leaked {leaked!r}: {observation}"


def _hides_host_usr(observation: str) -> None:
    """No entry of the host's /usr/etc, dist-packages or /usr/local is listed in the jail."""
    for folder in USR_HIDDEN:
        entries = os.listdir(folder) if os.path.isdir(folder) else []
        shown = [entry for entry in entries if repr(entry) in observation]
        assert shown == [], f"{folder} shows {shown[:5]}: {observation}"


HOSTILE = [
    # -- reading the host's files ---------------------------------------------------------------------
    Hostile(
        "read host files", "/etc/shadow", _READ_EACH.format(paths="['/etc/shadow']"), "FileNotFoundError"
    ),
    Hostile(
        "read host files",
        "the checkout",
        _READ_EACH.format(paths="['$checkout/pyproject.toml']"),
        "FileNotFound",
    ),
    Hostile(
        "read host files", "a host canary file", _READ_EACH.format(paths="['$canary']"), "FileNotFoundError"
    ),
    Hostile(
        "read host files",
        "home directories",
        "import os\nfor path in ('/root', '/home', '/work'):\n    try: print(os.listdir(path))\n    "
        + _SHOW_ERRORS,
        "FileNotFoundError",
    ),
    Hostile(
        "read host files",
        "what the root shows",
        "import os\nhost = {'etc', 'root', 'home', 'work', 'tmp', 'var', 'opt', 'mnt', 'srv', 'boot'}\n"
        "print('visible:', sorted(host & set(os.listdir('/'))), os.listdir('/usr/local'))",
        "visible: [] []",
    ),
    Hostile(
        "read host files",
        "through /proc/1/root",
        _READ_EACH.format(paths="['/proc/1/root/etc/shadow', '/proc/1/cwd/../../etc/shadow']"),
        check=_never("root:"),
    ),
    Hostile(
        "read host files",
        "host-wide /proc files",  # the kernel command line, boot id, disk counters
        _READ_EACH.replace("print(open(path).read())", "print(path, repr(open(path).read()[:200]))").format(
            paths=repr(HOST_WIDE_PROC)
        ),
        "/proc/cmdline ''",
        check=lambda observation: _hides_host_proc(observation),
    ),
    Hostile(
        "read host files",
        "/usr/etc, dist-packages, /usr/local",
        "import os\nfor path in $usr_hidden:\n    try: print(path, sorted(os.listdir(path)))\n    "
        + _SHOW_ERRORS,
        check=lambda observation: _hides_host_usr(observation),
    ),
    # -- tricks that get past the audit hook --------------------------------------------------------------
    Hostile(
        "audit-hook bypasses",
        "dir_fd after chdir",
        "import os\nos.chdir('/')\ndirectory = os.open('etc', os.O_RDONLY)\n"
        "print(os.read(os.open('shadow', os.O_RDONLY, dir_fd=directory), 4096))",
        "FileNotFoundError",
        prelude=False,
    ),
    Hostile(
        "audit-hook bypasses",
        "dir_fd on the canary's directory",
        "import os\ndirectory = os.open('$canary_dir', os.O_RDONLY)\n"
        "print(os.read(os.open('canary.txt', os.O_RDONLY, dir_fd=directory), 4096))",
        "FileNotFoundError",
        prelude=False,
    ),
    Hostile(
        "audit-hook bypasses",
        "dir_fd write into site-packages",
        "import os\ndirectory = os.open('$site_packages', os.O_RDONLY)\n"
        "os.write(os.open('$pwned_site_name', os.O_WRONLY | os.O_CREAT, dir_fd=directory), b'pwned')",
        "FileNotFoundError",
        prelude=False,
    ),
    Hostile(
        "audit-hook bypasses",
        "str subclass path",
        "class Sly(str):\n    def startswith(self, *args): return True\n"
        "    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
        "for path in (Sly('$canary'), Sly('/etc/shadow')):\n    try: print(open(path).read())\n    "
        + _SHOW_ERRORS,
        "FileNotFoundError",
        prelude=False,
    ),
    Hostile(
        "audit-hook bypasses",
        "symlink swapped between check and open",
        "import os, threading\nopen('ok.txt', 'w').write('ok')\nstop = []\n"
        "def flip():\n    while not stop:\n        for target in ('ok.txt', '$canary', '/etc/shadow'):\n"
        "            try: os.symlink(target, 'new'); os.replace('new', 'link')\n"
        "            except OSError: pass\n"
        "os.symlink('ok.txt', 'link')\nseen = {open('link').read()}\n"
        "thread = threading.Thread(target=flip)\nthread.start()\n"
        "for _ in range(2000):\n    try: seen.add(open('link').read()[:40])\n"
        "    except OSError as err: seen.add(type(err).__name__)\n"
        "stop.append(1)\nthread.join()\nprint(sorted(seen))",
        "FileNotFoundError",  # the link pointed out of scratch when opened, and the jail has no such file
        prelude=False,
    ),
    Hostile(
        "audit-hook bypasses",
        "monkeypatched os.path",
        "import os, posixpath\n"
        "posixpath.realpath = os.path.realpath = lambda path, *a, **k: '/scratch/main.py'\n"
        + _READ_EACH.format(paths="['$canary', '/etc/shadow', '$checkout/pyproject.toml']"),
        "FileNotFoundError",
        prelude=False,
        beats_hook=True,
    ),
    Hostile(
        "audit-hook bypasses", "hook disabled via frames", "print(open('/etc/shadow').read())", "FileNotFound"
    ),
    # -- writing outside scratch ---------------------------------------------------------------------
    Hostile(
        "write outside scratch",
        "host tmp, checkout, site-packages",
        _WRITE_EACH.format(paths="['$pwned_tmp', '$pwned_checkout', '$site_packages/$pwned_site_name']"),
        "FileNotFoundError",
        check=_never("WROTE"),
    ),
    Hostile(
        "write outside scratch",
        "the bound python runtime",
        _WRITE_EACH.format(paths="['$host_stdlib/$pwned_site_name', '/usr/bin/pwned', '/jail/launcher.py']"),
        "Read-only file system",
        check=_never("WROTE"),
    ),
    Hostile(
        "write outside scratch",
        "the jail's root, /dev, /proc",
        _WRITE_EACH.format(
            paths="['/pwned', '/dev/pwned', '/dev/shm/pwned', '/proc/pwned', '/proc/sys/kernel/domainname']"
        ),
        "Read-only file system",
        check=_never("WROTE"),
    ),
    # -- other processes ---------------------------------------------------------------------------------
    Hostile(
        "other processes via /proc",
        "environ of every process",
        "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint('pids', len(pids))\n"
        + _READ_EACH.format(paths="[f'/proc/{p}/environ' for p in pids] + ['/proc/$victim/environ']"),
        "FileNotFoundError",
        check=_at_most(r"pids (\d+)", 6),
    ),
    Hostile(
        "other processes via /proc",
        "write /proc/<pid>/mem",
        "for pid in ($victim, $trainer):\n    try:\n        with open(f'/proc/{pid}/mem', 'r+b') as mem:\n"
        "            mem.seek(0x400000); mem.write(b'\\xcc' * 64)\n        print('WROTE', pid)\n"
        "    except OSError as err: print(pid, type(err).__name__)",
        "FileNotFoundError",
        check=_never("WROTE"),
    ),
    Hostile(
        "other processes via /proc",
        "signal host processes",
        "import os\nfor pid in ($victim, $trainer):\n    try: os.kill(pid, 9); print('KILLED', pid)\n"
        "    except OSError as err: print(pid, err.strerror)",
        "No such process",
        check=_never("KILLED"),
    ),
    Hostile(
        "other processes via /proc",
        "kill every process it can",
        "import os, subprocess\nchild = subprocess.Popen(['sleep', '$token'])\n"
        "if os.getuid() == 65534 and len([p for p in os.listdir('/proc') if p.isdigit()]) < 10:\n"
        "    os.kill(-1, 9)  # only inside a pid namespace\nprint('after kill(-1), child', child.wait())",
        "after kill(-1), child -9",  # the jail's own child died; the launcher (the init) lived to report
    ),
    # -- the network -------------------------------------------------------------------------------------
    Hostile(
        "host network",
        "connect to the host's ports",
        "import socket\nfor host in ['127.0.0.1', '::1', *$host_ips]:\n"
        "    try: socket.create_connection((host, $port), timeout=1); print('CONNECTED', host)\n"
        "    except OSError as err: print(host, err)",
        "Connection refused",
        check=_never("CONNECTED"),
    ),
    Hostile(
        "host network",
        "the host's abstract unix socket",
        "import socket\nclient = socket.socket(socket.AF_UNIX)\n"
        "try: client.connect('\\0$abstract'); print('CONNECTED')\nexcept OSError as err: print(err)",
        "Connection refused",
        check=_never("CONNECTED"),
    ),
    Hostile(
        "host network",
        "setns into the trainer's netns",
        "import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for path in ('/proc/$trainer/ns/net', '/proc/1/ns/net'):\n"
        "    try: fd = os.open(path, os.O_RDONLY)\n"
        "    except OSError as err: print(path, err.strerror); continue\n"
        "    print(path, 'setns', libc.setns(fd, 0), 'errno', ctypes.get_errno())\n"
        "try: socket.create_connection(('127.0.0.1', $port), timeout=1); print('CONNECTED')\n"
        "except OSError as err: print(err)",
        "setns -1 errno 1",
        check=_never("CONNECTED"),
    ),
    # -- the way out of the namespaces -------------------------------------------------------------------
    Hostile(
        "namespace escapes",
        "unshare a user namespace",
        "import ctypes, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), 'errno', ctypes.get_errno())\n"
        "print(subprocess.run(['unshare', '-Urn', 'id'], capture_output=True, text=True))",
        "unshare -1 errno 1",
        check=_never("uid=0"),
    ),
    Hostile(
        "namespace escapes",
        "mount over /usr",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('mount', libc.mount(b'none', b'/usr', b'tmpfs', 0, None), 'errno', ctypes.get_errno())\n"
        "print('umount', libc.umount2(b'/usr', 2), 'errno', ctypes.get_errno())",
        "mount -1 errno 1",
    ),
    Hostile(
        "namespace escapes",
        "ptrace a child",
        "import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\nchild = os.fork()\n"
        "if child == 0:\n    time.sleep(5); os._exit(0)\n"
        "print('ptrace', libc.ptrace(16, child, 0, 0), 'errno', ctypes.get_errno())",
        "ptrace -1 errno 1",
    ),
    Hostile(
        "namespace escapes",
        "keyctl and bpf",
        "import ctypes, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "keyctl, bpf = $syscalls[platform.machine()]\n"
        "print('keyctl', libc.syscall(keyctl, 0, -3, 0), 'errno', ctypes.get_errno())\n"
        "print('bpf', libc.syscall(bpf, 0, 0, 0), 'errno', ctypes.get_errno())",
        "keyctl -1 errno 1\nbpf -1 errno 1",
    ),
    # -- who it runs as ----------------------------------------------------------------------------------
    Hostile(
        "uid and capabilities",
        "exec /bin/sh",
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'id; cat /etc/shadow; ls /root'])",
        "uid=65534 gid=65534 groups=65534",
        check=_never("uid=0"),
    ),
    Hostile(
        "uid and capabilities",
        "capabilities",
        "print(open('/proc/self/status').read())",
        "CapEff:\t0000000000000000",
        check=lambda observation: (
            None if "CapBnd:\t0000000000000000" in observation else pytest.fail(observation)
        ),
    ),
    Hostile(
        "uid and capabilities",
        "setuid(0)",
        "import os\ntry: os.setuid(0); print('ROOT')\nexcept OSError as err: print(err)",
        "Invalid argument",
        check=_never("ROOT"),
    ),
    # -- resources ---------------------------------------------------------------------------------------
    Hostile(
        "resource limits",
        "count forks",
        "import os, time\nchildren, refused = 0, None\nfor _ in range(300):\n    try: pid = os.fork()\n"
        "    except OSError as err: refused = err.errno; break\n"
        "    if pid == 0:\n        time.sleep(5); os._exit(0)\n    children += 1\n"
        "print('children', children, 'refused errno', refused)",
        "refused errno 11",
        check=_at_most(r"children (\d+)", LIMITS.max_processes),
    ),
    Hostile("resource limits", "fork bomb", "import os\nwhile True: os.fork()"),
    Hostile(
        "resource limits",
        "fill scratch",
        "total = 0\ntry:\n    for i in range(1000):\n"
        "        with open(f'fill{i}', 'wb') as f: f.write(b'x' * 2**20)\n        total += 1\n"
        "except OSError as err: print('filled', total, 'MiB, errno', err.errno)",
        "errno 28",
        check=_at_most(r"filled (\d+) MiB", LIMITS.scratch_mb),
    ),
    Hostile("resource limits", "one huge file", "open('big', 'wb').write(b'x' * 2**21)", "File too large"),
    Hostile("resource limits", "huge allocation", "x = bytearray(10**10)", "MemoryError"),
    Hostile("resource limits", "huge output", "print('x' * 10**8)", "[output truncated]"),
    Hostile(
        "resource limits",
        "CPU spin",
        "while True: pass",
        check=lambda obs: None if re.search(r"CPU time limit|timed out", obs) else pytest.fail(obs),
    ),
    Hostile(
        "resource limits", "sleep past the wall clock", "import time\ntime.sleep(60)", "timed out after 2 s"
    ),
    # -- processes that try to outlive the call ----------------------------------------------------------
    Hostile(
        "survivors",
        "daemons",
        "import os, signal, subprocess\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\nif os.fork() == 0:\n"
        "    os.setsid()\n    if os.fork() == 0:\n        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        os.execv('/bin/sleep', ['sleep', '$token'])\n    os._exit(0)\n"
        "subprocess.Popen(['sleep', '$token'], start_new_session=True)\nprint('spawned')",
        "spawned",
    ),
    Hostile(
        "survivors",
        "kill the launcher, leave children",
        "import os, subprocess\nsubprocess.Popen(['sleep', '$token'])\nprint('spawned', flush=True)\n"
        "os.kill(os.getppid(), 9)",
        "spawned",
    ),
    Hostile(
        "survivors",
        "stop the launcher, sleep on",  # ignored: the launcher is the pid namespace's init
        "import os, subprocess, time\nsubprocess.Popen(['sleep', '$token'])\nprint('stopping', flush=True)\n"
        "os.kill(os.getppid(), 19)\ntime.sleep(60)",
        "timed out after 2 s",
    ),
    Hostile(
        "environment", "the trainer's variables", "import os\nprint(dict(os.environ))", "'HOME': '/scratch'"
    ),
]


KINDS = (  # docs/reliability.md's table, in its order
    "read host files",
    "audit-hook bypasses",
    "write outside scratch",
    "other processes via /proc",
    "host network",
    "namespace escapes",
    "uid and capabilities",
    "resource limits",
    "survivors",
    "environment",
)


@dataclass
class World:
    """What the hostile programs go after, fresh for each test."""

    canary: Path
    pwned: list[Path]  # host files no program may create
    listener: socket.socket  # TCP on every host address
    abstract: socket.socket  # a unix socket in the host's abstract namespace
    victim: subprocess.Popen  # a host process with SECRET in its environment
    token: str  # the argument of every `sleep` a hostile program starts
    fields: dict[str, object]

    def fill(self, code: str) -> str:
        return string.Template(code).substitute(self.fields)


@pytest.fixture(scope="module")
def host_stdlib() -> str:
    """Where the jail's python keeps its standard library on the host (bound read-only in the jail)."""
    require_bwrap()
    command = [LIMITS.python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host_stdlib: str) -> Iterator[World]:
    monkeypatch.setenv("TRACE_SECRET", SECRET)
    (tmp_path / "canary.txt").write_text(CANARY)
    name = f"pwned_{secrets.token_hex(6)}.py"
    site = sysconfig.get_paths()["purelib"]
    pwned = [Path(tempfile.gettempdir(), name), CHECKOUT / name, Path(site, name), Path(host_stdlib, name)]
    victim = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", "TRACE_SECRET": SECRET})
    abstract_name = f"trace-jail-{secrets.token_hex(6)}"
    with socket.create_server(("0.0.0.0", 0)) as listener, socket.socket(socket.AF_UNIX) as abstract:
        abstract.bind(f"\0{abstract_name}")
        abstract.listen()
        for server in (listener, abstract):
            server.setblocking(False)
        fields = {
            "canary": tmp_path / "canary.txt",
            "canary_dir": tmp_path,
            "checkout": CHECKOUT,
            "site_packages": site,
            "host_stdlib": host_stdlib,
            "pwned_site_name": name,
            "pwned_tmp": pwned[0],
            "pwned_checkout": pwned[1],
            "port": listener.getsockname()[1],
            "abstract": abstract_name,
            "host_ips": repr(_host_addresses()),
            "victim": victim.pid,
            "trainer": os.getpid(),
            "token": f"{secrets.randbelow(9000) + 1000}.{secrets.randbelow(10**6):06d}",
            "syscalls": repr(SYSCALLS),
            "usr_hidden": repr(USR_HIDDEN),
        }
        yield World(tmp_path / "canary.txt", pwned, listener, abstract, victim, str(fields["token"]), fields)
    victim.kill()
    victim.wait()
    for path in pwned:  # only there if a program escaped (and the test failed)
        path.unlink(missing_ok=True)


def _host_addresses() -> list[str]:
    try:
        return sorted(set(socket.gethostbyname_ex(socket.gethostname())[2]) - {"127.0.0.1"})
    except OSError:
        return []


def _descendants(root: int) -> set[int]:
    """Live processes under `root`, from every /proc/<pid>/stat's parent pid."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            fields = (
                Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split() if entry.isdigit() else []
            )
        except OSError:  # exited meanwhile
            continue
        if fields and fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _with_token(token: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def _assert_contained(observation: str, seconds: float, world: World) -> None:
    assert seconds < DEADLINE, f"took {seconds:.1f} s"
    shadow = Path("/etc/shadow").read_text().splitlines()[0] if Path("/etc/shadow").exists() else None
    for leaked in (CANARY, SECRET, CHECKOUT_MARK, shadow):
        assert leaked is None or leaked not in observation, f"leaked {leaked!r}"
    assert len(observation) < 2 * LIMITS.max_output_chars + 100
    assert [path for path in world.pwned if path.exists()] == []
    for server in (world.listener, world.abstract):
        with pytest.raises(BlockingIOError):  # nothing connected
            server.accept()
    assert world.victim.poll() is None, "the host process was killed"
    assert _descendants(os.getpid()) - {world.victim.pid} == set(), "a process outlived the tool call"
    assert _with_token(world.token) == []


@pytest.fixture(scope="module")
def envs() -> dict[str, MathToolEnv]:
    require_bwrap()
    return {
        "jail+hook": MathToolEnv(n_tasks=1, python_tool=True, sandbox=LIMITS),
        "jail only": MathToolEnv(
            n_tasks=1, python_tool=True, sandbox=SandboxLimits(**{**LIMITS.__dict__, "audit_hook": False})
        ),
    }


@pytest.mark.parametrize("mode", ["jail+hook", "jail only"])
@pytest.mark.parametrize("row", HOSTILE, ids=[f"{row.kind}: {row.name}" for row in HOSTILE])
def test_hostile_program_is_contained(
    row: Hostile, mode: str, envs: dict[str, MathToolEnv], world: World
) -> None:
    env = envs[mode]
    code = world.fill((ESCAPE if row.prelude else "") + row.code)
    start = time.monotonic()
    step = env.step(env.tasks()[0], (2,), f"Let me try.\n<python>\n{code}\n</python>")
    seconds = time.monotonic() - start
    assert step.tool == "python" and not step.done and step.state == (3,)
    observation = step.observation
    assert step.tool_error == ("error: " in observation)  # a refused or killed program is a tool error
    _assert_contained(observation, seconds, world)
    if row.prelude and mode == "jail+hook":
        assert "hook disabled" in observation  # so what follows met the jail, not the hook
    beats_hook = row.prelude if row.beats_hook is None else row.beats_hook
    if row.shows is not None and (beats_hook or mode == "jail only"):
        assert row.shows in observation, observation
    if row.check is not None:
        row.check(observation)


def test_the_table_covers_every_class_of_the_issue() -> None:
    kinds = {row.kind for row in HOSTILE}
    assert len(HOSTILE) >= 30 and kinds == set(KINDS), sorted(kinds)


def test_the_jail_runs_as_nobody_on_the_host(world: World) -> None:
    """Every process of the jail is host uid 65534 (so RLIMIT_NPROC binds), also when the trainer is root."""
    require_bwrap()
    seen: list[set[str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            uids = set()
            for pid in _descendants(os.getpid()) - {world.victim.pid}:
                try:  # bwrap and the jail's python; not a forked child that has not exec'd bwrap yet
                    if b"launcher.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                    status = Path(f"/proc/{pid}/status").read_text().splitlines()
                except OSError:
                    continue
                uids |= {line.split()[1] for line in status if line.startswith("Uid:")}
            if uids:
                seen.append(uids)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_python("import time\ntime.sleep(1)\nprint('done')", LIMITS)
    finally:
        done.set()
        watcher.join()
    assert result.ok and result.output == "done\n"
    expected = "65534" if os.geteuid() == 0 else str(os.getuid())
    assert seen and set().union(*seen) == {expected}


def test_without_bwrap_the_tool_refuses_to_start() -> None:
    with pytest.raises(
        JailUnavailableError, match=r"env\.sandbox\.bwrap='/nonexistent/bwrap'.*apt-get install -y bubblewrap"
    ):
        MathToolEnv(n_tasks=1, python_tool=True, sandbox=SandboxLimits(bwrap="/nonexistent/bwrap"))


def test_a_bwrap_that_cannot_make_namespaces_is_refused() -> None:
    """bwrap installed but namespaces denied (a container, a sysctl): the named error, with the fix."""
    require_cgroup()  # made before bwrap starts
    directory = tempfile.mkdtemp(prefix="fake_bwrap_")
    try:
        fake = Path(directory, "bwrap")
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        os.chmod(directory, 0o755)  # the jail's host user (nobody, when we are root) must reach it
        limits = SandboxLimits(bwrap=str(fake))
        with pytest.raises(
            JailUnavailableError, match="No permissions to create new namespace.*user namespaces"
        ):
            MathToolEnv(n_tasks=1, python_tool=True, sandbox=limits)
        with pytest.raises(JailUnavailableError, match="could not set up the jail"):
            run_python("print(1)", limits)
    finally:
        fake.unlink()
        os.rmdir(directory)


def test_a_bwrap_that_never_builds_the_jail_is_killed_and_never_let_go(world: World) -> None:
    """A bwrap that never reports its jail is never released from --block-fd outside the call's cgroup:
    the trainer kills it and refuses (fail closed)."""
    require_cgroup()
    directory = tempfile.mkdtemp(prefix="fake_bwrap_")
    try:
        fake = Path(directory, "bwrap")
        fake.write_text(f"#!/bin/sh\nexec sleep {world.token}\n")
        fake.chmod(0o755)
        os.chmod(directory, 0o755)
        start = time.monotonic()
        with pytest.raises(JailUnavailableError, match="could not set up the jail"):
            run_python("print(1)", SandboxLimits(bwrap=str(fake), wall_seconds=1.0))
        assert time.monotonic() - start < 1.0 + 2.0 + 3.0
        assert _with_token(world.token) == []
    finally:
        fake.unlink()
        os.rmdir(directory)


def test_unsafe_mode_is_loud_and_contains_nothing(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """The control: without the jail, the same checks see the leak (so they can fail)."""
    limits = SandboxLimits(wall_seconds=2.0, jail=UNSAFE_NO_JAIL, audit_hook=False)
    code = world.fill(
        "import socket\nsocket.create_connection(('127.0.0.1', $port)).close()\nprint(open('$canary').read())"
    )
    with caplog.at_level("WARNING"):
        env = MathToolEnv(n_tasks=1, python_tool=True, sandbox=limits)
        first = env.step(env.tasks()[0], (0,), f"<python>{code}</python>")
        second = env.step(env.tasks()[0], (1,), "<python>print(2)</python>")
    assert CANARY in first.observation and second.observation == "<observation>2</observation>"
    world.listener.accept()[0].close()
    warnings = [r for r in caplog.records if UNSAFE_NO_JAIL in r.getMessage() and "NO jail" in r.getMessage()]
    assert len(warnings) == 3  # at start-up and at each of the two calls


def test_the_leftover_checks_see_a_live_process(world: World) -> None:
    """The control for the survivors check: a process of ours, with the token, is found by both scans."""
    process = subprocess.Popen(["sleep", str(world.token)])
    try:
        assert process.pid in _descendants(os.getpid())
        assert _with_token(world.token) == [process.pid]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert _with_token(world.token) == []


def test_the_seccomp_filter_is_what_refuses_ptrace_and_keyctl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the "namespace escapes" rows: with an allow-all filter the same calls succeed."""
    require_bwrap()
    code = (
        "import ctypes, os, platform, time\nlibc = ctypes.CDLL(None, use_errno=True)\nchild = os.fork()\n"
        "if child == 0:\n    time.sleep(5); os._exit(0)\n"
        f"keyctl = {SYSCALLS!r}[platform.machine()][0]\n"
        "print('ptrace', libc.ptrace(16, child, 0, 0), 'keyctl', libc.syscall(keyctl, 0, -3, 0) > 0)"
    )
    limits = SandboxLimits(**{**LIMITS.__dict__, "audit_hook": False})
    assert run_python(code, limits).output == "ptrace -1 keyctl False\n"
    monkeypatch.setattr(spawn, "seccomp_program", _allow_all_filter)
    assert run_python(code, limits).output == "ptrace 0 keyctl True\n"


def _allow_all_filter() -> bytes:
    libseccomp = jail._load_libseccomp()
    ctx = libseccomp.seccomp_init(jail._SCMP_ACT_ALLOW)
    fd = os.memfd_create("allow-all")
    try:
        assert libseccomp.seccomp_export_bpf(ctx, fd) == 0
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
        libseccomp.seccomp_release(ctx)


def test_a_launcher_that_never_reports_is_killed_by_the_backstop(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's own wall clock: a launcher that ignores the limit is killed, with its whole jail."""
    require_bwrap()
    stuck = (
        "import os, subprocess, sys, time\nos.write(int(sys.argv[-1]), b'S')\n"
        f"subprocess.Popen(['sleep', '{world.token}'])\ntime.sleep(60)\n"
    )
    monkeypatch.setattr(spawn, "launcher_source", lambda: stuck.encode())
    start = time.monotonic()
    result = run_python("print('never runs')", LIMITS)
    seconds = time.monotonic() - start
    assert result.timed_out and result.exit_code is None and result.error == "timed out after 2 s"
    assert LIMITS.wall_seconds + 2.0 <= seconds < DEADLINE
    assert _descendants(os.getpid()) - {world.victim.pid} == set() and _with_token(world.token) == []


def test_a_jail_built_but_too_slow_to_start_its_launcher_is_a_time_out(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded machine: bwrap built the jail, but its launcher had not even reported its start by the
    backstop. That is the call timing out, not a broken jail (which would refuse the tool)."""
    require_bwrap()
    silent = f"import subprocess, time\nsubprocess.Popen(['sleep', '{world.token}'])\ntime.sleep(60)\n"
    monkeypatch.setattr(spawn, "launcher_source", lambda: silent.encode())
    result = run_python("print('never runs')", LIMITS)
    assert result.timed_out and result.exit_code is None and result.error == "timed out after 2 s"
    assert _descendants(os.getpid()) - {world.victim.pid} == set() and _with_token(world.token) == []
