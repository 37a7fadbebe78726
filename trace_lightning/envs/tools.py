"""Tools as typed Python functions: their JSON schema generated from the signature and docstring
(`transformers.utils.get_json_schema`), the tool list rendered by the model's chat template
(`apply_chat_template(..., tools=...)`), and calls parsed in the model family's own format.

    def lookup(code: str) -> str:
        '''A country's name, capital and population.

        Args:
            code: the country's two-letter code, e.g. FR
        '''

    class MyEnv(ToolEnv):
        tools = (lookup,)
        tool_format = "hermes"            # env.tool_format: a key of PARSERS
        def score(self, task, reply): ...  # the final reply's reward in [0, 1]

Formats (`PARSERS`, one registry): `hermes` (also `qwen`): `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, the format of Hermes, Qwen 2.5/3 and SmolLM3 templates; `llama3_json`: the turn is
one JSON object `{"name": ..., "parameters": {...}}`, Llama 3.1's JSON tool calling. A turn with no
call is the final reply. A malformed call (bad JSON, an unknown tool, a missing or unexpected
argument, an argument the tool's schema refuses, a tool that raises, a result that cannot be shown)
is answered with a tool-error observation saying what to write, never an exception: it counts in
`rollout/format_errors` or `rollout/tool_errors`. The model's output is hostile input: arguments are
checked against the schema (`jsonschema`) before the tool runs, so `multiply(a: int, b: int)` never
sees `a="x" * 15000` (which `a * b` would turn into a gigabyte).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from trace_lightning.envs.base import Task, Transition

MAX_CALL_CHARS = 16_000  # a call longer than this is refused before it is parsed
MAX_RESULT_CHARS = 4_000  # a tool's result is cut to this (the runner also bounds observations)
MAX_ARGUMENT_DEPTH = 16  # nesting of a call's JSON (lists and objects); the shipped tools need 2
MAX_ARGUMENT_INT = 2**53  # JSON's safe integers: a bigger one is refused before any tool sees it
# A string argument (a code, a query, a path) longer than this is refused: it bounds the work a string
# can cause inside a tool (`s * n`, a regex). The schema shown to the model carries it as `maxLength`.
MAX_STRING_CHARS = 4_000
MAX_ERROR_CHARS = 300  # a tool-error observation is cut to this: never echo a hostile argument back
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    message: str  # what is wrong and what to write instead (shown to the policy)


def _json_object(body: str, example: str, max_chars: int = MAX_CALL_CHARS) -> dict[str, Any] | BadCall:
    if len(body) > max_chars:
        return BadCall(f"the call has {len(body)} characters; keep it under {max_chars}.")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return BadCall(f"the call is not valid JSON: write {example}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return BadCall(f'the call needs a "name": write {example}')
    problem = unbounded_value(obj)
    return BadCall(problem) if problem else obj


def unbounded_value(value: Any) -> str | None:
    """Why a parsed JSON value is out of bounds for a tool, or None: nesting deeper than
    MAX_ARGUMENT_DEPTH, a number that is not finite (`json` reads NaN, Infinity and 1e999 as floats),
    or an integer beyond MAX_ARGUMENT_INT. Iterative, so no depth of nesting can raise here."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= MAX_ARGUMENT_DEPTH:
                return f"the call nests deeper than {MAX_ARGUMENT_DEPTH} levels: pass flat arguments."
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
        elif isinstance(item, float) and not math.isfinite(item):
            return f"the call holds the number {item}: arguments must be finite numbers."
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_ARGUMENT_INT:
            return f"the call holds an integer beyond {MAX_ARGUMENT_INT}: use a smaller number."
    return None


HERMES_EXAMPLE = '<tool_call>{"name": "<tool>", "arguments": {"<parameter>": <value>}}</tool_call>'


def parse_hermes(
    text: str, example: str = HERMES_EXAMPLE, max_chars: int = MAX_CALL_CHARS
) -> ToolCall | BadCall | None:
    """The first `<tool_call>{...}</tool_call>` of the turn; None when the turn has none. `example` is
    the call format an error message shows (envs/bfcl/env.py passes its own, and its longer limit)."""
    start = text.find("<tool_call>")
    if start < 0:
        return None
    end = text.find("</tool_call>", start)
    if end < 0:
        return BadCall("the call was not closed: end it with </tool_call>.")
    obj = _json_object(text[start + len("<tool_call>") : end].strip(), example, max_chars)
    if isinstance(obj, BadCall):
        return obj
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return BadCall(f'"arguments" must be a JSON object: write {example}')
    return ToolCall(obj["name"], arguments)


LLAMA3_EXAMPLE = '{"name": "<tool>", "parameters": {"<parameter>": <value>}}'


