"""How a BFCL entry is shown to the policy: the function docs, the call format, the first user turn.

**Call format.** One call per policy turn, JSON in tags, the format of Hermes/Qwen-style chat templates:
`<tool_call>{"name": "mv", "arguments": {"source": "a.txt", "destination": "docs"}}</tool_call>`.
Where the tokenizer's chat template renders a `tools` list and asks for `<tool_call>` tags (Qwen2.5,
Qwen3, Hermes), the docs go through the template (`apply_chat_template(..., tools=...)`) exactly as the
model was trained to read them. Otherwise (SmolLM2's plain ChatML, our Gemma template) our system
prompt below describes the same format and lists the docs itself. Either way a call's result comes
back as `<tool_response>...</tool_response>` in a user turn, which is how those templates render a
tool message, and a turn without a call is a reply to the user.

**Docs and the context.** All of an entry's docs can exceed a small model's context (two classes of
full BFCL docs are up to ~9k SmolLM2 tokens; its context is 8,192), and on CPU every prompt token is
paid at every turn. So the docs come in three levels, and the richest that keeps the prompt within
`max_prompt_tokens` is used:
- `full`: BFCL's docs as shipped (name, description, parameters, response schema), one JSON per line;
- `compact`: the response schemas and the class preamble repeated in every description ("This tool
  belongs to the Gorilla file system. It is a simple ...", said once per class instead) are cut;
  parameter names, types, descriptions, defaults and `required` are kept;
- `signatures`: one line per function, `name(param: type, optional: type = default) - description`:
  parameter descriptions (and the enumerations some of them list) are cut.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trace_lightning.envs.bfcl.data import function_docs

DOC_LEVELS = ("full", "compact", "signatures")
_PREAMBLE_SPLIT = "Tool description: "
_TEMPLATE_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}
_PROBE = {"type": "function", "function": {"name": "zz_probe_fn", "description": "probe", "parameters": {}}}

SYSTEM_PROMPT = (
    "You complete the user's requests by calling functions. Each of your turns is either exactly one "
    "function call or a reply to the user.\n"
    "To call a function, think in one short sentence, then write one call:\n"
    '<tool_call>{"name": "<function name>", "arguments": {"<parameter>": <value>}}</tool_call>\n'
    "Its result comes back as <tool_response>...</tool_response>. Make one call per turn until the "
    "request is done, then reply to the user in plain text without a call; the user's next message "
    "follows. If no function fits, or a required value is missing, say so in your reply instead of "
    "calling."
)
# With a template that renders the tools and states the call format itself, only the behaviour is ours.
TEMPLATE_SYSTEM_PROMPT = (
    "You complete the user's requests by calling the functions you are given, one call per turn. When "
    "the request is done, reply to the user in plain text without a call; the user's next message "
    "follows. If no function fits, or a required value is missing, say so in your reply instead of calling."
)


def choose_level(docs: Sequence[tuple[str, dict[str, Any]]], max_chars: int) -> str | None:
    """The richest level whose system prompt fits `max_chars` characters (None: not even signatures).
    Characters, not tokens, so that the choice is a property of the entry alone; on these docs SmolLM2's
    tokenizer averages 3.7-4.0 characters a token."""
    for level in DOC_LEVELS:
        if len(system_prompt(docs, level)) <= max_chars:
            return level
    return None


def docs_for(functions: Sequence[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
    """(class, BFCL doc) for each (function, class) pair, in that order."""
    by_name = {(cls, d["name"]): d for cls, docs in function_docs().items() for d in docs}
    return [(cls, by_name[(cls, name)]) for name, cls in functions]


def render_docs(docs: Sequence[tuple[str, dict[str, Any]]], level: str) -> str:
    """The docs as text at `level` (see the module docstring)."""
    if level == "full":
        return "\n".join(json.dumps(doc) for _, doc in docs)
    lines: list[str] = []
    seen: set[str] = set()
    for cls, doc in docs:
        preamble, description = _split(doc["description"])
        if cls not in seen and preamble:
            lines.append(f"# {cls}: {preamble}")
        seen.add(cls)
        lines.append(
            json.dumps(_compact(doc, description)) if level == "compact" else _signature(doc, description)
        )
    return "\n".join(lines)


def _split(description: str) -> tuple[str, str]:
    """(the class preamble, the function's own description)."""
    head, sep, tail = description.partition(_PREAMBLE_SPLIT)
    return (head.strip(), tail.strip()) if sep else ("", description.strip())


def _compact(doc: dict[str, Any], description: str) -> dict[str, Any]:
    params = doc["parameters"]
    out = {"name": doc["name"], "description": description, "parameters": params.get("properties", {})}
    return out | ({"required": params["required"]} if params.get("required") else {})


def _signature(doc: dict[str, Any], description: str) -> str:
    params = doc["parameters"]
    required = set(params.get("required", []))
    parts = []
    for name, spec in params.get("properties", {}).items():
        text = f"{name}: {spec.get('type', 'any')}"
        if name not in required:
            text += f" = {spec['default']!r}" if "default" in spec else " = None"
        parts.append(text)
    return f"{doc['name']}({', '.join(parts)}) - {description}"


def system_prompt(docs: Sequence[tuple[str, dict[str, Any]]], level: str) -> str:
    """Our system prompt with the docs at `level` (tokenizers whose template has no tool format)."""
    return f"{SYSTEM_PROMPT}\n\nFunctions:\n{render_docs(docs, level)}"


def template_has_tools(tokenizer: Any) -> bool:
    """True when the chat template renders a `tools` list and asks for `<tool_call>` tags."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[_PROBE], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that cannot take tools has no tool format
        return False
    return isinstance(text, str) and "zz_probe_fn" in text and "<tool_call>" in text


def tool_schemas(docs: Sequence[tuple[str, dict[str, Any]]], level: str) -> list[dict[str, Any]]:
    """The docs as the `tools` argument of a chat template (OpenAI function schema) at `level`."""
    out = []
    for _, doc in docs:
        _, description = _split(doc["description"])
        params = doc["parameters"]
        properties = {
            name: {"type": _TEMPLATE_TYPES.get(spec.get("type", "string"), spec.get("type", "string"))}
            | (
                {"description": spec["description"]}
                if level != "signatures" and "description" in spec
                else {}
            )
            for name, spec in params.get("properties", {}).items()
        }
        schema = {"type": "object", "properties": properties, "required": params.get("required", [])}
        function = {
            "name": doc["name"],
            "description": doc["description"] if level == "full" else description,
        }
        out.append({"type": "function", "function": function | {"parameters": schema}})
    return out


def new_functions_message(docs: Sequence[tuple[str, dict[str, Any]]], level: str) -> str:
    """miss_func's reveal turn (no user message of its own): the new docs, then BFCL's own sentence."""
    return (
        f"{render_docs(docs, level)}\nI have updated some more functions you can choose from. What about now?"
    )
