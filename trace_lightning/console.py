"""What a person watching `fit` sees: one progress bar per iteration and a one-screen summary at the end.

An iteration has two phases, so its one bar has two: episodes finished out of the leaf budget while
the trees are sampled, then training steps. Everything else belongs in the run's log file: under
Hydra (`<run_dir>/trainer.log`) conf/train.yaml sends only warnings to the console, the DataModule's
iteration lines go to the log, and the vLLM engine routes vLLM's own logger there too
(`engines.vllm.route_logger_to_run_log`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from trace_lightning import metrics
from trace_lightning.callbacks import HeldOutSuccess, SuccessProbe, latest_report
from trace_lightning.data import RolloutDataModule
from trace_lightning.evaluation import EvalResult, paired_change
from trace_lightning.report import IterationReport
from trace_lightning.tree import SUCCESS, tree_stats


def quiet_known_warnings(world_size: int) -> None:
    """Silence the Lightning warnings that repeat every iteration and say nothing about this run.

    - "use sync_dist=True when logging on epoch level in distributed setting", once per metric (54
      of them): vLLM initialises torch.distributed in-process, so Lightning believes a single-process
      run is distributed. Our callbacks already pass sync_dist=True; with one process there is
      nothing to sync, so this is only silenced when `world_size == 1`.
    - "You have overridden `transfer_batch_to_device`": TraceModule moves its batches itself, on purpose.
    - torch 2.13's FutureWarning on `LeafSpec`, raised inside lightning 2.6 every iteration: nothing a
      user can act on. ("once" does not hold: Python forgets what it showed whenever any code
      changes the warning filters, which Lightning does every epoch.)
    """
    if world_size == 1:
        warnings.filterwarnings(
            "ignore",
            message=r"It is recommended to use `self\.log\(.*sync_dist=True\)` when logging on epoch level",
            category=PossibleUserWarning,
        )
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    warnings.filterwarnings(  # TraceModule moves its own batches, by design (module.transfer_batch_to_device)
        "ignore", message=r"You have overridden `transfer_batch_to_device` in `LightningModule`"
    )


class Demote(logging.Filter):
    """Records whose message matches `pattern` pass as INFO: into the run's log, off the console."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and self.pattern.search(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_console() -> None:
    """The console rules the trainer, the warm start and the evaluation share, under Hydra: INFO lines go
    to the run's log file (`<run_dir>/<job>.log`), the console shows warnings and our own bars.

    - Lightning's INFO lines (the seed, the accelerator, the "litlogger" tip, "fit stopped"): at import,
      Lightning gives its loggers console handlers of their own (`lightning` always, its subpackages
      when the root logger has none yet: Hydra configures it later), so they bypass Hydra's console
      level. Dropping them lets the lines propagate to Hydra's handlers. Outside Hydra (tests,
      notebooks: no root handler) nothing changes.
    - MLflow's own INFO lines ("Creating initial MLflow database tables"): MLflow configures its logger
      at import unless `MLFLOW_CONFIGURE_LOGGING=false`; with it they reach the log file. Lightning's
      "Experiment with name ... not found. Creating it." (a WARNING on every first run) goes there too.
    - transformers' "Loading weights" and "Writing model shards" bars, and its deprecation warning on
      `is_gradient_checkpointing` (raised inside Lightning's model code): nothing a user can act on.
    """
    if logging.getLogger().handlers:
        os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")  # before mlflow is imported
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "mlflow"):
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True
        logging.getLogger("lightning.pytorch.loggers.mlflow").addFilter(
            Demote(r"Experiment with name .* not found\. Creating it\.")
        )
    hf_logging.disable_progress_bar()
    warnings.filterwarnings(
        "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )


# --------------------------------------------------------------------------- the run summary


@dataclass(frozen=True)
class IterationSummary:
    """One iteration, as the summary table shows it."""

    iteration: int
    success_rate: float  # share of leaves with reward >= tree.SUCCESS
    effective_ratio: float  # share of prompts whose tree has both outcomes
    mixed_roots: int  # trees whose root is mixed
    mixed_prefixes: int  # mixed nodes at depth >= 1 (contrast only Stage 2 can create)
    leaves: int
    tokens: int  # generated tokens
    prefill_tokens: int  # prompt tokens the engine ran (this process's engine)
    tool_calls: int
    turns_mean: float  # turns per episode
    sample_seconds: float
    sync_seconds: float
    train_seconds: float
    optimizer_steps: int = 0  # optimizer steps trained on this iteration's batches
    prompts: int = 0  # prompts trained (trees)
    steered: bool = True  # the predictor steered Stage 1 (the skill gate was open, or there is none)
    gate_skill: float | None = (
        None  # the estimates' windowed Brier skill on the unbiased slice (None: too few)
    )
    returned_leaves: int = 0  # leaves priced Stage 2 gave back to Stage 1 as root groups
    continuations_by_depth: tuple[int, ...] = ()  # priced Stage 2: continuations by start depth
    flips_by_depth: tuple[int, ...] = ()  # ... and those that ended with the other outcome
    expand_tokens: int = 0  # of `tokens`, those Stage 2's continuations generated (the rest: root rollouts)


@dataclass(frozen=True)
class FitSummary:
    iterations: tuple[IterationSummary, ...]
    wall_seconds: float  # the whole fit, set-up included
    held_out: tuple[tuple[int, EvalResult], ...] = ()  # (iterations trained, evaluation): the curve


def iteration_summary(report: IterationReport, train_seconds: float) -> IterationSummary:
    """The summary row of one iteration's report."""
    trees = report.result.trees
    stats = [tree_stats(t, SUCCESS) for t in trees]
    return IterationSummary(
        iteration=report.iteration,
        success_rate=metrics.success_rate(trees),
        effective_ratio=metrics.effective_ratio(stats),
        mixed_roots=metrics.mixed_roots(stats),
        mixed_prefixes=metrics.mixed_prefixes(stats),
        leaves=report.result.ledger.leaves_used,
        tokens=report.result.ledger.tokens_used,
        prefill_tokens=report.engine_stats.prefill_tokens if report.engine_stats is not None else 0,
        tool_calls=report.counters.tool_calls,
        turns_mean=metrics.turns_mean(trees),
        sample_seconds=report.sample_seconds,
        sync_seconds=report.sync_seconds,
        train_seconds=train_seconds,
        optimizer_steps=report.optimizer_steps,
        prompts=len(trees),
        steered=report.steered,
        gate_skill=_finite(report.root_quality.gate_skill) if report.root_quality is not None else None,
        returned_leaves=report.result.ledger.returned,
        continuations_by_depth=report.flips.continuations if report.flips is not None else (),
        flips_by_depth=report.flips.flips if report.flips is not None else (),
        expand_tokens=report.result.ledger.tokens["expand"],
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


MAX_ROWS = 12  # a longer run shows its first and last iterations, so the summary stays one screen


def summary_text(summary: FitSummary) -> str:
    """The end-of-fit summary: a row per iteration, then totals and where the time went."""
    its = summary.iterations
    if not its:
        return f"TRACE summary: no iteration finished ({_duration(summary.wall_seconds)})."
    header = "  iter  success  effective  mixed root/prefix  leaves   tokens  turns  steps  sample s  train s"
    shown = its if len(its) <= MAX_ROWS else (*its[: MAX_ROWS // 2], None, *its[-MAX_ROWS // 2 :])
    rows = [_row(it) if it is not None else f"  ... {len(its) - MAX_ROWS} more" for it in shown]
    leaves, tokens = sum(it.leaves for it in its), sum(it.tokens for it in its)
    sample, sync, train = (sum(getattr(it, f) for it in its) for f in _PHASES)
    other = max(summary.wall_seconds - sample - sync - train, 0.0)
    mean_success = sum(it.success_rate * it.leaves for it in its) / max(leaves, 1)
    return "\n".join(
        [
            f"TRACE summary: {len(its)} iterations in {_duration(summary.wall_seconds)}",
            header,
            *rows,
            f"success {mean_success:.2f} over all leaves (first iteration {its[0].success_rate:.2f}, last "
            f"{its[-1].success_rate:.2f}); effective ratio {_mean(its, 'effective_ratio'):.2f}",
            f"mixed anchors: {sum(it.mixed_roots for it in its)} roots, "
            f"{sum(it.mixed_prefixes for it in its)} turn prefixes",
            f"spent: {leaves} leaves, {tokens:,} generated tokens, "
            f"{sum(it.prefill_tokens for it in its):,} prefill tokens, {sum(it.tool_calls for it in its):,} "
            f"tool calls; {sum(it.optimizer_steps for it in its)} optimizer steps",
            f"time: sampling {_duration(sample)}, weight sync {_duration(sync)}, training "
            f"{_duration(train)}, other {_duration(other)}; {summary.wall_seconds / max(leaves, 1):.1f} s "
            "per leaf",
            *held_out_lines(summary.held_out),
        ]
    )


def held_out_lines(curve: tuple[tuple[int, EvalResult], ...]) -> list[str]:
    """The learning curve: pass@1 and pass@k ± their standard errors after 0, k, 2k, ... iterations,
    and the change of pass@1 since the first point with its paired standard error."""
    if not curve:
        return []
    first = curve[0][1]
    how = "greedy" if first.temperature == 0 else f"temperature {first.temperature:g}"
    lines = [
        f"held-out pass@1 ± SE ({len(first.task_ids)} tasks x {first.samples} episodes, {how}): "
        + ", ".join(f"{_pm(r.pass_at_1, r.pass_at_1_se)} after {t}" for t, r in curve)
    ]
    if first.k > 1:
        lines.append(
            f"held-out pass@{first.k} ± SE: "
            + ", ".join(f"{_pm(r.pass_at_k, r.pass_at_k_se)} after {t}" for t, r in curve)
        )
    if len(curve) > 1:
        change, se = paired_change(first, curve[-1][1])
        lines.append(f"pass@1 change since the start (paired by task): {_pm(change, se, sign=True)}")
    start, last = first.by_group(), curve[-1][1].by_group()
    if start:  # the tasks carry attributes: which groups the policy gained or traded
        lines.append(
            "held-out pass@1 by group, start -> last: "
            + ", ".join(
                f"{g} ({n} tasks) {p:.2f} -> {last[g][0]:.2f}" for g, (p, _, n) in start.items() if g in last
            )
        )
    return lines


def _pm(value: float, se: float, sign: bool = False) -> str:
    text = f"{value:+.2f}" if sign else f"{value:.2f}"
    return text if not math.isfinite(se) else f"{text} ± {se:.2f}"


_PHASES = ("sample_seconds", "sync_seconds", "train_seconds")


def _row(it: IterationSummary) -> str:
    mixed = f"{it.mixed_roots} / {it.mixed_prefixes}"
    return (
        f"  {it.iteration:>4}  {it.success_rate:>7.2f}  {it.effective_ratio:>9.2f}  {mixed:>17}  "
        f"{it.leaves:>6}  {it.tokens:>7,}  {it.turns_mean:>5.2f}  {it.optimizer_steps:>5}  "
        f"{it.sample_seconds:>8.1f}  "
        f"{it.train_seconds:>7.1f}"
    )


def _mean(its: tuple[IterationSummary, ...], name: str) -> float:
    return sum(getattr(it, name) for it in its) / len(its)


def _duration(seconds: float) -> str:
    """`42.0 s`, or `3 min 05 s` from a minute on."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


class RunSummary(Callback):
    """Collects each iteration's `IterationSummary` and prints the summary when `fit` ends; with
    `record_path` (conf/callbacks: `<run_dir>/summary.json`) also writes it there (`summary_record`)."""

    def __init__(self, record_path: str | Path | None = None) -> None:
        self.record_path = None if record_path is None else Path(record_path)
        self.rows: list[IterationSummary] = []
        self._fit_start = self._epoch_start = 0.0
        self._report: IterationReport | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        quiet_known_warnings(trainer.world_size)  # as the progress bar does, for runs without one

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.rows, self._fit_start = [], time.perf_counter()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = latest_report(trainer)
        # On resume the first epoch re-serves an iteration already trained on: not a new row.
        fresh = report is not None and all(r.iteration != report.iteration for r in self.rows)
        self._report, self._epoch_start = (report if fresh else None), time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._report is not None:
            self.rows.append(iteration_summary(self._report, time.perf_counter() - self._epoch_start))

    def summary(self, held_out: tuple[tuple[int, EvalResult], ...] = ()) -> FitSummary:
        return FitSummary(tuple(self.rows), time.perf_counter() - self._fit_start, held_out)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            curves = [c.history for c in trainer.callbacks if isinstance(c, HeldOutSuccess)]  # type: ignore[attr-defined]
            summary = self.summary(tuple(curves[0]) if curves else ())
            print("\n" + summary_text(summary))
            if self.record_path is not None:
                probes = [c.history for c in trainer.callbacks if isinstance(c, SuccessProbe)]  # type: ignore[attr-defined]
                record = summary_record(summary, probes[0] if probes else ())
                self.record_path.parent.mkdir(parents=True, exist_ok=True)
                self.record_path.write_text(json.dumps(record, indent=1) + "\n")


def summary_record(summary: FitSummary, probe: Sequence[tuple[int, dict[str, float]]] = ()) -> dict[str, Any]:
    """The summary as plain values: every iteration's row, the wall time, the held-out curve with its
    paired change since the start (`change`, `change_se`) and the largest SE of a point, and the
    predictor probe's metrics where `callbacks.SuccessProbe` ran (`callbacks=probe`)."""
    record: dict[str, Any] = {
        "wall_seconds": summary.wall_seconds,
        "iterations": [dataclasses.asdict(it) for it in summary.iterations],
    }
    if probe:
        record["probe"] = [{"iteration": i, **metrics} for i, metrics in probe]
    if summary.held_out:
        first, last = summary.held_out[0][1], summary.held_out[-1][1]
        change, change_se = paired_change(first, last)
        record["held_out"] = {
            "tasks": len(first.task_ids),
            "samples": first.samples,
            "temperature": first.temperature,
            "curve": [
                {
                    "iterations": t,
                    "pass_at_1": r.pass_at_1,
                    "pass_at_1_se": r.pass_at_1_se,
                    "turns": r.turns,
                    **({"by_group": {g: p for g, (p, _, _) in r.by_group().items()}} if r.groups else {}),
                }
                for t, r in summary.held_out
            ],
            "start": first.pass_at_1,
            "final": last.pass_at_1,
            "change": change,
            "change_se": change_se,
            "point_se_max": max(r.pass_at_1_se for _, r in summary.held_out),
            # the last evaluation per task, so two runs on the same tasks compare paired by task
            "final_task_ids": list(last.task_ids),
            "final_successes": list(last.successes),
        }
    return record


# --------------------------------------------------------------------------- the progress bar


class IterationProgress(ProgressBar):
    """One bar per iteration: episodes finished while sampling, then training steps.

    The DataModule samples inside `train_dataloader()`, before any training hook of the epoch runs,
    so the bar registers itself as the DataModule's `progress` (a `data.EpisodeProgress`) and learns
    of each finished episode through `episode_done`; the held-out evaluation counts on `episode_bar`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled, self._sampled, self._loss = True, 0, "-"
        self._bar: Any = None  # the tqdm bar of the iteration in progress

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # disables the bar on every process but the first
        quiet_known_warnings(trainer.world_size)
        if (data := RolloutDataModule.of(trainer)) is not None:
            data.progress = self

    def episode_done(self) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            # With several processes each samples its share of the budget: no total to count towards.
            data = RolloutDataModule.of(self.trainer)
            total = data.budget.leaves if data is not None and self.trainer.world_size == 1 else None
            self._bar = self._open(f"iteration {self.trainer.current_epoch}: sampling", total, "episode")
        self._bar.update(1)
        self._sampled = self._bar.n

    def episode_bar(self, description: str, total: int) -> Any:
        """A bar for another loop of episodes (the held-out evaluation), or None while disabled."""
        return self._open(description, total, "episode") if self._enabled else None

    def _open(self, description: str, total: int | float | None, unit: str) -> Any:
        return tqdm(total=total, desc=description, unit=unit, leave=True, dynamic_ncols=True)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._enabled:
            return
        description = f"iteration {trainer.current_epoch}: {self._sampled} episodes sampled, training"
        if self._bar is None:
            self._bar = self._open(description, self.total_train_batches, "step")
        else:
            self._bar.set_description(description, refresh=False)
            self._bar.unit = "step"
            self._bar.reset(total=self.total_train_batches)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._enabled and self._bar is not None:
            self._bar.update(1)
            loss = trainer.callback_metrics.get("train/loss")
            if loss is not None:
                self._loss = f"{float(loss):.4f}"
                self._bar.set_postfix(loss=self._loss, refresh=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._bar is None:
            return
        report = latest_report(trainer)
        if report is not None and report.iteration == trainer.current_epoch:
            row = iteration_summary(report, 0.0)
            self._bar.set_postfix(
                loss=self._loss, success=f"{row.success_rate:.2f}", effective=f"{row.effective_ratio:.2f}"
            )
        self._bar.close()
        self._bar, self._sampled, self._loss = None, 0, "-"

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._bar is not None:  # a fit stopped mid-iteration
            self._bar.close()
            self._bar = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        tqdm.write(" ".join(str(a) for a in args))


class FitProgress(ProgressBar):
    """One bar for a whole supervised fit (the warm start): optimizer steps over all epochs, with the
    latest `loss_key` value."""

    def __init__(self, description: str = "fit", loss_key: str = "loss") -> None:
        super().__init__()
        self.description, self.loss_key = description, loss_key
        self._enabled, self._bar = True, None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        quiet_known_warnings(trainer.world_size)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled:
            total = trainer.num_training_batches * (trainer.max_epochs or 1)
            self._bar = tqdm(total=total, desc=self.description, unit="step", dynamic_ncols=True)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bar is not None:
            self._bar.update(1)
            loss = trainer.callback_metrics.get(self.loss_key)
            epoch = f"{trainer.current_epoch + 1}/{trainer.max_epochs}"
            self._bar.set_postfix(epoch=epoch, **({} if loss is None else {"loss": f"{float(loss):.4f}"}))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        tqdm.write(" ".join(str(a) for a in args))
