"""Logging callbacks: they read what an iteration built and log it; compute code never logs.

Each callback pairs a pure function (report -> dict of floats, tested on hand-built trees) with a
thin Lightning hook. Lightning calls `train_dataloader()` before `on_train_epoch_start`, so in that
hook `datamodule.report` describes the iteration the coming epoch trains on. Keys are `area/name`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from torchmetrics.functional.classification import binary_auroc, binary_calibration_error

from trace_lightning import gauges
from trace_lightning.budget import BudgetError, BudgetLedger
from trace_lightning.collector import IterationReport
from trace_lightning.engines.base import EngineStats
from trace_lightning.evaluation import EvalResult, EvalSettings, paired_change
from trace_lightning.plots import draw_tree
from trace_lightning.tree import SUCCESS, RolloutTree, TreeStats, backup, tree_stats


def _mean(values: Any) -> float:
    return float(np.mean(values)) if len(values) else 0.0


# --------------------------------------------------------------------------- rollout statistics


def rollout_metrics(report: IterationReport) -> dict[str, float]:
    """Everything `RolloutStats` logs for one iteration, except the running sums."""
    stats = [tree_stats(t, SUCCESS) for t in report.result.trees]
    return (
        _rollout_part(report, stats)
        | _budget_part(report.result.ledger, report.engine_stats)
        | {"budget/tool_calls": float(report.counters.tool_calls)}
        | {
            "train/optimizer_steps": float(report.optimizer_steps),
            "train/micro_batches_per_step": float(report.micro_batches_per_step),
        }
        | _tree_part(stats)
        | _engine_part(report)
        | _flip_part(report)
    )


def _flip_part(report: IterationReport) -> dict[str, float]:
    """Priced Stage 2: continuations and flips by the depth of their start prefix."""
    if report.flips is None:
        return {}
    out = {f"tree/continuations_depth_{d}": float(n) for d, n in enumerate(report.flips.continuations)}
    return out | {f"tree/flips_depth_{d}": float(n) for d, n in enumerate(report.flips.flips)}


def _engine_part(report: IterationReport) -> dict[str, float]:
    """Engine health: weight-sync time, and engine vs trainer log-probs on the same tokens (near 0 when
    the engine samples from the trained weights; a stale engine shows up here first)."""
    out = {"engine/sync_seconds": report.sync_seconds, "rollout/sample_seconds": report.sample_seconds}
    if math.isfinite(report.logprob_mismatch):
        out["engine/logprob_mismatch"] = report.logprob_mismatch
        out["engine/logprob_mismatch_max"] = report.logprob_mismatch_max
    return out


def _rollout_part(report: IterationReport, stats: list[TreeStats]) -> dict[str, float]:
    """Outcomes and contrast. Per-leaf rates divide by all leaves, so allocators that spend the same
    budget compare directly (docs/algorithm.md#metrics)."""
    leaves = [(t, leaf) for t in report.result.trees for leaf in t.leaves()]
    per_leaf = 1.0 / max(len(leaves), 1)
    mixed_prefixes = sum(sum(s.mixed_by_depth[1:]) for s in stats)
    c = report.counters
    out = {
        "rollout/prompts": float(len(stats)),
        "rollout/effective_ratio": _mean([s.mixed for s in stats]),
        "rollout/success_rate": _mean([_won(t, leaf) for t, leaf in leaves]),
        "rollout/mixed_root_per_100_leaves": 100 * per_leaf * sum(s.mixed for s in stats),
        "rollout/mixed_prefix_per_100_leaves": 100 * per_leaf * mixed_prefixes,
        "rollout/contrastive_pairs_per_leaf": per_leaf * sum(s.contrastive_pairs for s in stats),
        "rollout/prefix_pairs_per_leaf": per_leaf * sum(s.prefix_contrastive_pairs for s in stats),
        "rollout/response_tokens_mean": _mean([_generated(t, leaf) for t, leaf in leaves]),
        "rollout/turns_mean": _mean([t.nodes[leaf].depth for t, leaf in leaves]),
        "rollout/format_errors": float(c.format_errors),
        "rollout/tool_calls": float(c.tool_calls),
        "rollout/tool_errors": float(c.tool_errors),
        "rollout/env_errors": float(len(c.env_errors)),
        "rollout/env_timeouts": float(c.env_timeouts),
        "rollout/env_invalid": float(len(c.invalid_transitions)),
        "rollout/truncated_observations": float(c.truncated_observations),
        "rollout/budget_bound_turns": float(c.budget_bound_turns),
        "rollout/used_prior": float(report.used_prior),
        "rollout/gate_open": float(report.steered),
    }
    out |= {f"rollout/stop/{_key_safe(r)}": float(n) for r, n in sorted(c.stop_reasons.items())}
    return out


def _key_safe(name: str) -> str:
    """Stop reasons come from the environment. The runner normalises them where they enter
    (`runner.stop_reason_key`, the same rule); this keeps any other path to a `rollout/stop/` key within
    what MLflow accepts too (no `//`, no leading or trailing `/`, no `..` segment, at most 250
    characters), since its logger raises mid-run otherwise."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "env_invalid"


def _won(tree: RolloutTree, leaf: int) -> bool:
    return float(tree.nodes[leaf].reward or 0.0) >= SUCCESS


def _generated(tree: RolloutTree, leaf: int) -> int:
    """Tokens the policy generated along a leaf's whole path (shared turns count for every leaf)."""
    return sum(len(tree.nodes[n].action_ids) for n in tree.path(leaf))


def _budget_part(ledger: BudgetLedger, engine: EngineStats | None) -> dict[str, float]:
    out = {"budget/leaves": float(ledger.leaves_used), "budget/leaves_unused": float(ledger.leaves_left())}
    out["budget/leaves_returned"] = float(ledger.returned)
    out |= {f"budget/leaves_{stage}": float(n) for stage, n in ledger.leaves.items()}
    out["budget/tokens"] = float(ledger.tokens_used)
    out |= {f"budget/tokens_{stage}": float(n) for stage, n in ledger.tokens.items()}
    out |= {f"budget/tokens_depth_{d}": float(n) for d, n in sorted(ledger.tokens_by_depth.items())}
    if (tokens_left := ledger.tokens_left()) is not None:
        out["budget/tokens_unused"] = float(tokens_left)
    if engine is not None:
        out["budget/prefill_tokens"] = float(engine.prefill_tokens)
        out["budget/reused_prefill_tokens"] = float(engine.reused_prefill_tokens)
    return out


def _tree_part(stats: list[TreeStats]) -> dict[str, float]:
    """Tree shape; `mixed_depth_<d>` sums mixed nodes at depth d over the trees (0 = mixed roots)."""
    depth_max = max((s.depth for s in stats), default=0)
    out = {
        "tree/leaves_per_prompt": _mean([s.leaves for s in stats]),
        "tree/depth_mean": _mean([s.depth for s in stats]),
        "tree/depth_max": float(depth_max),
        "tree/branching_mean": _mean([s.branching for s in stats]),  # mean over trees
    }
    for d in range(depth_max + 1):
        out[f"tree/mixed_depth_{d}"] = float(
            sum(s.mixed_by_depth[d] for s in stats if d < len(s.mixed_by_depth))
        )
    return out


def _datamodule(trainer: Trainer) -> Any:
    return getattr(trainer, "datamodule", None)  # set by `fit(datamodule=...)`, not declared on Trainer


def _latest_report(trainer: Trainer) -> IterationReport | None:
    return getattr(_datamodule(trainer), "report", None)


# The units a run's cost is counted in: peers hold different ones equal (leaves in
# Tree-GRPO, generated tokens in TreeRL, tool calls in ARPO, device time in TreePO). Each is logged per
# iteration as `budget/<unit>` and cumulatively as `budget/<unit>_cum`; `compare --x <unit>` plots
# against the running total.
BUDGET_UNITS = ("leaves", "tokens", "prefill_tokens", "tool_calls", "seconds")


def budget_spend(report: IterationReport) -> dict[str, float]:
    """What the iteration's rollouts spent: leaves, generated tokens, prefill tokens (this process's
    engine; 0 without engine counters) and tool calls."""
    engine = report.engine_stats
    return {
        "budget/leaves": float(report.result.ledger.leaves_used),
        "budget/tokens": float(report.result.ledger.tokens_used),
        "budget/prefill_tokens": float(engine.prefill_tokens if engine is not None else 0),
        "budget/tool_calls": float(report.counters.tool_calls),
    }


def budget_seconds(report: IterationReport, train_seconds: float) -> dict[str, float]:
    """The iteration's wall seconds, and by phase.

    `seconds` runs from the start of the iteration's sampling to its last optimizer step: `sample` is
    tree building (scoring, allocation, generation, tool calls), `sync` the engine's weight sync, `train`
    the optimizer steps, and `other` the rest of the collection (predictor refit, advantages, the old
    log-prob pass). Held-out evaluation and checkpoint writing are not counted (see `eval/seconds`)."""
    sample, sync = report.sample_seconds, report.sync_seconds
    return {
        "budget/seconds": report.collect_seconds + train_seconds,
        "budget/seconds_sample": sample,
        "budget/seconds_sync": sync,
        "budget/seconds_train": train_seconds,
        "budget/seconds_other": max(report.collect_seconds - sample - sync, 0.0),
    }


def budget_row(report: IterationReport, train_seconds: float) -> dict[str, float]:
    """The same units keyed by plain name (`leaves`, ..., `tool_calls`, `seconds`, `seconds_train`):
    the rows the benchmarks' JSON carry."""
    units = budget_spend(report) | budget_seconds(report, train_seconds)
    return {key.removeprefix("budget/"): value for key, value in units.items()}


def running_sums(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with `<unit>_cum` added for every budget unit it carries (rows in iteration order)."""
    totals: dict[str, float] = {}
    out = []
    for row in rows:
        units = [k for k in row if k in BUDGET_UNITS or k.startswith("seconds_")]
        totals |= {k: totals.get(k, 0.0) + float(row[k]) for k in units}
        out.append(row | {f"{k}_cum": totals[k] for k in units})
    return out


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
        report = _latest_report(trainer)
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
        collector = getattr(_datamodule(trainer), "collector", None)
        if collector is None or any(done == trained for done, _ in self.history):
            return
        episodes = len(collector.eval_tasks(self.settings.tasks)) * self.settings.samples
        bar = _episode_bar(trainer, f"evaluation after {trained} iterations", episodes)
        try:
            result = collector.evaluate(
                pl_module, self.settings, None if bar is None else lambda: bar.update(1)
            )
        finally:
            if bar is not None:
                bar.close()
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


def _episode_bar(trainer: Trainer, description: str, total: int) -> Any:
    """A progress bar from the run's progress display when it offers one (`console.IterationProgress`,
    only while enabled and with something to count), else None."""
    open_bar = getattr(trainer.progress_bar_callback, "episode_bar", None)
    return open_bar(description, total) if open_bar is not None and total > 0 else None


def _eval_result(fields: dict[str, Any]) -> EvalResult:
    return EvalResult(
        **{**fields, "task_ids": tuple(fields["task_ids"]), "successes": tuple(fields["successes"])}
    )


# --------------------------------------------------------------------------- Monte Carlo probe


def probe_metrics(
    predicted: np.ndarray,
    root_counts: np.ndarray,
    half_a: np.ndarray,
    half_b: np.ndarray,
    half: int,
    cap: int,
) -> dict[str, float]:
    """How the predictor's raw root predictions [P] over a pool compare with a Monte Carlo probe of the
    same pool: `half_a` and `half_b` [P] are successes in two independent halves of `half` episodes each.

    The ceiling `probe/expected_mixed_true_v` allocates the iteration's bare rollouts by the exact V_root
    program on half A's rates and is evaluated on half B alone (chosen and scored on the same episodes
    it would be biased upwards); the others are scored on all 2 * half episodes (`predictor/gauges.py`).
    """
    k, n = half_a + half_b, np.full(len(half_a), 2 * half)
    v = k / n
    n_roots = int(root_counts.sum())
    try:  # the ceiling allocates the same bare rollouts at most min(cap, half) per candidate
        true_v = gauges.true_v_allocation(half_a, np.full(len(half_a), half), n_roots, min(cap, half))
        ceiling = gauges.expected_mixed(true_v, half_b, np.full(len(half_b), half))
    except BudgetError:  # e.g. an odd count under budget.unit=tokens with groups of exactly 2: no ceiling
        ceiling = math.nan
    return {
        "probe/spearman": gauges.spearman(predicted, v),
        "probe/spearman_contrast": gauges.spearman(predicted * (1 - predicted), v * (1 - v)),
        "probe/spearman_ceiling": gauges.noise_ceiling(half_a, half_b),  # what knowing V would reach
        "probe/brier": gauges.brier(predicted, k, n),
        "probe/base_rate_brier": gauges.base_rate_brier(k, n),
        "probe/mean_success": float(v.mean()),
        "probe/expected_mixed": gauges.expected_mixed(root_counts, k, n),
        "probe/expected_mixed_random": gauges.expected_mixed_random_pairs(n_roots, k, n),
        "probe/expected_mixed_true_v": ceiling,
    }


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
        # (iteration, candidate task ids, raw root predictions, half A's and half B's successes)
        self.rates: list[tuple[int, list[int], np.ndarray, np.ndarray, np.ndarray]] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report, collector = _latest_report(trainer), getattr(_datamodule(trainer), "collector", None)
        if report is None or collector is None or report.pool_ids is None:
            return
        if report.iteration % self.every_n_epochs or report.used_prior:
            return
        seed = self.seed + 2 * report.iteration
        a = collector.probe(pl_module, report.pool_ids, self.half, seed)
        b = collector.probe(pl_module, report.pool_ids, self.half, seed + 1)
        counts = report.result.root_counts
        metrics = probe_metrics(report.result.pool_predicted, counts, a, b, self.half, self.max_per_prompt)
        self.history.append((report.iteration, metrics))
        self.rates.append((report.iteration, list(report.pool_ids), report.result.pool_predicted, a, b))
        for logger in trainer.loggers:
            logger.log_metrics(
                {k: v for k, v in metrics.items() if math.isfinite(v)}, step=trainer.global_step
            )


# --------------------------------------------------------------------------- predictor calibration


def calibration_samples(trees: list[RolloutTree]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(predicted p, realised 0/1 outcome) pairs for scored roots and scored prefixes.

    Only bare rollouts give labels: a prompt's bare rollouts are independent draws of V(prompt), and
    each scored prefix lies on exactly one bare rollout, whose outcome is one draw of V(prefix).
    Continuations are left out on purpose: Stage 2 picks their prefixes from these very outcomes
    and predictions, so they are not an unbiased sample. A root with m bare rollouts gives m pairs.
    """
    pairs: dict[str, list[tuple[float, float]]] = {"root": [], "prefix": []}
    for tree in trees:
        for leaf in tree.leaves():
            if tree.nodes[leaf].stage != "bare":
                continue
            label = float(_won(tree, leaf))
            for n in [0, *tree.path(leaf)[:-1]]:
                if (p := tree.nodes[n].predicted) is not None:
                    pairs["root" if n == 0 else "prefix"].append((p, label))
    return {k: (np.array([p for p, _ in v]), np.array([y for _, y in v])) for k, v in pairs.items()}


