"""Logging callbacks: they read what an iteration built and log it; compute code never logs.

Each callback pairs a pure function of `metrics.py` (report -> dict of floats, tested on hand-built
trees) with a thin Lightning hook, and reaches the run only through `data.RolloutDataModule.of(trainer)`
(with another DataModule, or none, it does nothing). Lightning calls `train_dataloader()` before
`on_train_epoch_start`, so in that hook `datamodule.report` describes the iteration the coming epoch
trains on. Keys are `area/name`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import MLFlowLogger

from trace_lightning.artifacts import write_artifacts
from trace_lightning.data import RolloutDataModule
from trace_lightning.evaluation import EvalResult, EvalSettings, paired_change
from trace_lightning.metrics import (
    budget_seconds,
    budget_spend,
    calibration_metrics,
    probe_metrics,
    rollout_metrics,
)
from trace_lightning.report import IterationReport


def latest_report(trainer: Trainer) -> IterationReport | None:
    """The report of the iteration the Trainer is on (None before the first, or without a
    RolloutDataModule)."""
    data = RolloutDataModule.of(trainer)
    return None if data is None else data.report


class RolloutStats(Callback):
    """Logs `rollout/*`, `budget/*` and `tree/*` once per iteration; when its training ends, its seconds
    by phase (`budget_seconds`) and the running sum of every budget unit (`budget/<unit>_cum`, x-axes
    for success against budget spent), which survive a resume through `state_dict`."""

    def __init__(self) -> None:
        self.cum: dict[str, float] = {}
        self.last_iteration = -1
        self._report: IterationReport | None = None
        self._first_step_start = self._last_step_end = 0.0

    def metrics(self, report: IterationReport) -> dict[str, float]:
        return rollout_metrics(report)

    def units(self, report: IterationReport, train_seconds: float) -> dict[str, float]:
        """What `on_train_epoch_end` logs: the iteration's seconds by phase and the running sums of every
        unit (`budget/<unit>_cum`), counted once per iteration. (The per-iteration spend is in `metrics`,
        logged when the epoch starts.)"""
        seconds = budget_seconds(report, train_seconds)
        if report.iteration != self.last_iteration:  # an unreloaded dataloader must not count twice
            for key, value in (budget_spend(report) | seconds).items():
                self.cum[key] = self.cum.get(key, 0.0) + value
            self.last_iteration = report.iteration
        return seconds | {f"{key}_cum": total for key, total in self.cum.items()}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = latest_report(trainer)
        # On resume the first epoch re-serves an iteration already counted: no units for it.
        self._report = report if report is not None and report.iteration != self.last_iteration else None
        self._first_step_start = self._last_step_end = time.perf_counter()
        if report is not None:
            # The report is gathered over processes, so every process logs the same keys and values;
            # sync_dist only makes that explicit to Lightning (which warns otherwise).
            pl_module.log_dict(
                self.metrics(report), on_step=False, on_epoch=True, batch_size=1, sync_dist=True
            )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0:  # what other callbacks run as the epoch starts (a probe) is not training
            self._first_step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_step_end = time.perf_counter()  # what runs at the epoch's end (evaluation) is not training

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._report is not None:
            units = self.units(self._report, self._last_step_end - self._first_step_start)
            pl_module.log_dict(units, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
            self._report = None

    def state_dict(self) -> dict[str, Any]:
        return {"cum": dict(self.cum), "last_iteration": self.last_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cum = {k: float(v) for k, v in state_dict.get("cum", {}).items()}
        if "leaves_cum" in state_dict:  # checkpoints written before the budget units
            self.cum = {
                "budget/leaves": float(state_dict["leaves_cum"]),
                "budget/tokens": float(state_dict["tokens_cum"]),
            }
        self.last_iteration = int(state_dict["last_iteration"])


# --------------------------------------------------------------------------- held-out learning curve


class HeldOutSuccess(Callback):
    """The learning curve: pass@1 and pass@k with standard errors on the `eval.tasks` (by default the
    `data.held_out` tasks, never drawn into a pool), before training, after every
    `eval.every_n_iterations` iterations and after the last, with the same episodes' seed every time
    (`evaluation.py` says how the numbers are computed). Logs `eval/*` at the global step, plus
    `eval/pass_at_1_change` and its `_se`: the change since the first point, paired by task. `history`
    keeps (iterations trained, result) for the console summary, and survives a resume.

    Per-iteration `rollout/success_rate` is no learning curve: it follows which prompts Stage 1 picked
    (TRACE picks those likely to have mixed outcomes). This measures one fixed set."""

    def __init__(self, settings: EvalSettings | None = None) -> None:
        self.settings = settings if settings is not None else EvalSettings()
        self.history: list[tuple[int, EvalResult]] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate(trainer, pl_module, trainer.current_epoch)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trained = trainer.current_epoch + 1
        last = trainer.max_epochs is not None and trained >= trainer.max_epochs
        if trained % self.settings.every_n_iterations == 0 or last:
            self._evaluate(trainer, pl_module, trained)

    def _evaluate(self, trainer: Trainer, pl_module: LightningModule, trained: int) -> None:
        data = RolloutDataModule.of(trainer)
        if data is None or any(done == trained for done, _ in self.history):
            return
        result = data.evaluate(pl_module, self.settings, f"evaluation after {trained} iterations")
        if result is None:  # data.held_out=0: nothing to evaluate on
            return
        self.history.append((trained, result))
        metrics = result.metrics() | {"eval/iterations_trained": float(trained)}
        change, change_se = paired_change(self.history[0][1], result)
        metrics |= {"eval/pass_at_1_change": change, "eval/pass_at_1_change_se": change_se}
        for logger in trainer.loggers:
            logger.log_metrics(
                {k: v for k, v in metrics.items() if math.isfinite(v)}, step=trainer.global_step
            )
        # where other callbacks read metrics (checkpoints.export.ModelArtifact(best="eval/pass_at_1"))
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})

    def state_dict(self) -> dict[str, Any]:
        """The curve so far as plain values (checkpoints load only allow-listed types)."""
        return {"history": [(trained, dataclasses.asdict(r)) for trained, r in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(int(t), _eval_result(r)) for t, r in state_dict.get("history", [])]


def _eval_result(fields: dict[str, Any]) -> EvalResult:
    return EvalResult(
        **{
            **fields,
            "task_ids": tuple(fields["task_ids"]),
            "successes": tuple(fields["successes"]),
            "groups": tuple(fields.get("groups", ())),
        }
    )


# --------------------------------------------------------------------------- Monte Carlo probe


class SuccessProbe(Callback):
    """Every `every_n_epochs` iterations, `2 * half` episodes of every candidate of the pool the iteration
    was allocated over, with the policy that sampled it (before the epoch trains), outside the budget
    and every training stream (`RolloutCollector.play`): a probed run trains exactly like an unprobed
    one. Logs `probe/*` (`probe_metrics`); `history` keeps (iteration, metrics) for benchmarks. An
    instrument for judging the predictor: it costs `2 * half * data.pool_size` episodes."""

    def __init__(
        self, every_n_epochs: int = 4, half: int = 8, max_per_prompt: int = 16, seed: int = 2_000_003
    ):
        if every_n_epochs < 1 or half < 1:
            raise ValueError(
                f"callbacks.probe.every_n_epochs={every_n_epochs} and callbacks.probe.half={half} must "
                "be >= 1"
            )
        self.every_n_epochs, self.half, self.max_per_prompt, self.seed = (
            every_n_epochs,
            half,
            max_per_prompt,
            seed,
        )
        self.history: list[tuple[int, dict[str, float]]] = []
        # (iteration, candidate task ids, raw root predictions, half A's and half B's successes, the bare
        # rollouts Stage 1 gave each candidate)
        self.rates: list[tuple[int, list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = RolloutDataModule.of(trainer)
        report = None if data is None else data.report
        if data is None or report is None or report.pool_ids is None:
            return
        if report.iteration % self.every_n_epochs or report.used_prior:
            return
        seed = self.seed + 2 * report.iteration
        a = data.probe(pl_module, report.pool_ids, self.half, seed)
        b = data.probe(pl_module, report.pool_ids, self.half, seed + 1)
        counts = report.result.root_counts
        metrics = probe_metrics(report.result.pool_predicted, counts, a, b, self.half, self.max_per_prompt)
        self.history.append((report.iteration, metrics))
        self.rates.append(
            (report.iteration, list(report.pool_ids), report.result.pool_predicted, a, b, np.asarray(counts))
        )
        for logger in trainer.loggers:
            logger.log_metrics(
                {k: v for k, v in metrics.items() if math.isfinite(v)}, step=trainer.global_step
            )


# --------------------------------------------------------------------------- predictor calibration


class PredictorCalibration(Callback):
    """Logs how well the allocation's success estimates matched what the rollouts then did."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (report := latest_report(trainer)) is not None:
            pl_module.log_dict(
                calibration_metrics(report), on_step=False, on_epoch=True, batch_size=1, sync_dist=True
            )


# --------------------------------------------------------------------------- artifacts


class TreeArtifacts(Callback):
    """Every `every_n_epochs` iterations, writes the trees (JSON), one drawing (PNG) and a few decoded
    samples (Markdown) under `output_dir`, and uploads them to MLflow when an MLFlowLogger is attached."""

    def __init__(self, output_dir: str | None = None, every_n_epochs: int = 1) -> None:
        if every_n_epochs < 1:
            raise ValueError(f"callbacks.tree_artifacts.every_n_epochs={every_n_epochs} must be >= 1")
        self.output_dir, self.every_n_epochs = output_dir, every_n_epochs

        self._out_dir: Path | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # resolved here, on every rank: `trainer.log_dir` broadcasts, so rank zero alone would hang
        self._out_dir = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = latest_report(trainer)
        if report is None or not trainer.is_global_zero or trainer.current_epoch % self.every_n_epochs:
            return
        assert self._out_dir is not None, "setup() runs before the first epoch"
        paths = write_artifacts(report, self._out_dir, pl_module.tokenizer)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                for folder, path in paths:
                    logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder)
