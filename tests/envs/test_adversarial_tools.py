"""Hostile calls against typed tools (envs/tools.py): arguments the schema refuses never reach the tool,
a string argument is bounded, and nothing a tool raises or returns can make `ToolEnv.step` raise.

The case that motivated it: `multiply(a: int, b: int)` called with `{"a": "x" * 15000, "b": 80000}`
ran `a * b` and grew the trainer by 1,145 MiB in 3.2 s. Now it is a tool error before the call.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from typing import Any

import pytest

from trace_lightning.envs.base import Task
from trace_lightning.envs.tools import MAX_ERROR_CHARS, MAX_STRING_CHARS, ToolCall, ToolEnv, run_call, schemas

CALLED: list[dict[str, Any]] = []


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    CALLED.append({"a": a, "b": b})
    return a * b


def scale(values: list[float], by: float = 1.0, labels: dict[str, int] | None = None) -> list[float]:
    """Scale numbers.

    Args:
        values: the numbers
        by: the factor
        labels: optional names
    """
    return [v * by for v in values]


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
    """
    return text


FUNCTIONS = {"multiply": multiply, "scale": scale, "echo": echo}
SCHEMAS = {s["function"]["name"]: s for s in schemas(list(FUNCTIONS.values()))}


def call(name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    return run_call(ToolCall(name, arguments), FUNCTIONS, SCHEMAS)


def tool_env(tool) -> ToolEnv:
    tasks = [Task(0, "Call the tool.", ("ok",))]
    return ToolEnv((tool,), tasks, lambda task, reply: float(reply == "ok"), name="hostile_tools")


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_the_hostile_multiply_is_a_short_tool_error_in_milliseconds_without_memory_growth():
    env = tool_env(multiply)
    task = env.tasks()[0]
    env.step(task, 0, hermes("multiply", {"a": 1, "b": 1}))  # warm up: jsonschema's first validator
    CALLED.clear()
    hostile = hermes("multiply", {"a": "x" * 15000, "b": 80000})
    tracemalloc.start()
    began = time.perf_counter()
    tr = env.step(task, 0, hostile)
    seconds = time.perf_counter() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tr.tool_error and not tr.done and CALLED == [], "the tool must not run"
    assert "'a' must be integer, not string" in tr.observation and len(tr.observation) < 400, tr.observation
    assert seconds < 0.010, f"{seconds * 1000:.1f} ms"
    assert peak < 10 * 2**20, f"{peak / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    ("name", "arguments", "said"),
    [
        ("multiply", {"a": True, "b": 2}, "'a' must be integer, not boolean"),
        ("multiply", {"a": "3", "b": 2}, "'a' must be integer, not string"),
        ("multiply", {"a": 2.5, "b": 2}, "'a' must be integer, not number"),
        ("multiply", {"a": [1], "b": 2}, "'a' must be integer, not array"),
        ("multiply", {"a": None, "b": 2}, "'a' must be integer, not null"),
        ("scale", {"values": [1, float("nan")]}, "finite numbers"),
        ("scale", {"values": [1.0], "by": float("inf")}, "finite numbers"),
        ("scale", {"values": "1, 2"}, "'values' must be array, not string"),
        ("scale", {"values": [1, "2"]}, "'values/1' must be number, not string"),
        ("scale", {"values": [1], "labels": [1]}, "'labels' must be object or null, not array"),
        ("scale", {"values": [1], "labels": {"k": "v"}}, "'labels/k' must be integer, not string"),
        ("echo", {"text": "x" * (MAX_STRING_CHARS + 1)}, f"the limit is {MAX_STRING_CHARS}"),
    ],
)
def test_arguments_the_schema_refuses_are_tool_errors_and_the_tool_never_runs(name, arguments, said):
    CALLED.clear()
    text, failed = call(name, arguments)
    assert failed and said in text and len(text) <= MAX_ERROR_CHARS, text
    assert CALLED == []


def test_valid_arguments_still_run_and_optional_parameters_take_null():
    assert call("scale", {"values": [1, 2.5], "by": 2, "labels": None}) == ("[2, 5.0]", False)
    assert call("echo", {"text": "x" * MAX_STRING_CHARS}) == ("x" * MAX_STRING_CHARS, False)
    string = schemas([echo])[0]["function"]["parameters"]["properties"]["text"]
    assert string["maxLength"] == MAX_STRING_CHARS  # the model sees the bound in the tool list


def test_a_hostile_tool_name_or_argument_name_is_not_echoed_back():
    for name, arguments in [("n" * 15000, {}), ("multiply", {"a": 1, "b": 2, "k" * 15000: 1})]:
        text, failed = call(name, arguments)
        assert failed and len(text) <= MAX_ERROR_CHARS


class RaisingStr:
    def __str__(self) -> str:
        raise KeyError("x")


class RaisingRepr:  # no __str__: str() falls back to __repr__
    def __repr__(self) -> str:
        raise AttributeError("x")


class NonStrStr:
    def __str__(self) -> Any:
        return 42


class UnshowableError(Exception):
    def __str__(self) -> str:
        raise KeyError("x")


class NonStrError(Exception):
    def __str__(self) -> Any:
        return b"bytes"


def returns(value: Any):
    def tool(x: int) -> str:
        """Return a value.

        Args:
            x: unused
        """
        return value

    return tool


def raises(err: Exception):
    def tool(x: int) -> str:
        """Raise.

        Args:
            x: unused
        """
        raise err

    return tool


@pytest.mark.parametrize(
    ("tool", "said"),
    [
        (returns(RaisingStr()), "error: tool's result could not be shown (RaisingStr)"),
        (returns(RaisingRepr()), "error: tool's result could not be shown (RaisingRepr)"),
        (returns(NonStrStr()), "error: tool's result could not be shown (NonStrStr)"),
        (returns([RaisingStr()]), "error: tool's result could not be shown (list)"),
        (raises(UnshowableError()), "error: tool failed: UnshowableError (its message could not be shown)"),
        (raises(NonStrError()), "error: tool failed: NonStrError (its message could not be shown)"),
    ],
)
def test_a_result_or_exception_that_cannot_be_shown_is_a_tool_error_not_an_exception(tool, said):
    env = tool_env(tool)
    task = env.tasks()[0]
    tr = env.step(task, 0, hermes("tool", {"x": 1}))
    assert tr.tool_error and not tr.done and tr.observation == f"<tool_response>{said}</tool_response>"
