"""The stateful BFCL APIs of one entry, and replay: the state a sequence of calls leaves.

The API classes (GorillaFileSystem, TradingBot, ...) are pure-Python simulations from
`bfcl_eval/eval_checker/multi_turn_eval/func_source_code/`; they are the only part of `bfcl_eval` we
import (standard library and mpmath only). An instance is mutable, so the environment never keeps one
in its state: the state is (entry id, the calls executed so far), and `Replay.after` rebuilds the
instances that prefix leaves by replaying its calls on fresh instances. Replays are cached (the
instances after a prefix, kept privately and handed out as deep copies), and a miss starts from the
longest cached prefix, so a turn usually costs one deep copy and one call. Because every caller gets
its own copy, a continuation branched from any prefix sees exactly that prefix's state, never a
sibling's calls (TRACE continues from turn prefixes; tests/test_envs_bfcl.py checks both).

What may be called: only a function documented for the entry (its involved classes' docs, less the
excluded ones), looked up on the class as a public method: never a private or
dunder name, never another attribute. Arguments are JSON values (json.loads or ast literals).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from functools import cache
from typing import Any

from trace_lightning.envs.bfcl_data import API_CLASSES, Call, Entry, function_docs

API_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
STATELESS = frozenset({"MathAPI"})  # BFCL builds it without a scenario (its STATELESS_CLASSES)
ERROR_PREFIX = (
    "Error during execution: "  # BFCL's text for a call that raised; the response check compares it
)

Instances = dict[str, Any]  # class name -> API instance


class CallRejected(ValueError):
    """The call names no function the policy may call now; the message says which ones it may."""


def api_class(name: str) -> type:
    if name not in API_CLASSES:
        raise ValueError(f"unknown BFCL class {name!r}; known: {sorted(API_CLASSES)}")
    return getattr(importlib.import_module(f"{API_PACKAGE}.{API_CLASSES[name][0]}"), name)  # type: ignore[no-any-return]


def fresh_instances(entry: Entry) -> Instances:
    """The entry's APIs in their initial state, loaded from its initial_config (parsed afresh)."""
    config = json.loads(entry.config)
    out: Instances = {}
    for name in entry.classes:
        instance = api_class(name)()
        if name not in STATELESS:
            instance._load_scenario(config.get(name, {}), long_context=entry.long_context)
        out[name] = instance
    return out


def public_method(cls: type, name: str) -> bool:
    """`name` is a public function defined on `cls` (or a base), not a private/dunder name or another
    attribute."""
    return not name.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, name, None))


@cache
def owners(entry: Entry) -> dict[str, str]:
    """Function -> class for every function the entry documents at some turn: its classes' docs less
    `excluded_function`. Each must be a public method of its class (checked here, once per entry)."""
    out: dict[str, str] = {}
    for name in entry.classes:
        cls = api_class(name)
        for doc in function_docs()[name]:
            if doc["name"] in entry.excluded:
                continue
            if not public_method(cls, doc["name"]):
                raise ValueError(f"{name} documents {doc['name']!r}, which is not one of its public methods")
            out[doc["name"]] = name
    return out


def shown(entry: Entry, turn: int) -> dict[str, str]:
    """The functions whose docs the policy has seen by user turn `turn`: miss_func's held-out functions
    only from the turn that reveals them."""
    later = {f for t, names in entry.missed if t > turn for f in names}
    return {f: cls for f, cls in owners(entry).items() if f not in later}


def execute(instances: Instances, owners: Mapping[str, str], call: Call) -> str:
    """Run `call` on the instance whose class owns it; the result as BFCL records it: a str as is, a
    dict as JSON (str() if it is not serialisable), anything else str(); an exception becomes
    `Error during execution: <message>`. Raises CallRejected when `call.name` is not in `owners`."""
    owner = owners.get(call.name)
    if owner is None or not public_method(type(instances[owner]), call.name):
        raise CallRejected(f"{call.name!r} is not an available function; available: {', '.join(owners)}")
    args, kwargs = call.values()
    try:
        result = getattr(instances[owner], call.name)(*args, **kwargs)
    except Exception as err:  # a bad argument or an API error is a result the model sees, never a crash
        return f"{ERROR_PREFIX}{err}"
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class Replay:
    """Instances after (entry, calls), by replay from fresh instances, with a bounded LRU cache.

    `after` returns a private deep copy with the execution result of every call; `extend` runs one more
    call on such a copy and caches the outcome. Thread-safe: the runner may abandon a slow step and go on.
    Replays resolve names with `owners(entry)` (every function the entry ever documents): the calls in
    a key were checked against what was available when they were made.
    """

    def __init__(self, max_items: int = 256) -> None:
        if max_items < 1:
            raise ValueError(f"env.replay_cache={max_items} must be >= 1")
        self.max_items = max_items
        self._items: OrderedDict[tuple[str, tuple[Call, ...]], tuple[Instances, tuple[str, ...]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.replayed_calls = 0  # calls executed to rebuild a prefix (cache misses): a cost measure

    def after(self, entry: Entry, calls: tuple[Call, ...]) -> tuple[Instances, tuple[str, ...]]:
        """(a deep copy of the instances after `calls`, each call's result, in order)."""
        instances, results, k, cached = self._nearest(entry, calls)
        everything = owners(entry)
        for call in calls[k:]:
            try:
                results = (*results, execute(instances, everything, call))
            except CallRejected as err:  # every cached call was accepted once: the data must be broken
                raise ValueError(f"{entry.entry_id}: cannot replay {call.text()}: {err}") from err
            self.replayed_calls += 1
        if not cached:
            self._store(entry, calls, copy.deepcopy(instances), results)
        return instances, results

    def extend(
        self, entry: Entry, calls: tuple[Call, ...], call: Call, available: Mapping[str, str]
    ) -> tuple[Instances, tuple[str, ...]]:
        """The instances and results after `calls + (call,)`, `call` checked against `available`
        (function -> class); CallRejected leaves nothing cached."""
        instances, results = self.after(entry, calls)
        result = execute(instances, available, call)
        self._store(entry, (*calls, call), copy.deepcopy(instances), (*results, result))
        return instances, (*results, result)

    def _nearest(self, entry: Entry, calls: tuple[Call, ...]) -> tuple[Instances, tuple[str, ...], int, bool]:
        """A copy of the longest cached prefix of `calls`: (instances, results, its length, exact hit)."""
        with self._lock:
            for k in range(len(calls), -1, -1):
                key = (entry.entry_id, calls[:k])
                if key in self._items:
                    self._items.move_to_end(key)
                    instances, results = self._items[key]
                    return copy.deepcopy(instances), results, k, k == len(calls)
        return fresh_instances(entry), (), 0, False

    def _store(
        self, entry: Entry, calls: tuple[Call, ...], instances: Instances, results: tuple[str, ...]
    ) -> None:
        with self._lock:
            self._items[(entry.entry_id, calls)] = (instances, results)
            self._items.move_to_end((entry.entry_id, calls))
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
