"""The sandbox's behaviour for ordinary programs: output, errors, limits, the tool's wiring.

What it contains (hostile programs, the jail, failing closed) is tested in test_jail.py.
"""

import json
import os
import signal
import time

import hydra
import pytest
from helpers import require_bwrap
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import trace_lightning.envs.sandbox as sandbox_package
from trace_lightning import config
from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import SandboxLimits, SandboxResult, format_observation, run_python, spawn
from trace_lightning.envs.sandbox.output import TRUNCATED, Capture
from trace_lightning.envs.sandbox.run import describe_failure

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=5, memory_mb=256)
_ANY = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
_EXIT = st.integers(min_value=-70, max_value=300) | _ANY  # real-time signals are -34 .. -64
_REPORTS = st.fixed_dictionaries({"timed_out": st.booleans() | _ANY, "exit_code": _EXIT, "cpu_seconds": _ANY})


@pytest.fixture
def bwrap() -> None:
    require_bwrap()


needs_jail = pytest.mark.usefixtures("bwrap")


@needs_jail
def test_normal_program_prints_its_result() -> None:
    result = run_python("import math\nprint(sum(range(10)), math.comb(5, 2))", LIMITS)
    assert result == SandboxResult(True, "45 10\n", None, False, 0, jailed=True)
    assert format_observation(result) == "<observation>45 10</observation>"
    assert format_observation(run_python("x = 1", LIMITS)).startswith("<observation>(no output")


@needs_jail
def test_exit_code_is_reported() -> None:
    result = run_python("print('bye')\nraise SystemExit(3)", LIMITS)
    assert (result.ok, result.exit_code, result.error, result.output) == (False, 3, "exit code 3", "bye\n")
    assert format_observation(result) == "<observation>bye\nerror: exit code 3</observation>"


@needs_jail
def test_traceback_shows_the_program_not_the_sandbox() -> None:
    result = run_python("x = 1\nprint(x / 0)", LIMITS)
    assert 'File "main.py", line 2' in (result.error or "") and "ZeroDivisionError" in (result.error or "")
    assert "sandbox.py" not in (result.error or "")


@needs_jail
def test_cpu_limit_kills_a_busy_loop() -> None:
    # No bound on the elapsed time: on a busy machine 1 s of CPU can take several seconds of wall time.
    result = run_python("while True: pass", SandboxLimits(wall_seconds=20.0, cpu_seconds=1))
    assert not result.timed_out and result.exit_code == -signal.SIGKILL
    assert result.error == "killed at the CPU time limit (1 s)"


@needs_jail
def test_output_and_error_are_truncated_to_the_bound() -> None:
    limits = SandboxLimits(max_output_chars=100)
    result = run_python(
        "import sys\nprint('y' * 5000)\nprint('z' * 5000, file=sys.stderr)\nraise SystemExit(1)", limits
    )
    output, error = result.output, result.error or ""
    assert len(output) == 100 and output.startswith("yyy") and output.endswith("[output truncated]")
    assert len(error) <= 100 and error.startswith("[output truncated]") and error.endswith("zzz")


@needs_jail
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
        ("scratch_mb", 0),
        ("jail", "none"),
        ("python", "/opt/python/bin/python3"),
        ("audit_hook", "yes"),
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
    assert MathToolEnv(n_tasks=1, sandbox=LIMITS).stop_strings == env.stop_strings  # limits alone add no tool
    with pytest.raises(TypeError, match="SandboxLimits"):
        MathToolEnv(n_tasks=1, python_tool=True, sandbox={"wall_seconds": 1.0})  # type: ignore[arg-type]


@needs_jail
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


# -- output through bounded pipes, any exit status, any text ---------------------------------


@needs_jail
def test_stdout_and_stderr_are_pipes_not_host_files() -> None:
    """fallocate on a host temp file took 8 GiB of disk in round 2's red team; a pipe has no blocks."""
    code = "import os, stat\nprint([stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (1, 2)])"
    assert run_python(code, LIMITS).output == "[True, True]\n"


@needs_jail
def test_a_program_that_prints_on_and_on_is_cut_off_at_the_pipe_cap() -> None:
    """The trainer reads at most MAX_PIPE_BYTES of stdout, then closes it: the writer gets EPIPE."""
    code = "import sys\nfor _ in range(10**6):\n    sys.stdout.write('y' * 65536)"
    start = time.monotonic()
    result = run_python(code, SandboxLimits(wall_seconds=20.0, cpu_seconds=20, max_output_chars=100))
    assert time.monotonic() - start < 10  # long before the wall clock
    assert not result.ok and "BrokenPipeError" in (result.error or "")
    assert result.output.startswith("yyy") and result.output.endswith(TRUNCATED)


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        (3, "exit code 3"),
        (-9, "killed by SIGKILL"),
        (-39, "killed by SIGRTMIN+5"),  # a real-time signal: round 2 made step() raise ValueError
        (-64, "killed by SIGRTMAX"),
        (-1000, "killed by signal 1000"),
        (None, "the jail's launcher was killed before it could report (the program may have killed it)"),
    ],
)
def test_every_exit_status_is_described(exit_code: int | None, expected: str) -> None:
    status = {"timed_out": False, "exit_code": exit_code, "cpu_seconds": 0.0}
    assert describe_failure(status, "", LIMITS) == expected


