"""The sandbox contains hostile programs, every time.

`HOSTILE` runs with every layer (namespaces where the machine allows them, plus the audit hook) and
with the audit hook alone (what a machine without namespaces gets): each program must be refused or
cut off. `KERNEL_ONLY` turns the audit hook off, to show that the namespaces and rlimits hold on their
own. After every run: nothing outside the scratch dir changed, the fake secret did not leak, no process
survived, no connection reached the trainer's port, and the call returned within the wall limit + 2 s.
"""

import os
import secrets
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import SandboxLimits, SandboxResult, _run, format_observation, run_python

# Wall < CPU, so a busy loop hits the wall; 256 MB, so filling memory takes well under the wall limit.
LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=5, memory_mb=256)
DEADLINE = LIMITS.wall_seconds + 2.0
SECRET = "hunter2"
MARKER = f"trace_sandbox_{os.getpid()}_"  # in the HOME of every sandbox process this test starts


@dataclass(frozen=True)
class Hostile:
    name: str
    code: str  # formatted with {pwned}, {victim}, {port} (the trainer's open port), {trainer} (our pid)
    error: str | None  # a substring of the reported error; None: the program runs, and must leak nothing
    output: str = ""  # a substring of the output (that the program got as far as it meant to)


HOSTILE = [
    Hostile("infinite loop", "while True: pass", "timed out"),
    Hostile("fork bomb", "import os\nwhile True: os.fork()", "os.fork"),
    Hostile("huge allocation", "x = bytearray(10**10)", "MemoryError"),
    Hostile("growing list", "x = []\nwhile True: x.append(bytearray(10**7))", "MemoryError"),
    Hostile("write outside scratch", "open({pwned!r}, 'w').write('pwned')", "writing"),
    Hostile("delete outside scratch", "import shutil; shutil.rmtree({victim!r})", "shutil.rmtree"),
    Hostile("read environment", "import os; print(dict(os.environ))", None, "HOME"),
    Hostile("read /etc/passwd", "print(open('/etc/passwd').read())", "reading '/etc/passwd'"),
    Hostile("open a socket", "import socket; socket.socket()", "socket.__new__"),
    Hostile(
        "connect to trainer port", "import socket; socket.create_connection(('127.0.0.1', {port}))", "socket."
    ),
    Hostile("huge output", "print('x' * 10**8)", "File too large", "xxxx"),
    Hostile("kill the parent", "import os; os.kill(os.getppid(), 9)", "os.kill"),
    Hostile("kill the trainer", "import os; os.kill({trainer}, 9)", "os.kill"),
    Hostile(
        "kill via pidfd",
        "import os, signal; signal.pidfd_send_signal(os.pidfd_open({trainer}), 9)",
        "pidfd_open",
    ),
    Hostile(
        "spawn a subprocess",
        "import subprocess; subprocess.run(['sh', '-c', 'echo hi'])",
        "import subprocess",
    ),
    Hostile("shell out", "import os; os.system('echo hi')", "os.system"),
    Hostile("load libc", "import ctypes; ctypes.CDLL(None).kill({trainer}, 9)", "import ctypes"),
]

_DAEMONS = """import os, time
for _ in range(5):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
if os.fork() == 0:
    os.setsid()  # a daemon: its own session and group, out of reach of a process-group kill
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("spawned")
"""
# With the audit hook off. No fork bomb here: as root RLIMIT_NPROC is not enforced, and a real one
# would fill the shared machine's process table for the whole wall limit.
KERNEL_ONLY = [
    Hostile("infinite loop", "while True: pass", "timed out"),
    Hostile("huge allocation", "x = bytearray(10**10)", "MemoryError"),
    Hostile("huge output", "print('x' * 10**8)", "File too large", "xxxx"),
    Hostile("read environment", "import os; print(dict(os.environ))", None, "HOME"),
    Hostile(
        "connect to trainer port",
        "import socket; socket.create_connection(('127.0.0.1', {port}))",
        "unreachable",
    ),
    Hostile("kill the trainer", "import os; os.kill({trainer}, 9)", "No such process"),
    Hostile(
        "kill via pidfd",
        "import os, signal; signal.pidfd_send_signal(os.pidfd_open({trainer}), 9)",
        "No such process",
    ),
    Hostile("daemonised grandchildren", _DAEMONS, None, "spawned"),
    Hostile(
        "subprocess left running",
        "import subprocess; subprocess.Popen(['sleep', '60']); print('ok')",
        None,
        "ok",
    ),
]


