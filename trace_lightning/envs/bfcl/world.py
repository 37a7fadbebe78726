"""The stateful BFCL APIs of one entry, and replay: the state a sequence of calls leaves.

The API classes (GorillaFileSystem, TradingBot, ...) are pure-Python simulations from
`bfcl_eval/eval_checker/multi_turn_eval/func_source_code/`; they are the only part of `bfcl_eval` we
import (standard library and mpmath only). An instance is mutable, so the environment never keeps one
in its state: the state is (entry id, the calls executed so far), and `Replay.after` rebuilds the
instances that prefix leaves by replaying its calls on fresh instances. Replays are cached (the
instances after a prefix, kept privately and handed out as deep copies), and a miss starts from the
longest cached prefix, so a turn usually costs one deep copy and one call. Because every caller gets
its own copy, a continuation branched from any prefix sees exactly that prefix's state, never a
sibling's calls (TRACE continues from turn prefixes; tests/envs/test_envs_bfcl.py checks both).

What may be called: only a function documented for the entry (its involved classes' docs, less the
excluded ones), looked up on the class as a public method: never a private or
dunder name, never another attribute. Arguments are JSON values (json.loads or ast literals).
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import importlib
import inspect
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

from trace_lightning.envs.bfcl.data import API_CLASSES, Call, Entry, function_docs

API_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
STATELESS = frozenset({"MathAPI"})  # BFCL builds it without a scenario (its STATELESS_CLASSES)
ERROR_PREFIX = (
    "Error during execution: "  # BFCL's text for a call that raised; the response check compares it
)

Instances = dict[str, Any]  # class name -> API instance
# The largest world the ground truth builds, by world_size: 74,816 characters (long_context; 3,507 in
# the other subsets). The cap leaves 13x that for a policy's own detours and stops exponential growth
# (a `cp` doubling reaches it in 19 calls); walking a world at the cap takes ~45 ms, a ground-truth
# world ~0.1 ms (measured on a 2-core CPU).
MAX_WORLD_CHARS = 1_000_000


class CallRejected(ValueError):
    """The call names no function the policy may call now; the message says which ones it may."""


class WorldTooLarge(Exception):
    """A call left the simulated world (or its own result) larger than the bound; the episode ends."""


def world_size(value: Any, cap: int) -> int:
    """The size of `value` in characters as a full listing would print it, counted until it passes `cap`.

    Strings count their length, numbers and other leaves 8, containers 2 plus their items, and objects
    of the API modules (files, directories, the APIs themselves) their attributes. Shared structure is
    counted once per path, not once per object: the file system's `cp` shares subtrees, so a few dozen
    calls can build a world whose objects are few but whose listing (`find`, `du`) is exponential.
    A reference back to an object on the current path (a directory's parent) is not followed. The walk
    is iterative (no recursion limit) and stops as soon as the count passes `cap`, so it costs at most
    about `cap` leaf visits whatever was built.
    """
    total, on_path = 0, set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        obj, leaving = stack.pop()
        if leaving:
            on_path.discard(id(obj))
            continue
        if isinstance(obj, str):
            total += len(obj) + 2
        elif isinstance(obj, (dict, list, tuple, set, frozenset)) or type(obj).__module__.startswith(
            API_PACKAGE
        ):
            if id(obj) in on_path:
                continue
            on_path.add(id(obj))
            stack.append((obj, True))
            total += 2
            items = vars(obj) if not isinstance(obj, (dict, list, tuple, set, frozenset)) else obj
            if isinstance(items, dict):
                stack.extend((k, False) for k in items)
                stack.extend((v, False) for v in items.values())
            else:
                stack.extend((v, False) for v in items)
        else:
            total += 8
        if total > cap:
            break
    return total


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
    # _load_scenario keeps module-level data by reference (a credit card, the long-context extensions):
    # the copy cuts those links, so no call on these instances can change what the next load sees.
    return copy.deepcopy(out)


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
    if (problem := out_of_bounds(call.name, kwargs)) is not None:
        return f"{ERROR_PREFIX}{problem}"
    try:
        with MODULE_STATE.guarded():
            result = getattr(instances[owner], call.name)(*args, **kwargs)
        return _as_text(result)
    except Exception as err:  # a bad argument or an API error is a result the model sees, never a crash
        return f"{ERROR_PREFIX}{describe(err)}"


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            pass
    return str(result)  # may raise (an int past 4,300 digits): execute turns that into an error result


def describe(err: BaseException) -> str:
    try:
        return str(err)[:500]
    except Exception:
        return type(err).__name__


# Arguments that set how much work one call does, with their bound. These calls hold the GIL (a big
# `base ** exponent`, a square root or logarithm to a million digits, `round` to -10**9 places), so a
# thread-based step timeout could not stop them; they are refused before they start instead. The
# ground truth uses precision <= 10 and no power or rounding beyond a few digits.
WORK_BOUNDS: dict[str, dict[str, int]] = {
    "power": {"exponent": 1024},
    "square_root": {"precision": 1000},
    "logarithm": {"precision": 1000},
    "round_number": {"decimal_places": 1000},
}
MAX_RESULT_DIGITS = 4000  # Python refuses to print an int longer than 4,300 digits


def out_of_bounds(name: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why a call would do unbounded work, or None. Numbers are finite and within 2**53 already
    (envs/tools.py's parser refuses the rest); this bounds the arguments that scale the work."""
    for param, bound in WORK_BOUNDS.get(name, {}).items():
        value = kwargs.get(param)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > bound:
            return f"{name}: |{param}| must be at most {bound}, got {value}"
    base, exponent = kwargs.get("base"), kwargs.get("exponent")
    if name == "power" and isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        digits = abs(exponent) * math.log10(abs(base))
        if digits > MAX_RESULT_DIGITS:
            return f"power: the result would have about {digits:.0f} digits; the limit is {MAX_RESULT_DIGITS}"
    return None


class ModuleState:
    """The API modules' module-level data, restored after any call that changes it.

    BFCL's simulations keep data in module globals and some methods write to them by name (the long
    context vehicle API stores the outside temperature into `LONG_WEATHER_EXTENSION`; MathAPI sets
    mpmath's global precision). Instances never hold these objects (`fresh_instances` copies them
    away), but a method can still reach them through its module. `guarded()` snapshots nothing per
    call: a pristine deep copy of every mutable global is taken once, when the modules are first
    imported, and after each call every global is compared with it (about 0.1 ms for all of them,
    measured) and restored in place, so every module that imported the object by name sees it
    restored too. mpmath's precision and the decimal context are saved and restored around the call.
    """

    def __init__(self) -> None:
        self._pristine: list[tuple[Any, Any]] | None = None
        self.restored = 0  # calls after which a module global had to be restored: for tests and logs

    def _snapshot(self) -> list[tuple[Any, Any]]:
        modules = {importlib.import_module(f"{API_PACKAGE}.{m}") for m, _ in API_CLASSES.values()}
        modules.add(importlib.import_module(f"{API_PACKAGE}.long_context"))
        seen: dict[int, tuple[Any, Any]] = {}
        for module in modules:
            for key, value in vars(module).items():
                if (
                    not key.startswith("__")
                    and isinstance(value, (dict, list, set))
                    and id(value) not in seen
                ):
                    clean = copy.deepcopy(value)
                    if clean == value:  # one that holds a NaN never equals itself: nothing to compare
                        seen[id(value)] = (value, clean)
        return list(seen.values())

    def pristine(self) -> list[tuple[Any, Any]]:
        if self._pristine is None:
            self._pristine = self._snapshot()
        return self._pristine

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        import mpmath  # bfcl-eval's own dependency, installed beside it

        pristine = self.pristine()
        dps = mpmath.mp.dps
        try:
            with decimal.localcontext():
                yield
        finally:
            mpmath.mp.dps = dps
            changed = [(live, clean) for live, clean in pristine if live != clean]
            for live, clean in changed:
                _restore(live, copy.deepcopy(clean))
            self.restored += bool(changed)


def _restore(live: Any, clean: Any) -> None:
    if isinstance(live, dict):
        live.clear()
        live.update(clean)
    elif isinstance(live, list):
        live[:] = clean
    else:
        live.clear()
        live.update(clean)


MODULE_STATE = ModuleState()


class Replay:
    """Instances after (entry, calls), by replay from fresh instances, with a bounded LRU cache.

    `after` returns a private deep copy with the execution result of every call; `extend` runs one more
    call on such a copy and caches the outcome. Thread-safe: the runner may abandon a slow step and go on.
    Replays resolve names with `owners(entry)` (every function the entry ever documents): the calls in
    a key were checked against what was available when they were made.
    """

    def __init__(self, max_items: int = 256, max_world_chars: int = MAX_WORLD_CHARS) -> None:
        if max_items < 1:
            raise ValueError(f"env.replay_cache={max_items} must be >= 1")
        if max_world_chars < 1:
            raise ValueError(f"env.max_world_chars={max_world_chars} must be >= 1")
        self.max_items, self.max_world_chars = max_items, max_world_chars
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
        (function -> class); CallRejected leaves nothing cached, and so does WorldTooLarge, raised when
        the world after the call, or the call's result, is larger than `max_world_chars`."""
        instances, results = self.after(entry, calls)
        result = execute(instances, available, call)
        cap = self.max_world_chars
        size = len(result) if len(result) > cap else world_size(instances, cap)
        if size > cap:
            what = "its result" if len(result) > cap else "the world it left"
            raise WorldTooLarge(
                f"{call.name} ran, but {what} is over {cap:,} characters (env.max_world_chars): "
                "the episode ends"
            )
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
