"""Tools as typed functions (envs/tools.py): the schema generated from a signature and docstring, the
hermes and llama3_json parsers, tool errors that never raise, the chat template rendering the tool
list, and the example's typed-tool environment passing check_environment and replaying its
demonstrations in both formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_lightning import models as tl_models
from trace_lightning.demos import demonstrations
from trace_lightning.envs.base import Task
from trace_lightning.envs.check import check_environment
from trace_lightning.envs.tools import (
    BadCall,
    ToolCall,
    ToolEnv,
    parse_hermes,
    parse_llama3_json,
    run_call,
    schemas,
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "capitals"


def add(a: int, b: int = 0) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def test_the_schema_comes_from_the_signature_and_the_docstring():
    assert schemas([add]) == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "the first number"},
                        "b": {"type": "integer", "description": "the second number"},
                    },
                    "required": ["a"],
                },
                "return": {"type": "integer"},
            },
        }
    ]

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="tool 'undocumented'"):
        schemas([undocumented])


def assert_parsed(got, expected):
    """`expected`: the call, None (no call), or a phrase the BadCall's message must hold."""
    if isinstance(expected, str):
        assert isinstance(got, BadCall) and expected in got.message
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', ToolCall("add", {"a": 1})),
        ("the answer is 3", None),
        ('<tool_call>{"name": "add"', "not closed"),
        ("<tool_call>{name: add}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", "not valid JSON"),
    ],
)
def test_hermes_calls(text, expected):
    assert_parsed(parse_hermes(text), expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "add", "parameters": {"a": 2, "b": 3}}', ToolCall("add", {"a": 2, "b": 3})),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 2}}', ToolCall("add", {"a": 2})),
        ("Rome", None),
        ('{"name": "add", "parameters": 5}', "must be a JSON object"),
        ('{"name": ', "not valid JSON"),
    ],
)
def test_llama3_json_calls(text, expected):
    assert_parsed(parse_llama3_json(text), expected)


def test_bad_calls_are_tool_errors_never_exceptions():
    functions, by_name = {"add": add}, {s["function"]["name"]: s for s in schemas([add])}
    assert run_call(ToolCall("add", {"a": 2, "b": 3}), functions, by_name) == ("5", False)
    for call, said in [
        (ToolCall("sub", {"a": 1}), "no tool named 'sub'"),
        (ToolCall("add", {}), "needs the argument(s) ['a']"),
        (ToolCall("add", {"a": 1, "c": 2}), "takes no argument(s) ['c']"),
        (ToolCall("add", {"a": "x", "b": 1}), "add's argument 'a' must be integer, not string"),
        (ToolCall("add", {"a": 10**20}), "an integer beyond"),
    ]:
        text, failed = run_call(call, functions, by_name)
        assert failed and said in text, text


def test_a_tool_env_built_from_arguments_needs_no_subclass():
    tasks = [Task(i, f"What is {i} + 2?", (str(i + 2),)) for i in range(3)]
    env = ToolEnv((add,), tasks, lambda task, reply: float(reply.strip() == task.answer[0]), name="adder")
    assert (env.name, env.tool_format, env.max_calls) == ("adder", "hermes", 8)  # unset: the defaults
    assert check_environment(env) == []
    task = tasks[1]
    called = env.step(task, 0, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert (called.observation, called.state) == ("<tool_response>3</tool_response>", 1)
    assert env.step(task, called.state, "3").reward == 1.0
    with pytest.raises(NotImplementedError, match="pass tasks="):
        ToolEnv((add,)).tasks()


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import capitals_env

    return capitals_env


@pytest.mark.parametrize("tool_format", ["hermes", "llama3_json"])
def test_the_typed_tool_example_passes_the_check_and_replays_its_demonstrations(example, tool_format):
    env = example.CapitalsToolEnv(n_tasks=20, tool_format=tool_format)
    assert check_environment(env) == []
    demos, missing = demonstrations(env, {0, 1, 2})
    assert missing == 0 and all(d.reward == 1.0 and len(d.actions) == 3 for d in demos)
    task = env.tasks()[0]
    bad = env.step(task, 0, '<tool_call>{"name": "lookup", "arguments": {"code": "ZZ"}}</tool_call>')
    if tool_format == "hermes":  # an unknown code: the tool raised, the policy reads why
        assert bad.tool_error and "lookup failed: KeyError" in bad.observation and not bad.done


def tools_template() -> str:
    """ChatML that lists `tools` in the system turn, as Qwen-style templates do (written for this test)."""
    return (
        "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
        "{%- if message['role'] == 'system' and tools %}\n<tools>{% for t in tools %}\n{{ t | tojson }}"
        "{% endfor %}\n</tools>{% endif %}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )


def test_the_chat_template_renders_the_tool_list_or_the_system_prompt_carries_it(example):
    env = example.CapitalsToolEnv(n_tasks=4)
    task = env.tasks()[0]
    tok = tl_models.build_tiny_tokenizer()
    tok.chat_template = tools_template()
    text = tok.decode(env.prompt_ids(task, tok))
    assert "<tools>" in text and json.dumps(env._schemas[0]) in text and task.question in text
    plain = tl_models.build_tiny_tokenizer()  # a template that ignores `tools`
    text = plain.decode(env.prompt_ids(task, plain))
    assert "<tools>" not in text and '"name": "lookup"' in text and "<tool_call>" in text