def test_an_out_of_memory_kill_is_named_with_the_limit() -> None:
    killed = {"timed_out": False, "exit_code": -9, "cpu_seconds": 0.1}
    assert describe_failure(killed, "", LIMITS, oom_kills=1).startswith("killed at the memory limit (256 MB")
    late = {"timed_out": True, "exit_code": -9, "cpu_seconds": 0.1}
    assert describe_failure(late, "", LIMITS, oom_kills=2) == (
        "timed out after 2 s (2 of its processes were killed at the memory limit, 256 MB)"
    )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.builds(lambda v: json.dumps(v).encode(), _REPORTS | _ANY))
def test_any_status_report_becomes_a_sentence(data: bytes) -> None:
    """The program can reach the launcher's status pipe: whatever it holds, the trainer makes a sentence."""
    status = spawn._parse_report(data, exited=True)
    assert isinstance(describe_failure(status, "", LIMITS), str)


def test_a_lone_surrogate_in_the_program_is_a_tool_error() -> None:
    """Round 2: `code.encode()` raised UnicodeEncodeError out of step(); now it is the model's error."""
    result = run_python("print('\ud800')", LIMITS)  # an unpaired surrogate in the program's text
    assert (result.ok, result.exit_code, result.output) == (False, None, "")
    assert (
        result.error == "the program is not valid text: surrogates not allowed at character 7; it did not run"
    )


@needs_jail
def test_invalid_utf8_output_is_replaced_not_raised() -> None:
    code = (
        "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe \\xed\\xa0\\x80')\n"
        "sys.stderr.buffer.write(b'\\xc3')\nraise SystemExit(2)"
    )
    result = run_python(code, LIMITS)
    assert result.output == "ok \ufffd\ufffd \ufffd\ufffd\ufffd" and result.error == "\ufffd"


def test_captures_keep_the_head_of_stdout_and_the_tail_of_stderr() -> None:
    read, write = os.pipe()
    head, tail = Capture(read, keep=8, tail=False), Capture(-1, keep=8, tail=True)
    for chunk in (b"0123", b"456789", b"abcdef"):
        head.take(chunk)
        tail.take(chunk)
    assert (bytes(head.data), bytes(tail.data), head.total) == (b"01234567", b"89abcdef", 16)
    assert (
        head.text(100) == "01234567\n[output truncated]" and tail.text(100) == "[output truncated]\n89abcdef"
    )
    head.close()
    head.close()  # once only: a number closed twice may already be another thread's file
    os.close(write)


def test_the_sandbox_package_exports_and_its_public_target() -> None:
    """`trace_lightning.envs.sandbox.SandboxLimits` is a Hydra _target_, part of checkpoint fingerprints."""
    from trace_lightning.envs.sandbox import jail, limits, run

    assert hydra.utils.get_class("trace_lightning.envs.sandbox.SandboxLimits") is limits.SandboxLimits
    for name in ("SandboxResult", "UNSAFE_NO_JAIL", "JAILS"):
        assert getattr(sandbox_package, name) is getattr(limits, name)
    for name in ("run_python", "check_sandbox", "format_observation"):
        assert getattr(sandbox_package, name) is getattr(run, name)
    assert sandbox_package.JailUnavailableError is jail.JailUnavailableError


def test_the_sandbox_config_node_is_what_checkpoints_before_the_move_carry() -> None:
    """The env fingerprint holds env.sandbox: composed here, it equals the node main composed at 6395ee8."""
    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        node = compose("train", overrides=["env=math_tool", "run_dir=/tmp/unused"]).env.sandbox
    GlobalHydra.instance().clear()
    assert OmegaConf.to_container(node) == {
        "_target_": "trace_lightning.envs.sandbox.SandboxLimits",
        "wall_seconds": 5.0,
        "cpu_seconds": 5,
        "memory_mb": 512,
        "max_output_chars": 2000,
        "max_processes": 32,
        "scratch_mb": 64,
        "jail": "bwrap",
        "bwrap": "bwrap",
        "python": "/usr/bin/python3",
        "audit_hook": True,
    }
