"""`check_environment` against three small user environments that crash or stall the runner, each of
which the check once passed or died on: an echo tool (a JSON escape becomes a lone surrogate the
tokenizer cannot encode), a step that parses with argparse (SystemExit(2) killed the check's own
command line) and a step that never returns (the check waited forever). Each problem must be named
(environment, probe, cause), and `python -m trace_lightning.check` must exit 1 within 60 s."""

from __future__ import annotations

import argparse
import shlex
import threading
import time
from pathlib import Path

import pytest

from trace_lightning.check import main
from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.check import MAX_HANGS, check_environment
from trace_lightning.envs.tools import ToolEnv

NEVER = threading.Event()  # the hanging env waits on it; set only at teardown, to free the threads


def echo(text: str) -> str:
    """Says the text back.

    Args:
        text: what to say
    """
    return text


class EchoEnv(ToolEnv):
    """A typed-tool env whose tool returns its argument: `{"text": "\\ud800"}` comes back as a lone
    surrogate in the observation."""

    name = "echo"
    tools = (echo,)

    def tasks(self):
        return [Task(0, "Say hi.", ("hi",)), Task(1, "Say bye.", ("bye",))]

    def score(self, task, reply):
        return float(reply.strip() == task.answer[0])


class TagEnv:
    """One task, one `<run>` action; `respond(argument)` decides the step."""

    name = "tag"
    system_prompt = "Reply <run>--n 3</run>."
    stop_strings = ("</run>",)
    actions = ("run",)

    def tasks(self):
        return [Task(0, "?", ("3",))]

    def initial_state(self, task):
        return ()

    def step(self, task, state, action_text):
        start, end = action_text.find("<run>"), action_text.find("</run>")
        if start < 0 or end < start:
            return Transition("write <run>--n N</run>", False, None, None, state, format_error=True)
        return self.respond(action_text[start + len("<run>") : end])

    def respond(self, argument: str) -> Transition:
        raise NotImplementedError


class ArgparseEnv(TagEnv):
    """Parses its argument with argparse, which exits (SystemExit(2)) on a bad one."""

    name = "argparse"

    def respond(self, argument):
        parser = argparse.ArgumentParser(prog="run")
        parser.add_argument("--n", type=int, required=True)
        n = parser.parse_args(shlex.split(argument)).n
        return Transition("", True, float(n == 3), "answer", ())


class HangingEnv(TagEnv):
    """A step that blocks forever (a tool waiting on a socket that never answers)."""

    name = "hanging"

    def step(self, task, state, action_text):
        NEVER.wait()
        return Transition("", True, 0.0, "answer", state)


class VerboseEnv(TagEnv):
    """Returns 30,000 characters whatever it is asked."""

    name = "verbose"

    def step(self, task, state, action_text):
        return Transition("ab" * 15_000, False, None, None, state)


@pytest.fixture(autouse=True)
def free_hung_steps():
    yield
    NEVER.set()  # the abandoned step threads return, instead of waiting until the interpreter exits
    NEVER.clear()


def _named(problems: list[str], env: str, *parts: str) -> bool:
    return any(p.startswith(f"env={env}, probe ") and all(x in p for x in parts) for p in problems)


def test_an_echoed_json_escape_is_a_lone_surrogate_named_on_the_tool_probe():
    problems = check_environment(EchoEnv(), tasks=1)
    assert _named(problems, "echo", "echo(text=<lone surrogate>)", "lone surrogate", "encode('utf-8'")
    assert all(p.isprintable() for p in problems)  # the surrogate itself is shown escaped


def test_the_runner_tokenizer_really_fails_on_that_observation(tiny_model_dir):
    """Why a lone surrogate is a problem: the tokenizer the runner feeds observations to raises on it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    observation = EchoEnv().step(Task(0, "", ()), 0, '<tool_call>{"name": "echo", "arguments": '
                                 '{"text": "\\ud800"}}</tool_call>').observation  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017  (TypeError from the Rust tokenizer, by version)
        tokenizer(observation, add_special_tokens=False, split_special_tokens=True)
    problems = check_environment(EchoEnv(), tasks=1, tokenizer=tokenizer)
    assert _named(problems, "echo", "lone surrogate")


def test_argparse_exiting_in_a_step_is_a_named_problem_not_an_exit():
    problems = check_environment(ArgparseEnv())
    assert _named(problems, "argparse", "step raised SystemExit: 2", "catch SystemExit")


def test_a_step_that_never_returns_is_named_and_the_check_stops():
    began = time.monotonic()
    problems = check_environment(HangingEnv(), step_seconds=0.2)
    assert time.monotonic() - began < 10
    assert _named(problems, "hanging", "step did not return within 0.2 s", "env_timeout")
    assert any(f"stopped after {MAX_HANGS} calls" in p for p in problems), problems


def test_keyboard_interrupt_still_stops_the_check():
    class Interrupted(TagEnv):
        def step(self, task, state, action_text):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check_environment(Interrupted())


def test_long_observations_are_bounded_in_characters_and_in_tokens():
    def tokenizer(text, **kwargs):  # one token per character, as the runner calls it
        assert kwargs == {"add_special_tokens": False, "split_special_tokens": True}
        return {"input_ids": list(range(len(text)))}

    assert _named(check_environment(VerboseEnv()), "verbose", "30,000 characters (bound 20,000)")
    problems = check_environment(VerboseEnv(), tokenizer=tokenizer, max_observation_tokens=100)
    assert _named(problems, "verbose", "is 4000 tokens (bound 100)"), problems


@pytest.fixture
def conf(tmp_path: Path) -> str:
    """A Hydra search path with env=echo, env=argparse and env=hanging pointing at this module."""
    (tmp_path / "env").mkdir()
    for name, cls in [("echo", EchoEnv), ("argparse", ArgparseEnv), ("hanging", HangingEnv)]:
        (tmp_path / "env" / f"{name}.yaml").write_text(f"_target_: {__name__}.{cls.__name__}\n")
    return f"hydra.searchpath=[file://{tmp_path}]"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ("echo", "lone surrogate"),
        ("argparse", "step raised SystemExit: 2"),
        ("hanging", "step did not return within 5.0 s"),
    ],
)
def test_the_command_line_exits_1_naming_each_problem_within_a_minute(env, named, conf, capsys):
    began = time.monotonic()
    assert main([f"env={env}", conf]) == 1
    assert time.monotonic() - began < 60
    out = capsys.readouterr().out
    assert f"- env={env}, probe " in out and named in out, out[-3000:]
    assert out.rstrip().endswith("problem(s)") and "\x1b" not in out and "\ud800" not in out