def parse_llama3_json(text: str) -> ToolCall | BadCall | None:
    """The turn as one JSON object with "name" and "parameters"; None when it is not JSON-shaped."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    obj = _json_object(body, LLAMA3_EXAMPLE)
    if isinstance(obj, BadCall):
        return obj
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return BadCall(f'"parameters" must be a JSON object: write {LLAMA3_EXAMPLE}')
    return ToolCall(obj["name"], arguments)


@dataclass(frozen=True)
class ToolFormat:
    parse: Callable[[str], ToolCall | BadCall | None]
    example: str
    stop_strings: tuple[str, ...]  # where a turn's generation stops (beside the EOS token)


PARSERS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(parse_hermes, HERMES_EXAMPLE, ("</tool_call>",)),
    "qwen": ToolFormat(parse_hermes, HERMES_EXAMPLE, ("</tool_call>",)),
    "llama3_json": ToolFormat(parse_llama3_json, LLAMA3_EXAMPLE, ()),
}


def tool_format(name: str) -> ToolFormat:
    if name not in PARSERS:
        raise ValueError(
            f"tool_format={name!r} (the environment's call format): use one of {sorted(PARSERS)}"
        )
    return PARSERS[name]


def schemas(functions: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each function, from its type hints and its docstring's Args section; every
    string in it carries `maxLength` MAX_STRING_CHARS."""
    from transformers.utils import get_json_schema

    out = []
    for fn in functions:
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # transformers names the missing hint or docstring line
            raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {err}") from err
        _bound_strings(schema["function"]["parameters"])
        out.append(schema)
    return out


def _types(node: dict[str, Any]) -> list[str]:
    kind = node.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def _bound_strings(node: Any) -> None:
    """Adds `maxLength` to every string (sub)schema in place, in lists' items and maps' values too."""
    if isinstance(node, list):
        for child in node:
            _bound_strings(child)
    elif isinstance(node, dict):
        if "string" in _types(node):
            node.setdefault("maxLength", MAX_STRING_CHARS)
        for child in node.values():
            _bound_strings(child)


