"""BFCL v4 multi-turn data: entries, ground truth and function docs, read from the files that
`bfcl-eval==2026.3.23` (Apache-2.0) ships. Nothing of that package is imported here: its handlers and
utils pull in network clients, so we only locate it with `importlib.util.find_spec` and read its JSON
(`world.py` imports the pure-Python API classes, and nothing else).

Four subsets of 200 entries each, as BFCL defines them:
- base: a conversation of 1-7 user turns over one or two stateful APIs;
- long_context: the same conversations, with each API loaded in its long-context form (many more
  files, messages, orders... in the state; BFCL's `long_context=True`);
- miss_func: a function is held out of the docs until a later turn, whose user message is empty: the
  function's doc arrives then (the turn's ground truth uses it);
- miss_param: an extra turn asks for something without a required parameter; its ground truth is
  empty (the right move is to ask), and the next turn gives the parameter.
`excluded_function` lists functions never shown for an entry (cp, mv or rm in 18 entries of each
subset; their ground truth never calls them). This package version's own pipeline no longer reads the
field; we apply it, as its name says.

Ground truth is a list of call strings per user turn, e.g. `"mv(source='final_report.pdf',
destination='temp')"` or `"sort('final_report.pdf')"`; they are parsed with `ast`, and every argument
must be a literal (`ast.literal_eval`), never evaluated.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trace_lightning.envs.search_qa import DataNotInstalledError

BFCL_PIP = "bfcl-eval==2026.3.23"
SUBSETS = ("base", "long_context", "miss_func", "miss_param")
# class name -> (its module in bfcl_eval's func_source_code, its function-doc file). The web-search and
# memory classes need the network or heavy packages: they appear in no multi-turn entry and are left out.
API_CLASSES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
JSON = str | int | float | bool | None | list[Any] | dict[str, Any]


class CallSyntaxError(ValueError):
    """A ground-truth call string that is not `name(literal, key=literal, ...)`."""


@dataclass(frozen=True)
class Call:
    """One function call: its name and its arguments as canonical JSON (hashable, so a tuple of calls
    is a replay key). `positional` arguments come only from ground-truth strings such as
    `sort('final_report.pdf')`; the model passes keyword arguments (a JSON object)."""

    name: str
    arguments: str  # json.dumps({"args": [...], "kwargs": {...}}, sort_keys=True)

    @staticmethod
    def make(name: str, kwargs: dict[str, Any], positional: tuple[Any, ...] | list[Any] = ()) -> Call:
        return Call(name, json.dumps({"args": list(positional), "kwargs": kwargs}, sort_keys=True))

    def values(self) -> tuple[list[Any], dict[str, Any]]:
        """Fresh copies of (positional, keyword) arguments: a call can never alias a stored value."""
        parsed = json.loads(self.arguments)
        return parsed["args"], parsed["kwargs"]

    def text(self) -> str:
        """`mv(source='a', destination='b')`: how BFCL writes a call (for logs and trees)."""
        args, kwargs = self.values()
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class Entry:
    """One BFCL multi-turn entry (a whole conversation)."""

    entry_id: str  # e.g. "multi_turn_base_17"
    number: int  # 17: the task id
    subset: str
    turns: tuple[str, ...]  # each user turn's message; "" where a miss_func turn only brings new functions
    config: str  # initial_config as JSON text, parsed afresh for every load (nothing shared is mutated)
    classes: tuple[str, ...]  # involved_classes
    excluded: frozenset[str]  # functions never documented for this entry
    missed: tuple[tuple[int, tuple[str, ...]], ...]  # (turn, functions that first appear at that turn)
    ground_truth: tuple[tuple[Call, ...], ...]  # per user turn

    @property
    def long_context(self) -> bool:
        return self.subset == "long_context"


def package_root() -> Path:
    """The installed bfcl_eval package folder, located without importing it."""
    spec = importlib.util.find_spec("bfcl_eval")
    for root in list(spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(root) / "data").is_dir():
            return Path(root)
    raise DataNotInstalledError(
        f"the BFCL data is not installed: run `make install` (pip install --no-deps {BFCL_PIP} mpmath)"
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@cache
def function_docs() -> dict[str, tuple[dict[str, Any], ...]]:
    """Class name -> its function docs, as BFCL ships them (name, description, parameters, response).
    Cached and shared: callers must not mutate them."""
    folder = package_root() / "data" / "multi_turn_func_doc"
    return {name: tuple(_lines(folder / doc)) for name, (_, doc) in API_CLASSES.items()}


@cache
def load_entries(subset: str) -> tuple[Entry, ...]:
    """The subset's 200 entries with their ground truth, in file order."""
    if subset not in SUBSETS:
        raise ValueError(f"env.subset must be one of {SUBSETS}, got {subset!r}")
    data = package_root() / "data"
    name = f"BFCL_v4_multi_turn_{subset}.json"
    truth = {row["id"]: row["ground_truth"] for row in _lines(data / "possible_answer" / name)}
    return tuple(_entry(row, subset, truth[row["id"]]) for row in _lines(data / name))


def _entry(row: dict[str, Any], subset: str, truth: list[list[str]]) -> Entry:
    unknown = set(row["involved_classes"]) - set(API_CLASSES)
    if unknown:
        raise ValueError(f"{row['id']} involves classes we do not load: {sorted(unknown)}")
    turns = tuple(" ".join(m["content"] for m in turn if m["role"] == "user") for turn in row["question"])
    missed = tuple(sorted((int(t), tuple(names)) for t, names in row.get("missed_function", {}).items()))
    if len(truth) != len(turns) or not turns[0] or any(t == 0 for t, _ in missed):
        raise ValueError(f"{row['id']}: turns, ground truth and missed functions do not line up")
    return Entry(
        entry_id=row["id"],
        number=int(row["id"].rsplit("_", 1)[1]),
        subset=subset,
        turns=turns,
        config=json.dumps(row.get("initial_config", {})),
        classes=tuple(row["involved_classes"]),
        excluded=frozenset(row.get("excluded_function", [])),
        missed=missed,
        ground_truth=tuple(tuple(parse_call_string(c) for c in turn) for turn in truth),
    )


def parse_call_string(text: str) -> Call:
    """`"mv(source='a', destination='b')"` -> Call. Only a plain name called with literal arguments is
    accepted (`ast.literal_eval` on each), and the values must be JSON values."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise CallSyntaxError(f"not a call: {text!r}") from err
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise CallSyntaxError(f"not a plain function call: {text!r}")
    if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
        raise CallSyntaxError(f"*args/**kwargs are not literals: {text!r}")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
    except ValueError as err:
        raise CallSyntaxError(f"an argument is not a literal: {text!r}") from err
    if not all(_is_json(v) for v in [*args, *kwargs.values()]):
        raise CallSyntaxError(f"an argument is not a JSON value: {text!r}")
    return Call.make(node.func.id, kwargs, args)


def _is_json(value: object) -> bool:
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False
