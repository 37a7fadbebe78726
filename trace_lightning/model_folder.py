"""Reading a policy's model folder: the model group's folder, or a warm start and its marker.

`warmstart.py` writes a warm start (a plain model folder, `MARKER` written last); the trainer, the
evaluation and the warm start itself read one through these functions, so that no command-line module
imports another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

MARKER = "warm_start.json"  # written last into the folder: what was trained, on what


def check_warm_start(path: str) -> str:
    """`model.warm_start=<path>` must be a folder the warm start wrote (it ends with the marker file)."""
    if not (Path(path) / MARKER).is_file():
        raise FileNotFoundError(
            f"model.warm_start={path!r} is not a finished warm start (no {MARKER}): run "
            "`python -m trace_lightning.warmstart` and pass the folder it prints"
        )
    return str(path)


def warm_start_record(path: str) -> dict[str, Any]:
    """What the warm start at `path` wrote into its marker (env, held-out ids, base model, ...)."""
    record: dict[str, Any] = json.loads((Path(check_warm_start(path)) / MARKER).read_text())
    return record


def check_held_out(path: str, held_out: Sequence[int]) -> None:
    """Held-out tasks must not be tasks the warm start at `path` was fine-tuned on: refuse, naming the
    keys that fix it, when `data.held_out` holds out more (or other) tasks than it did."""
    kept = set(warm_start_record(path).get("held_out_task_ids", []))
    trained_on = sorted(set(held_out) - kept)
    if trained_on:
        raise ValueError(
            f"data.held_out={len(held_out)} would evaluate on tasks {trained_on[:8]}"
            f"{' ...' if len(trained_on) > 8 else ''} that the warm start model.warm_start={path} was "
            f"trained on (it held out {len(kept)}): pass data.held_out<={len(kept)} with the warm start's "
            f"seed (another training seed keeps its split and tasks with data.split_seed=<the warm start's "
            f"seed> env.seed=<the same>), or build the warm start with held_out={len(held_out)}"
        )


def model_tags(warm_start: str | None, model_path: str) -> dict[str, str]:
    """How MLflow names a run's model: its base model and its warm start's run folder (or `none`), not
    the warm start's model folder, which is always called `model`."""
    if warm_start is None:
        return {"base_model": Path(model_path).name, "warm_start": "none"}
    folder = Path(warm_start).resolve()
    name = folder.parent.name if folder.name == "model" else folder.name
    return {"base_model": str(warm_start_record(warm_start).get("base_model", "unknown")), "warm_start": name}


def policy_path(model_cfg: DictConfig) -> str:
    """The policy's model folder: `model.warm_start` when set, else what the model group builds."""
    warm = model_cfg.get("warm_start")
    if warm is not None:
        return check_warm_start(str(warm))
    for key in model_cfg:
        if OmegaConf.is_missing(model_cfg, key):
            raise ValueError(f"model.{key} is required: pass model.{key}=... on the command line")
    rest = OmegaConf.to_container(model_cfg, resolve=True)  # resolved here: ${run_dir} needs the root
    assert isinstance(rest, dict)
    for key in POLICY_OPTIONS:
        rest.pop(key, None)
    return str(instantiate(rest))


POLICY_OPTIONS = ("warm_start", "dtype", "chat_template")  # model-group keys that are not the folder's


def policy_options(model_cfg: DictConfig) -> dict[str, Any]:
    """`build_policy`'s keyword arguments from the model group: `dtype` ("auto" when absent) and
    `chat_template` (None: the tokenizer's own)."""
    return {"dtype": str(model_cfg.get("dtype") or "auto"), "chat_template": model_cfg.get("chat_template")}