def binary_scores(prefix: str, p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Brier, ECE (10 bins), AUROC (only when both outcomes occur) and the two means."""
    if len(p) == 0:
        return {}
    preds, target = torch.as_tensor(p, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
    out = {
        f"{prefix}samples": float(len(p)),
        f"{prefix}brier": float(np.mean((p - y) ** 2)),
        f"{prefix}ece": float(binary_calibration_error(preds, target, n_bins=10)),
        f"{prefix}mean_predicted": float(p.mean()),
        f"{prefix}mean_realised": float(y.mean()),
    }
    if 0 < y.sum() < len(y):
        out[f"{prefix}auroc"] = float(binary_auroc(preds, target))
    return out


def value_errors(trees: list[RolloutTree]) -> np.ndarray:
    """(p - V̂)^2 per scored node with a leaf below: the error against the predictor's own target."""
    errors = []
    for tree in trees:
        value = backup(tree, SUCCESS).value
        errors += [
            (n.predicted - value[n.id]) ** 2
            for n in tree.nodes
            if n.predicted is not None and np.isfinite(value[n.id])
        ]
    return np.array(errors)


def calibration_metrics(report: IterationReport) -> dict[str, float]:
    """`predictor/*` over the active trees; `predictor/source` is 0 for the cold-start prior, 1 the head."""
    samples = calibration_samples(report.result.trees)
    p = np.concatenate([samples["root"][0], samples["prefix"][0]])
    y = np.concatenate([samples["root"][1], samples["prefix"][1]])
    out = {"predictor/source": 0.0 if report.used_prior else 1.0}
    out |= binary_scores("predictor/", p, y)
    out |= binary_scores("predictor/root_", *samples["root"])
    out |= binary_scores("predictor/prefix_", *samples["prefix"])
    if len(errors := value_errors(report.result.trees)):
        out["predictor/value_mse"] = float(errors.mean())
    if (q := report.root_quality) is not None:  # Stage 1's inputs: spread, skill, gate
        out["predictor/pool_spread"] = q.pool_spread
        out["predictor/gate"] = float(q.gate_open)
        out |= {
            k: v
            for k, v in [("predictor/slice_skill", q.slice_skill), ("predictor/gate_skill", q.gate_skill)]
            if math.isfinite(v)
        }
    if math.isfinite(report.refit_loss):
        out["predictor/refit_loss"] = report.refit_loss
    return out


class PredictorCalibration(Callback):
    """Logs how well the allocation's success estimates matched what the rollouts then did."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (report := _latest_report(trainer)) is not None:
            pl_module.log_dict(
                calibration_metrics(report), on_step=False, on_epoch=True, batch_size=1, sync_dist=True
            )


# --------------------------------------------------------------------------- artifacts


def iteration_record(report: IterationReport) -> dict[str, Any]:
    """Everything needed to redraw or re-score the iteration later, as plain JSON."""
    res = report.result
    ledger = {"budget": vars(res.ledger.budget), "leaves": res.ledger.leaves, "tokens": res.ledger.tokens}
    ledger["tokens_by_depth"] = {str(d): n for d, n in sorted(res.ledger.tokens_by_depth.items())}
    return {
        "iteration": report.iteration,
        "used_prior": report.used_prior,
        "task_ids": [t.task_id for t in res.trees],
        "pool_predicted": res.pool_predicted.tolist(),
        "root_counts": res.root_counts.tolist(),
        "ledger": ledger,
        "trees": [t.to_dict() for t in res.trees],
    }


def tree_to_draw(trees: list[RolloutTree]) -> RolloutTree:
    """The mixed tree with the most leaves (the first on ties), else the tree with the most leaves."""
    mixed = [t for t in trees if backup(t, SUCCESS).mixed[0]]
    return max(mixed or trees, key=lambda t: len(t.leaves()))


def samples_markdown(trees: list[RolloutTree], tokenizer: Any, n: int = 4, chars: int = 300) -> str:
    """A table of the first bare rollout of the first `n` trees, response text cut to `chars`."""
    rows = ["| task | reward | stop | response |", "|---|---|---|---|"]
    for tree in [t for t in trees if t.leaves()][:n]:
        leaf = tree.nodes[min(tree.leaves())]
        text = tokenizer.decode(tree.token_ids(leaf.id)[len(tree.prompt_ids) :], skip_special_tokens=True)
        text = text[:chars].replace("|", "\\|").replace("\n", "<br>")
        rows.append(f"| {tree.task_id} | {leaf.reward:.2f} | {leaf.stop_reason} | {text} |")
    return "\n".join(rows) + "\n"


def write_artifacts(report: IterationReport, out_dir: Path, tokenizer: Any) -> list[tuple[str, Path]]:
    """Write the iteration's tree JSON, one tree drawing and the sample table; (folder, path) each."""
    stem = f"iteration_{report.iteration:04d}"
    (out_dir / "trees").mkdir(parents=True, exist_ok=True)
    (out_dir / "samples").mkdir(parents=True, exist_ok=True)
    record = out_dir / "trees" / f"{stem}.json"
    record.write_text(json.dumps(iteration_record(report)))
    out = [("trees", record)]
    if report.result.trees:
        out.append(("trees", draw_tree(tree_to_draw(report.result.trees), out_dir / "trees" / f"{stem}.png")))
        table = out_dir / "samples" / f"{stem}.md"
        table.write_text(samples_markdown(report.result.trees, tokenizer))
        out.append(("samples", table))
    return out


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
        report = _latest_report(trainer)
        if report is None or not trainer.is_global_zero or trainer.current_epoch % self.every_n_epochs:
            return
        assert self._out_dir is not None, "setup() runs before the first epoch"
        paths = write_artifacts(report, self._out_dir, pl_module.tokenizer)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                for folder, path in paths:
                    logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder)
