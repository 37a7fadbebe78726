"""Typed schema for the top-level config keys, so Hydra rejects a wrong type or an unknown key at
start-up with a message that names it (e.g. "budget.leaves=abc" or "data.pool_sise=8").

Each settings group (budget, data, sampling, loss, cold_start, predictor, selection, module, eval) is
generated from the class it builds (`schema_of`): the class owns every default, `conf/*.yaml` only
overrides, and `instantiate(cfg.<group>)` returns the checked object. Component groups (model, env,
allocator, ...) stay untyped here: each constructor validates its own arguments and names its config key
in the error.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from trace_lightning.allocation import BetaPrior
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings
from trace_lightning.engines.base import SamplingParams
from trace_lightning.envs.sandbox import SandboxLimits
from trace_lightning.evaluation import EvalSettings
from trace_lightning.losses import LossSettings
from trace_lightning.module import ModuleSettings
from trace_lightning.predictor import PredictorSettings
from trace_lightning.selection import Selection


@dataclass
class CheckpointsConfig:
    keep_last: int | None = 2
    allow_config_change: bool = False


def schema_of(cls: type) -> type:
    """A typed structured-config class for the config group that builds `cls`: `_target_` plus each of
    its fields that has a plain default, with the class's own type and default. So the class is the one
    owner of every default (YAML only overrides), Hydra rejects a wrongly typed value at start-up, and
    `instantiate` on the group returns the object. Runtime state (fields with a default_factory) is left
    out."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = [
        ("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}"))
    ]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], field(default=f.default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


BudgetConfig = schema_of(Budget)
DataConfig = schema_of(DataSettings)
SamplingConfig = schema_of(SamplingParams)
LossConfig = schema_of(LossSettings)
ColdStartConfig = schema_of(BetaPrior)
PredictorConfig = schema_of(PredictorSettings)
SelectionConfig = schema_of(Selection)
ModuleConfig = schema_of(ModuleSettings)
EvalConfig = schema_of(EvalSettings)


@dataclass
class TrainConfig:
    seed: int = 0
    task_name: str = "train"
    output_root: str = "outputs"
    run_dir: str = MISSING
    ckpt_path: str | None = None
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    module: ModuleConfig = field(default_factory=ModuleConfig)  # type: ignore[valid-type]
    budget: BudgetConfig = field(default_factory=BudgetConfig)  # type: ignore[valid-type]
    data: DataConfig = field(default_factory=DataConfig)  # type: ignore[valid-type]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # type: ignore[valid-type]
    loss: LossConfig = field(default_factory=LossConfig)  # type: ignore[valid-type]
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)  # type: ignore[valid-type]
    predictor: PredictorConfig = field(default_factory=PredictorConfig)  # type: ignore[valid-type]
    selection: SelectionConfig = field(default_factory=SelectionConfig)  # type: ignore[valid-type]
    eval: EvalConfig = field(default_factory=EvalConfig)  # type: ignore[valid-type]
    advantage: Any = MISSING  # an estimator of batching.py, by `_target_` (conf/advantage/*.yaml)
    aggregation: Any = MISSING  # a loss aggregation of losses.py, by `_target_` (conf/aggregation/*.yaml)
    model: Any = MISSING
    adapter: Any = None
    optimizer: Any = MISSING
    scheduler: Any = None
    engine: Any = MISSING
    env: Any = MISSING
    allocator: Any = MISSING
    trainer: Any = MISSING
    logger: Any = None
    callbacks: Any = None
    debug: Any = None
    experiment: Any = None


def register() -> None:
    """Make the schema and the `${abspath:...}` resolver known to Hydra (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(group="sandbox", name="limits", node=schema_of(SandboxLimits))  # env=math_tool's env.sandbox
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda p: str(Path(p).expanduser().resolve()))


def conf_dir() -> Path:
    """The shipped configs: inside the installed package (wheel) or the repository's `conf/` (checkout)."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "train.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


class UnknownSettingError(ValueError):
    """A command-line override names a setting that no config group has."""


def checked_main(main: Callable[[], Any]) -> None:
    """A console entry: run the Hydra `main` after checking the command line's overrides, so a
    misspelt setting fails here, naming the nearest real ones, instead of deep in Hydra."""
    try:
        check_overrides(sys.argv[1:])
    except UnknownSettingError as err:
        raise SystemExit(f"error: {err}") from None
    main()


def check_overrides(args: list[str]) -> None:
    """Reject `key=value` overrides whose key does not exist, suggesting the nearest real keys.

    Hydra's own message for a misspelt key (`budget.leavs=3`) suggests `+budget.leavs=3`, which would
    add a setting nothing reads. Group choices (`env=math_tool`) are applied first, so the keys of the
    chosen groups count, those of groups found through `hydra.searchpath=[file://...]` included; sweeps
    (`-m env=a,b`), `+`/`~` overrides and other `hydra.*` keys are left to Hydra.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # a syntax error: Hydra reports it with its own, better message
        return
    searchpath = [o.input_line for o in overrides if o.key_or_group == "hydra.searchpath"]
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_")}
    for entry in searchpath:  # a user's config folders (their own env group, ...) count as groups too
        for folder in re.findall(r"file://([^,\]\s]+)", entry):
            if Path(folder).is_dir():
                groups |= {p.name for p in Path(folder).iterdir() if p.is_dir()}
    chosen = [o.input_line for o in overrides if o.key_or_group in groups and not o.is_sweep_override()]
    chosen += searchpath
    swept = {o.key_or_group.split(".")[0] for o in overrides if o.is_sweep_override()}
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("train", overrides=chosen)
    except Exception:  # a bad group choice: Hydra names it when it composes for real
        return
    finally:
        GlobalHydra.instance().clear()
    known = setting_keys(cfg)
    for o in overrides:
        key = o.key_or_group
        if o.is_add() or o.is_delete() or o.is_force_add() or key in groups or key.startswith("hydra"):
            continue
        if key.split(".")[0] in swept or key in known:
            continue
        leaves = sorted(k for k in known if not any(other.startswith(f"{k}.") for other in known))
        near = difflib.get_close_matches(key, leaves, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise UnknownSettingError(
            f"{key} is not a setting: {hint}(Hydra's `+{key}=` would add a key that nothing reads.) "
            "`python -m trace_lightning.trainer --cfg job` prints every setting."
        )


def setting_keys(cfg: Any) -> set[str]:
    """Every dotted key of a composed config (`_target_` and `hydra` left out)."""
    return _keys(OmegaConf.to_container(cfg, resolve=False), "")


def _keys(tree: Any, prefix: str) -> set[str]:
    out: set[str] = set()
    for key, value in tree.items() if isinstance(tree, dict) else ():
        if key in ("_target_", "hydra"):
            continue
        out.add(f"{prefix}{key}")
        out |= _keys(value, f"{prefix}{key}.")
    return out
