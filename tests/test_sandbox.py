"""The sandbox's behaviour for ordinary programs: output, errors, limits, the tool's wiring.

What it contains (hostile programs, the jail, failing closed) is tested in test_jail.py.
"""

import signal

import pytest
from helpers import require_bwrap

from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.sandbox import SandboxLimits, SandboxResult, format_observation, run_python

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=5, memory_mb=256)


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
