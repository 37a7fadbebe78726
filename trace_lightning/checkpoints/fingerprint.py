"""Whether a checkpoint's config fingerprint still describes this run, across upgrades of the trainer.

A fingerprint is, per config group (model, adapter, allocator, env, predictor), the group as canonical
JSON. Two kinds of difference do not change what a checkpoint means, so a checkpoint written before
them still resumes (issue 25: a checkpoint written before a module moved resumes after it):
- a setting the checkpoint lacks, at the default of the constructor that takes it (the node's
  `_target_` today): it did not exist then, and its default is what the trainer did then;
- a `_target_` path that names the same object as today's (a module moved, its old path kept
  importable). Only paths inside `trace_lightning` are imported to check: a checkpoint is untrusted
  input, and importing a module it names could run code.
Anything else is a difference, and `validate.check_resumable` names it.

Example: stored {"_target_": "p.S", "lr": 0.001} vs now {"_target_": "p.S", "lr": 0.001, "decay": 1.0}
is the same when `p.S(decay=1.0, ...)` is S's default; with "decay": 0.5 it is not.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

_OWN = "trace_lightning."


def same_group(stored: str | None, now: str | None) -> bool:
    """Whether two fingerprint entries (JSON text) describe the same config, as the module docstring says."""
    if stored == now:
        return True
    if stored is None or now is None:
        return False
    return _same(json.loads(stored), json.loads(now))


def _same(stored: Any, now: Any) -> bool:
    if not (isinstance(stored, dict) and isinstance(now, dict)):
        if isinstance(stored, list) and isinstance(now, list):
            return len(stored) == len(now) and all(_same(a, b) for a, b in zip(stored, now, strict=True))
        return bool(stored == now)
    if stored.keys() - now.keys():
        return False
    target = now.get("_target_")
    if "_target_" in stored and not _same_target(stored["_target_"], target):
        return False
    for key, value in now.items():
        if key == "_target_":
            continue
        if key in stored:
            if not _same(stored[key], value):
                return False
        elif not _is_default(target, key, value):
            return False
    return True


def _same_target(stored: Any, now: Any) -> bool:
    if stored == now:
        return True
    if not (isinstance(stored, str) and isinstance(now, str) and stored.startswith(_OWN)):
        return False
    old, new = _resolve(stored), _resolve(now)
    return old is not None and old is new


def _resolve(path: str) -> Any:
    """The object a dotted path names (module attribute, or a class's attribute), or None."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def _is_default(target: Any, key: str, value: Any) -> bool:
    """Whether `value` is the default of parameter `key` of what `target` (today's config) names."""
    obj = _resolve(target) if isinstance(target, str) else None
    if obj is None:
        return False
    try:
        parameter = inspect.signature(obj).parameters.get(key)
    except (TypeError, ValueError):
        return False
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return False
    try:
        return json.dumps(parameter.default, sort_keys=True) == json.dumps(value, sort_keys=True)
    except TypeError:  # a default JSON cannot hold (an object): not comparable
        return False