@dataclass
class World:
    """What the hostile programs go after, set up fresh for each test."""

    pwned: Path
    victim: Path
    listener: socket.socket

    def fill(self, code: str) -> str:
        port = self.listener.getsockname()[1]
        return code.format(pwned=str(self.pwned), victim=str(self.victim), port=port, trainer=os.getpid())


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[World]:
    monkeypatch.setenv("TRACE_SECRET", SECRET)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        yield World(Path(tempfile.gettempdir()) / f"pwned_{secrets.token_hex(8)}", victim, listener)


def _survivors() -> list[int]:
    """Processes started by a sandbox of this test process (their HOME is our scratch dir)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes() if entry.isdigit() else b""
        except OSError:  # exited meanwhile
            continue
        if MARKER.encode() in environ:
            found.append(int(entry))
    return found


def _assert_contained(row: Hostile, result: SandboxResult, seconds: float, world: World) -> None:
    assert seconds < DEADLINE, f"took {seconds:.1f} s"
    if row.error is None:
        assert result.ok, result.error
    else:
        assert not result.ok and row.error in (result.error or ""), result.error
    assert row.output in result.output
    assert SECRET not in result.output + (result.error or "")
    assert (
        len(result.output) <= LIMITS.max_output_chars and len(result.error or "") <= LIMITS.max_output_chars
    )
    assert not world.pwned.exists() and (world.victim / "keep.txt").read_text() == "keep"
    with pytest.raises(BlockingIOError):  # nothing connected to the trainer's port
        world.listener.accept()
    deadline = time.monotonic() + 1.0  # a group kill is asynchronous; a namespace teardown is not
    while _survivors() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors() == []
    assert not list(Path(tempfile.gettempdir()).glob(f"{MARKER}*")), "scratch dir left behind"


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces+hook", "hook-only"])
@pytest.mark.parametrize("row", HOSTILE, ids=[row.name for row in HOSTILE])
def test_hostile_program_is_contained(row: Hostile, namespaces: bool, world: World) -> None:
    start = time.monotonic()
    result = _run(world.fill(row.code), LIMITS, namespaces=namespaces)
    _assert_contained(row, result, time.monotonic() - start, world)


@pytest.fixture(scope="module")
def namespaces_available() -> bool:
    return _run("pass", LIMITS).namespaces


@pytest.mark.parametrize("row", KERNEL_ONLY, ids=[row.name for row in KERNEL_ONLY])
def test_kernel_layers_hold_without_the_audit_hook(
    row: Hostile, world: World, namespaces_available: bool
) -> None:
    if not namespaces_available:
        pytest.skip("no network/PID namespaces here (needs root or CAP_SYS_ADMIN)")
    start = time.monotonic()
    result = _run(world.fill(row.code), LIMITS, audit_hook=False)
    assert result.namespaces
    _assert_contained(row, result, time.monotonic() - start, world)


def test_control_without_any_layer_the_port_is_reachable(world: World) -> None:
    """The connection check above can fail: with both layers off, the program does reach the port."""
    code = world.fill("import socket; socket.create_connection(('127.0.0.1', {port})).close(); print('in')")
    result = _run(code, LIMITS, namespaces=False, audit_hook=False)
    assert result.ok and result.output == "in\n"
    world.listener.accept()[0].close()


def test_namespaces_are_used_as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: namespaces are used only where unshare is permitted")
    assert run_python("pass", LIMITS).namespaces


def test_normal_program_prints_its_result() -> None:
    result = run_python("import math\nprint(sum(range(10)), math.comb(5, 2))", LIMITS)
    assert result == SandboxResult(True, "45 10\n", None, False, 0, result.namespaces)
    assert format_observation(result) == "<observation>45 10</observation>"
    assert format_observation(run_python("x = 1", LIMITS)).startswith("<observation>(no output")


def test_exit_code_is_reported() -> None:
    result = run_python("print('bye')\nraise SystemExit(3)", LIMITS)
    assert (result.ok, result.exit_code, result.error, result.output) == (False, 3, "exit code 3", "bye\n")
    assert format_observation(result) == "<observation>bye\nerror: exit code 3</observation>"


def test_traceback_shows_the_program_not_the_sandbox() -> None:
    result = run_python("x = 1\nprint(x / 0)", LIMITS)
    assert 'File "main.py", line 2' in (result.error or "") and "ZeroDivisionError" in (result.error or "")
    assert "sandbox.py" not in (result.error or "")


def test_cpu_limit_kills_a_busy_loop() -> None:
    # No bound on the elapsed time: on a busy machine 1 s of CPU can take several seconds of wall time.
    result = run_python("while True: pass", SandboxLimits(wall_seconds=20.0, cpu_seconds=1))
    assert not result.timed_out and result.exit_code == -signal.SIGKILL
    assert result.error == "killed at the CPU time limit (1 s)"


def test_output_and_error_are_truncated_to_the_bound() -> None:
    limits = SandboxLimits(max_output_chars=100)
    result = run_python(
        "import sys\nprint('y' * 5000)\nprint('z' * 5000, file=sys.stderr)\nraise SystemExit(1)", limits
    )
    output, error = result.output, result.error or ""
    assert len(output) == 100 and output.startswith("yyy") and output.endswith("[output truncated]")
    assert len(error) <= 100 and error.startswith("[output truncated]") and error.endswith("zzz")


def test_program_may_use_its_scratch_dir() -> None:
    code = (
        "open('notes.txt', 'w').write('7')\nimport os\nprint(open('notes.txt').read(), sorted(os.listdir()))"
    )
    result = run_python(code, LIMITS)
    assert result.ok and result.output == "7 ['main.py', 'notes.txt']\n"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wall_seconds", 0),
        ("cpu_seconds", 0.5),
        ("memory_mb", 8),
        ("max_output_chars", 10),
        ("max_processes", True),
    ],
)
def test_limits_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"env.sandbox.{field}"):
        SandboxLimits(**{field: value})


def test_python_tool_is_off_by_default() -> None:
    env = MathToolEnv(n_tasks=1)
    assert "<python>" not in env.system_prompt and "</python>" not in env.stop_strings
    step = env.step(env.tasks()[0], (0,), "<python>print(1)</python>")
    assert step.format_error and step.tool is None and "unknown action <python>" in step.observation
    with pytest.raises(ValueError, match="env.python_tool"):
        MathToolEnv(n_tasks=1, sandbox=LIMITS)
    with pytest.raises(TypeError, match="SandboxLimits"):
        MathToolEnv(n_tasks=1, python_tool=True, sandbox={"wall_seconds": 1.0})  # type: ignore[arg-type]


def test_python_tool_runs_code_in_the_sandbox() -> None:
    env = MathToolEnv(n_tasks=1, python_tool=True, sandbox=LIMITS)
    assert "<python>" in env.system_prompt and "</python>" in env.stop_strings
    step = env.step(env.tasks()[0], (0,), "Let me compute.\n<python>\nprint(12 * 7)\n</python>")
    assert (step.observation, step.tool, step.tool_error, step.done, step.state) == (
        "<observation>84</observation>",
        "python",
        False,
        False,
        (1,),
    )


@pytest.mark.parametrize(
    "name", ["infinite loop", "fork bomb", "open a socket", "kill the parent", "write outside scratch"]
)
def test_hostile_code_is_a_tool_error_observation(name: str, world: World) -> None:
    row = next(row for row in HOSTILE if row.name == name)
    env = MathToolEnv(n_tasks=1, python_tool=True, sandbox=LIMITS)
    start = time.monotonic()
    step = env.step(env.tasks()[0], (2,), f"<python>{world.fill(row.code)}</python>")
    assert time.monotonic() - start < DEADLINE
    assert step.tool == "python" and step.tool_error and not step.done and step.state == (3,)
    assert step.observation.startswith("<observation>error: ") and row.error in step.observation
    assert not world.pwned.exists()
