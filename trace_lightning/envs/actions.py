"""Parse one policy turn into an action: free text (the thought) then one `<tag>argument</tag>`.

The policy is a small chat model without a tool schema, so actions are plain text tags. Parsing
never raises: anything we cannot read becomes an `ActionError` whose message tells the model what
to write instead, and the environment returns that message as its observation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_ARGUMENT_CHARS = 1000
_TAG_NAME = re.compile(r"[a-z_][a-z0-9_]*")
# Tag-like text `<word>` or `</word>`: what the model may have meant as an action.
_ANY_TAG = re.compile(r"</?([A-Za-z_][A-Za-z0-9_\-]{0,30})>")


@dataclass(frozen=True)
class Action:
    name: str  # the tag, e.g. "search"
    argument: str  # the text between the tags, stripped of surrounding whitespace


@dataclass(frozen=True)
class ActionError:
    message: str  # shown to the model: what went wrong and what to write instead


def parse_action(text: str, allowed: Sequence[str]) -> Action | ActionError:
    """The first complete `<tag>...</tag>` (in reading order) whose tag is in `allowed`.

    Example: `parse_action("I should look it up. <search>K2 height</search>", ["search", "answer"])`
    gives `Action("search", "K2 height")`. No tag, an unknown or unclosed tag, an empty argument or
    one longer than `MAX_ARGUMENT_CHARS` give an `ActionError`.
    """
    for name in allowed:
        if not _TAG_NAME.fullmatch(name):
            raise ValueError(f"action names must be lowercase identifiers, got {name!r}")
    found = _first_complete(text, allowed)
    if found is None:
        return ActionError(_missing_action_message(text, allowed))
    name, argument = found
    if not argument:
        return ActionError(f"<{name}></{name}> is empty: write the {name} between the tags.")
    if len(argument) > MAX_ARGUMENT_CHARS:
        return ActionError(
            f"the <{name}> argument has {len(argument)} characters; keep it under {MAX_ARGUMENT_CHARS}."
        )
    return Action(name, argument)


def action_hint(allowed: Sequence[str]) -> str:
    """`<search>...</search> or <answer>...</answer>`: the forms the model may use."""
    return " or ".join(f"<{name}>...</{name}>" for name in allowed)


def _first_complete(text: str, allowed: Sequence[str]) -> tuple[str, str] | None:
    """(name, stripped argument) of the complete allowed tag that opens first, if any.

    Only the first opening of each tag matters: if it has no closing tag after it, no later one of
    the same name can have one either. So this is two `find`s per tag, linear in the text.
    """
    best: tuple[int, str, str] | None = None
    for name in allowed:
        opening, closing = f"<{name}>", f"</{name}>"
        start = text.find(opening)
        if start < 0:
            continue
        end = text.find(closing, start + len(opening))
        if end < 0:
            continue
        if best is None or start < best[0]:
            best = (start, name, text[start + len(opening) : end].strip())
    return None if best is None else (best[1], best[2])


def _missing_action_message(text: str, allowed: Sequence[str]) -> str:
    hint = action_hint(allowed)
    for name in allowed:
        if f"<{name}>" in text:
            return f"<{name}> was not closed: end the action with </{name}>."
    other = _ANY_TAG.search(text)
    if other is not None and other.group(1) not in allowed:
        return f"unknown action <{other.group(1)}>: use {hint}."
    if other is not None:  # an allowed closing tag with no opening before it
        name = other.group(1)
        return f"</{name}> has no opening <{name}>: write <{name}>...</{name}>."
    return f"no action found: end your turn with exactly one action, {hint}."
