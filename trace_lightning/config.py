"""Typed schema for the top-level config keys, so Hydra rejects a wrong type or an unknown key at
start-up with a message that names it (e.g. "budget.leaves=abc" or "data.pool_sise=8").

Component groups (model, env, allocator, ...) stay untyped here: each constructor validates its own
arguments and names its config key in the error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from trace_lightning.selection import Selection


@dataclass
class BudgetConfig:
    leaves: int = 12
    max_tokens: int | None = None


@dataclass
class DataConfig:
    pool_size: int = 12
    micro_batch_size: int = 4  # leaf sequences per micro-batch, when micro_batch_tokens is null
    micro_batch_tokens: int | None = 2048  # packed tokens per micro-batch (packing.budget_groups)
    max_turns: int = 3
    max_episode_tokens: int = 768
    step_timeout: float | None = 30.0  # seconds an environment step may take before the episode fails
    max_observation_chars: int = 4000


@dataclass
class SamplingConfig:
    max_new_tokens: int = 48
    temperature: float = 0.8
    top_p: float = 1.0


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"


@dataclass
class ColdStartConfig:
    alpha: float = 1.0
    beta: float = 1.0
    warmup: int = 1
    decay: float = 1.0


@dataclass
class PredictorConfig:
    width: int = 256
    lr: float = 1e-3
    coef: float = 0.0
    weighting: str = "leaves"
    backbone: str | None = None
    standardize: bool = True
    pooling: str = "last_mean"
    posterior_features: bool = False
    refit_steps: int = 50
    replay_window: int = 8
    refit_batch: int = 256


@dataclass
class CheckpointsConfig:
    keep_last: int | None = 2
    allow_config_change: bool = False


@dataclass
class ModuleConfig:
    max_skipped_steps: int | None = MISSING  # conf/train.yaml owns the default


@dataclass
class AdvantageConfig:
    estimator: str = "tree_grpo"


@dataclass
class TrainConfig:
    seed: int = 0
    task_name: str = "train"
    output_root: str = "outputs"
    run_dir: str = MISSING
    ckpt_path: str | None = None
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    module: ModuleConfig = field(default_factory=ModuleConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    selection: Any = MISSING
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
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
    store.store(group="selection", name="default", node=_defaults_of(Selection))
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda p: str(Path(p).expanduser().resolve()))


def _defaults_of(cls: type) -> dict[str, Any]:
    """A config group generated from a dataclass's own defaults (`_target_` plus each plain field), so a
    default is written once, in the class; runtime state (fields with a default_factory) is left out."""
    plain = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {"_target_": f"{cls.__module__}.{cls.__qualname__}", **plain}


def conf_dir() -> Path:
    """The shipped configs: inside the installed package (wheel) or the repository's `conf/` (checkout)."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "train.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"
