"""`python -m trace_lightning.trainer`: the Hydra main. It instantiates and wires; the config stops here.

python -m trace_lightning.trainer                                  # the embedded default (CPU)
python -m trace_lightning.trainer allocator=uniform budget.leaves=24
python -m trace_lightning.trainer -m allocator=uniform,trace       # a sweep, one MLflow run each
python -m trace_lightning.trainer experiment=grpo                  # a paper baseline
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from trace_lightning import config
from trace_lightning.allocation import BetaPrior, TreeAllocator
from trace_lightning.checkpoints import AtomicCheckpointIO, newest_valid_checkpoint, validate_checkpoint
from trace_lightning.data import RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.module import TraceModule
from trace_lightning.warmstart import policy_path

config.register()


def build(cfg: DictConfig) -> tuple[TraceModule, RolloutDataModule, L.Trainer]:
    """Every component from its config group; nothing below receives a DictConfig."""
    L.seed_everything(cfg.seed, workers=True)
    ckpt_path = _checkpoint_path(cfg)  # a missing or corrupt checkpoint fails now, naming the file
    allocator: TreeAllocator = instantiate(cfg.allocator)
    env = instantiate(cfg.env)
    p, loss = cfg.predictor, cfg.loss
    model_path = policy_path(cfg.model)  # `model.warm_start=<folder>` trains from a warm start
    module = TraceModule(
        model_path,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler is not None else None,
        adapter=instantiate(cfg.adapter) if cfg.adapter is not None else None,
        predictor_width=p.width,
        predictor_lr=p.lr,
        predictor_coef=p.coef,
        predictor_weighting=p.weighting,
        predictor_backbone=p.backbone,
        temperature=cfg.sampling.temperature,
        **OmegaConf.to_container(loss),  # type: ignore[arg-type]
    )
    data = RolloutDataModule(
        env=env,
        allocator=allocator,
        engine=instantiate(cfg.engine),
        sampling=SamplingParams(**OmegaConf.to_container(cfg.sampling)),  # type: ignore[arg-type]
        leaves=cfg.budget.leaves,
        max_tokens=cfg.budget.max_tokens,
        estimator=cfg.advantage.estimator,
        cold_start=BetaPrior(**OmegaConf.to_container(cfg.cold_start)),  # type: ignore[arg-type]
        seed=cfg.seed,
        **OmegaConf.to_container(cfg.data),  # type: ignore[arg-type]
    )
    logger = _logger(cfg, allocator, env, model_path, ckpt_path)
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values() if c is not None]
    trainer = instantiate(
        cfg.trainer,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
    )
    return module, data, trainer


def _logger(
    cfg: DictConfig, allocator: TreeAllocator, env: Any, model_path: str, ckpt_path: str | None
) -> Any:
    """MLflow by default; a resumed run continues the MLflow run recorded in its checkpoint."""
    if cfg.logger is None:
        return None
    run_id = _checkpoint_run_id(ckpt_path)
    if run_id is not None:
        return instantiate(cfg.logger, run_id=run_id)
    tags = {"allocator": allocator.name, "env": env.name, "model": Path(model_path).name}
    logger = instantiate(cfg.logger, tags=tags, run_name=f"{allocator.name}-{env.name}-{cfg.task_name}")
    mark_model_training(logger)
    if hasattr(logger, "log_hyperparams"):
        logger.log_hyperparams(_flatten(OmegaConf.to_container(cfg, resolve=True)))  # type: ignore[arg-type]
    return logger


# MLflow 3's UI has two views, GenAI (runs listed as "Evaluation runs", traces first) and Model
# training. Its UIs before 3.17 chose by this experiment tag ("custom_model_development" is what their
# "Model training" choice writes); 3.17.2's UI ignores the tag and follows its sidebar switch, which
# a link sets with `?workflowType=machine_learning` (checked in headless Chromium, tests/test_mlflow_ui.py).
# So we tag the experiment and print links that carry the parameter.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def mark_model_training(logger: Any) -> None:
    """Tag the MLflow experiment as one for model training (the marker MLflow 3 UIs before 3.17 read)."""
    if isinstance(logger, MLFlowLogger) and logger.experiment_id is not None:
        logger.experiment.set_experiment_tag(logger.experiment_id, *EXPERIMENT_KIND)


def _checkpoint_path(cfg: DictConfig) -> str | None:
    """`ckpt_path=last`: the newest valid checkpoint of this run_dir (resume with the same run_dir=...).
    An explicit path is validated first, so a corrupt file fails here naming it, not deep in Lightning."""
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        found = newest_valid_checkpoint(Path(cfg.run_dir) / "checkpoints")
        if found is None:
            raise FileNotFoundError(
                f"ckpt_path=last: no valid checkpoint in {Path(cfg.run_dir) / 'checkpoints'}; "
                "pass run_dir=<the run to resume>"
            )
        return str(found)
    validate_checkpoint(cfg.ckpt_path)
    return str(cfg.ckpt_path)


def _checkpoint_run_id(ckpt_path: str | None) -> str | None:
    if ckpt_path is None:
        return None
    return validate_checkpoint(ckpt_path).get("mlflow_run_id")


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
    trainer.fit(module, datamodule=data, ckpt_path=_checkpoint_path(cfg))
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
    metrics = train(cfg)
    return metrics.get("rollout/success_rate")


if __name__ == "__main__":
    main()
