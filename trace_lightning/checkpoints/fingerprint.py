"""Whether a checkpoint's config fingerprint still describes this run, across a move of the code.

A fingerprint is, per config group (model, adapter, allocator, env, predictor), the group as canonical
JSON. A `_target_` path that names the same object as today's (a module moved: `MOVED` maps its old
path to the new one) does not change what a checkpoint means, so a checkpoint written before the move
still resumes. Only paths inside `trace_lightning` are imported to check: a checkpoint is untrusted
input, and importing a module it names could run code. Any other difference, a setting added since
included (its default may not be what the trainer did then), is one `validate.check_resumable` names,
and `checkpoints.allow_config_change=true` overrides.

Example: stored {"_target_": "trace_lightning.checkpoint_io.AtomicCheckpointIO", "keep_last": 2} and
now {"_target_": "trace_lightning.checkpoints.plugin.AtomicCheckpointIO", "keep_last": 2} are the
same; with "keep_last": 3 now, or a key only one of them has, they are not.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

_OWN = "trace_lightning."
# Modules that moved, old path -> new: a stored `_target_` under an old path resolves to the new module.
MOVED = {
    "trace_lightning.checkpoint_io": "trace_lightning.checkpoints.plugin",
    "trace_lightning.checkpoint_files": "trace_lightning.checkpoints.files",
    "trace_lightning.checkpoint_shards": "trace_lightning.checkpoints.shards",
    "trace_lightning.envs.jail": "trace_lightning.envs.sandbox.jail",
    "trace_lightning.envs.sandbox_worker": "trace_lightning.envs.sandbox.worker",
}


def same_group(stored: str | None, now: str | None) -> bool:
    """Whether two fingerprint entries (JSON text) describe the same config, as the module docstring says."""
    if stored == now:
        return True
    if stored is None or now is None:
        return False
    return _same(json.loads(stored), json.loads(now))


def _same(stored: Any, now: Any) -> bool:
    if isinstance(stored, dict) and isinstance(now, dict):
        if stored.keys() != now.keys():
            return False
        if "_target_" in stored and not _same_target(stored["_target_"], now["_target_"]):
            return False
        return all(_same(stored[k], now[k]) for k in stored if k != "_target_")
    if isinstance(stored, list) and isinstance(now, list):
        return len(stored) == len(now) and all(_same(a, b) for a, b in zip(stored, now, strict=True))
    return bool(stored == now)


def _same_target(stored: Any, now: Any) -> bool:
    if stored == now:
        return True
    if not (isinstance(stored, str) and isinstance(now, str) and stored.startswith(_OWN)):
        return False
    old, new = _resolve(stored), _resolve(now)
    return old is not None and old is new


def moved(path: str) -> str:
    """`path` with a moved module's old name replaced by its new one (`MOVED`)."""
    for old, new in MOVED.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
    return path


def _resolve(path: str) -> Any:
    """The object a dotted path names (module attribute, or a class's attribute), or None."""
    parts = moved(path).split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj
    return None
