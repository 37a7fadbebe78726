"""`python -m trace_lightning.evaluate`: a saved policy on an environment's tasks, without training.

python -m trace_lightning.evaluate model.warm_start=<folder>                 # a warm start
python -m trace_lightning.evaluate ckpt_path=<run_dir> model.warm_start=<the folder it trained from>
python -m trace_lightning.evaluate ckpt_path=<file>.ckpt eval.samples=8 eval.tasks=all
python -m trace_lightning.evaluate model.warm_start=<folder> eval.temperature=0 eval.samples=1  # greedy

The config is the trainer's (conf/evaluate.yaml extends conf/train.yaml), so the same overrides name the
same model, adapter, environment, engine and held-out split, and `eval.*` says how to evaluate
(`evaluation.py`: pass@1 and pass@k with standard errors). The pieces are the trainer's own
(`trainer.build_parts`, `trainer.build_module`). A checkpoint is validated as a resume validates it
(digest, allow-listed unpickling, weight shapes) and must come from the same model and adapter. It
prints the scores, writes `<run_dir>/evaluation.json` and, with a logger, an MLflow run
`evaluate-<env>` in the trainer's store.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm.auto import tqdm

from trace_lightning import config
from trace_lightning.checkpoints import CheckpointError, check_shapes, validate_checkpoint
from trace_lightning.checkpoints.validate import newest_valid
from trace_lightning.console import quiet_console, quiet_known_warnings
from trace_lightning.evaluation import EvalResult
from trace_lightning.model_folder import model_tags
from trace_lightning.module import TraceModule
from trace_lightning.run_record import mark_model_training
from trace_lightning.trainer import Parts, build_module, build_parts, config_fingerprint

config.register()

SAME_POLICY = ("model", "adapter")  # config groups a checkpoint's weights must match


def evaluate(cfg: DictConfig) -> tuple[EvalResult, Path]:
    """Build the policy (and load the checkpoint), play the evaluation, write and log it."""
    L.seed_everything(cfg.seed, workers=True)
    quiet_known_warnings(world_size=1)
    parts = build_parts(cfg)
    tasks = parts.data.eval_tasks(parts.evaluation.tasks)
    if not tasks:
        raise ValueError(
            f"eval.tasks={parts.evaluation.tasks} with data.held_out=0: no task to evaluate; "
            "set data.held_out=N (the warm start's count) or eval.tasks=all"
        )
    checked = checked_checkpoint(cfg.ckpt_path)
    ckpt_path = None if checked is None else checked[0]
    module, model_path = build_module(cfg, parts)
    if checked is not None:
        load_checkpoint(cfg, *checked, module)
    bar = tqdm(
        total=len(tasks) * parts.evaluation.samples, desc="evaluating", unit="episode", dynamic_ncols=True
    )
    try:
        result = parts.data.collector.evaluator.evaluate(module, parts.evaluation, bar)
    finally:
        bar.close()
        parts.data.collector.close()
    assert result is not None
    out = _write(cfg, parts, result, model_path, ckpt_path)
    _log(cfg, parts, result, model_path, ckpt_path)
    return result, out


def checkpoint_path(ckpt_path: str | None) -> Path | None:
    """`ckpt_path`: a checkpoint file, a run directory (its newest valid checkpoint) or None (the model
    as `model` / `model.warm_start` builds it)."""
    found = checked_checkpoint(ckpt_path)
    return None if found is None else found[0]


def checked_checkpoint(ckpt_path: str | None) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `ckpt_path` names with its state, read once: the bytes that passed every check
    are the bytes loaded (a file swapped in between cannot be loaded under this run's name)."""
    if ckpt_path is None:
        return None
    path = Path(ckpt_path)
    if not path.is_dir():
        return path, validate_checkpoint(path)
    found = newest_valid(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no valid checkpoint in {path / 'checkpoints'}")
    return found


def load_checkpoint(cfg: DictConfig, path: Path, ckpt: dict[str, Any], module: TraceModule) -> None:
    """The checkpoint's weights (`ckpt`, as validated) into `module`, after the same checks a resume
    makes; a checkpoint of another model or adapter is refused, naming what differs."""
    stored = (ckpt.get("trace_run") or {}).get("fingerprint") or {}
    now = config_fingerprint(cfg)
    for key in SAME_POLICY:
        if key in stored and stored[key] != now[key]:
            raise CheckpointError(
                "config_mismatch",
                f"ckpt_path={path} was trained with {key}={stored[key]}, this config has {key}={now[key]}: "
                f"pass the {key} overrides the run was trained with (e.g. model.warm_start=<its folder>)",
            )
    check_shapes(path, ckpt, module.state_dict())
    module.load_state_dict(ckpt["state_dict"])


def _write(cfg: DictConfig, parts: Parts, result: EvalResult, model_path: str, ckpt: Path | None) -> Path:
    """Print the scores and write `<run_dir>/evaluation.json`; its path."""
    what = ckpt if ckpt is not None else model_path
    how = "greedy" if result.temperature == 0 else f"temperature {result.temperature:g}"
    n = len(result.task_ids)
    print(
        f"\nevaluation of {what} on {parts.env.name}: {n} {parts.evaluation.tasks} tasks x {result.samples}"
    )
    print(f"  episodes, {how}, {result.seconds:.0f} s (± is one standard error over tasks)")
    print(
        f"  pass@1 {result.pass_at_1:.3f} ± {result.pass_at_1_se:.3f}   pass@{result.k} "
        f"{result.pass_at_k:.3f} ± {result.pass_at_k_se:.3f}   reward {result.reward:.3f}   "
        f"turns {result.turns:.2f}"
    )
    out = Path(cfg.run_dir) / "evaluation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "ckpt_path": str(ckpt) if ckpt is not None else None,
        "model_path": model_path,
        "env": parts.env.name,
        "eval": dataclasses.asdict(parts.evaluation),
        "result": dataclasses.asdict(result),
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"  written: {out.resolve()}")
    return out


def _log(cfg: DictConfig, parts: Parts, result: EvalResult, model_path: str, ckpt: Path | None) -> None:
    """An MLflow run `evaluate-<env>` with the eval/* metrics, tagged with what was evaluated."""
    if cfg.logger is None:
        return
    tags = {"stage": "evaluate", "env": parts.env.name, **model_tags(cfg.model.get("warm_start"), model_path)}
    tags["ckpt_path"] = str(ckpt) if ckpt is not None else "none"
    logger: Any = instantiate(cfg.logger, run_name=f"evaluate-{parts.env.name}", tags=tags, log_model=False)
    mark_model_training(logger)
    settings = {f"eval.{k}": v for k, v in dataclasses.asdict(parts.evaluation).items()}
    logger.log_hyperparams(settings | {"data.held_out": cfg.data.held_out, "seed": cfg.seed})
    logger.log_metrics(result.metrics(), step=0)
    logger.finalize("success")


@hydra.main(config_path=str(config.conf_dir()), config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float:
    quiet_console()  # the trainer's console rules: INFO to <run_dir>/evaluate.log, warnings and the bar
    result, _ = evaluate(cfg)
    return result.pass_at_1


def cli() -> None:
    """The console entry: a misspelt setting fails here, naming the nearest real ones."""
    config.checked_main(main)


if __name__ == "__main__":
    cli()