def _nullable_as_null(node: Any) -> Any:
    """A copy of the schema that JSON Schema reads as transformers means it: `get_json_schema` marks an
    Optional parameter `"nullable": true` (OpenAPI's word), which jsonschema ignores; here it adds
    "null" to the type, so a model passing null for an Optional parameter is not refused."""
    if isinstance(node, list):
        return [_nullable_as_null(child) for child in node]
    if not isinstance(node, dict):
        return node
    out = {key: _nullable_as_null(value) for key, value in node.items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [*_types(out), "null"]
    return out


def schema_problem(name: str, arguments: dict[str, Any], parameters: dict[str, Any]) -> str | None:
    """Why `arguments` break the tool's `parameters` schema, in at most MAX_ERROR_CHARS, or None.
    jsonschema's own messages quote the offending value, so type and length errors are reworded."""
    error = best_match(Draft202012Validator(_nullable_as_null(parameters)).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "arguments"
    got = JSON_TYPES.get(type(error.instance), "null" if error.instance is None else "other")
    if error.validator == "type":
        expected = " or ".join(_types({"type": error.validator_value}))
        said = f"must be {expected}, not {got}"
    elif error.validator == "enum":
        said = f"must be one of {error.validator_value}"
    elif error.validator == "maxLength":
        said = f"has {len(error.instance)} characters; the limit is {error.validator_value}"
    else:
        said = error.message
    return f"{name}'s argument {where!r} {said}"[:MAX_ERROR_CHARS]


def _shown(value: Any) -> str:
    """The tool's result as text; may raise anything (a `__str__` that raises or returns a non-str)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if not isinstance(text, str):
        raise TypeError("the result did not render as a str")
    return str.__getitem__(text, slice(0, MAX_RESULT_CHARS))  # a plain slice even of a str subclass


def _failure(name: str, err: Exception) -> str:
    """The observation for a tool that raised; its message is the tool's, so showing it may raise too."""
    kind = type(err).__name__
    try:
        return f"error: {name} failed: {kind}: {_shown(str(err))[:200]}"
    except Exception:  # an exception whose __str__ raises or returns a non-str: say so, fixed text
        return f"error: {name} failed: {kind} (its message could not be shown)"


def _refusal(
    call: ToolCall, functions: dict[str, Callable[..., Any]], schema: dict[str, dict[str, Any]]
) -> str | None:
    """Why the call may not run (an unknown tool, missing, unexpected or invalid arguments), or None."""
    if call.name not in functions:
        return f"no tool named {call.name!r}; the tools are {sorted(functions)}"
    params = schema[call.name]["function"]["parameters"]
    allowed, required = set(params.get("properties", {})), set(params.get("required", []))
    if missing := sorted(required - set(call.arguments)):
        return f"{call.name} needs the argument(s) {missing}"
    if extra := sorted(set(call.arguments) - allowed):
        return f"{call.name} takes no argument(s) {extra}; it takes {sorted(allowed)}"
    return unbounded_value(call.arguments) or schema_problem(call.name, call.arguments, params)


def run_call(
    call: ToolCall, functions: dict[str, Callable[..., Any]], schema: dict[str, dict[str, Any]]
) -> tuple[str, bool]:
    """(the tool's result as text, whether the call failed): unknown tools, missing or unexpected
    arguments, arguments the schema refuses, exceptions inside the tool and results that cannot be
    shown are failures, explained in the text. Never raises for anything the tool or the call does."""
    if problem := _refusal(call, functions, schema):
        return f"error: {problem}"[:MAX_ERROR_CHARS], True  # names and keys come from the model: cut
    try:
        result = functions[call.name](**call.arguments)
    except Exception as err:  # the tool's own failure on this input, shown to the policy
        return _failure(call.name, err), True
    try:
        return _shown(result), False
    except Exception:  # e.g. an int too long to print, a cycle, a __str__ or __repr__ that raises
        return f"error: {call.name}'s result could not be shown ({type(result).__name__})", True


class ToolEnv:
    """An environment whose tools are typed functions (`tools`), called in `tool_format`; a turn without
    a call is the final reply, scored by `score(task, reply)`. Either pass `tools`, `tasks` and `score`
    (and optionally the keywords) to the constructor, as for MutableEnv, or subclass: set `name`,
    `system_prompt`, `tools` and `tool_format`, and define `tasks`, `score` and optionally
    `demonstration`. The state is the number of calls made so far; `max_calls` ends an episode that
    keeps calling (reward 0).

        env = ToolEnv((lookup,), tasks, lambda task, reply: float(reply == task.answer[0]), name="capitals")
    """

    name = "tools"
    system_prompt = "Use the tools when they help, then reply with the answer."
    tools: tuple[Callable[..., Any], ...] = ()
    tool_format = "hermes"
    max_calls = 8

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] | None = None,
        tasks: Sequence[Task] | None = None,
        score: Callable[[Task, str], float] | None = None,
        *,
        name: str | None = None,
        system_prompt: str | None = None,
        tool_format: str | None = None,
        max_calls: int | None = None,
    ) -> None:
        given = dict(name=name, system_prompt=system_prompt, tool_format=tool_format, max_calls=max_calls)
        for key, value in given.items():  # None keeps the class's (or a subclass's) attribute
            if value is not None:
                setattr(self, key, value)
        self.tools = tuple(tools) if tools is not None else self.tools
        self._tasks, self._score = (list(tasks) if tasks is not None else None), score
        self._read_tools()

    def _read_tools(self) -> None:
        """The call format, stop strings and schemas (apart from __init__, whose `tool_format` argument
        would hide the module's `tool_format` lookup)."""
        self._format = tool_format(self.tool_format)
        self.stop_strings = self._format.stop_strings
        self._schemas = schemas(self.tools)
        self._functions = {s["function"]["name"]: fn for s, fn in zip(self._schemas, self.tools, strict=True)}
        self._by_name = {s["function"]["name"]: s for s in self._schemas}

    def tasks(self) -> Sequence[Task]:
        if self._tasks is None:
            raise NotImplementedError("ToolEnv has no tasks: pass tasks=[...] or define tasks()")
        return self._tasks

    def score(self, task: Task, reply: str) -> float:
        if self._score is None:
            raise NotImplementedError("ToolEnv has no score: pass score=fn(task, reply) or define score()")
        return self._score(task, reply)

    def initial_state(self, task: Task) -> int:
        return 0

    def prompt_ids(self, task: Task, tokenizer: Any) -> list[int]:
        """The prompt with the tool list rendered by the chat template; a template that ignores `tools`
        gets the schemas and the call format in the system prompt instead."""
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": task.question},
        ]
        text = tokenizer.apply_chat_template(
            messages, tools=self._schemas, add_generation_prompt=True, tokenize=False
        )
        if self._schemas and self._schemas[0]["function"]["name"] not in text:
            listed = "\n".join(json.dumps(s) for s in self._schemas)
            system = f"{self.system_prompt}\nTools:\n{listed}\nCall one as: {self._format.example}"
            messages[0] = {"role": "system", "content": system}
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def step(self, task: Task, state: int, action_text: str) -> Transition:
        parsed = self._format.parse(action_text)
        if parsed is None:
            return Transition("", True, float(self.score(task, action_text)), "answer", state)
        if isinstance(parsed, BadCall):
            note = f"<tool_response>error: {parsed.message}</tool_response>"
            return Transition(note, False, None, None, state, format_error=True)
        if state + 1 > self.max_calls:
            return Transition("", True, 0.0, "too_many_calls", state, tool=parsed.name, tool_error=True)
        result, failed = run_call(parsed, self._functions, self._by_name)
        note = f"<tool_response>{result}</tool_response>"
        return Transition(note, False, None, None, state + 1, tool=parsed.name, tool_error=failed)
