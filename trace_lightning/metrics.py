"""Report -> numbers: the arithmetic behind every metric the callbacks log, in one pure room.

Each function turns what an iteration built (a `collector.IterationReport`, its trees, its ledger) or
a probe's counts into a dict of floats keyed `area/name`, and is tested on hand-built trees. Nothing
here logs or imports Lightning: `callbacks.py` logs these dicts, `console.py` summarises them, the
benchmarks write them to JSON, and `compare` reads the budget-unit vocabulary (`BUDGET_UNITS`) without
loading torch.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from trace_lightning import gauges
from trace_lightning.budget import BudgetError, BudgetLedger
from trace_lightning.engines.base import EngineStats
from trace_lightning.tree import SUCCESS, RolloutTree, TreeStats, backup, tree_stats

if TYPE_CHECKING:  # the report is only read here
    from trace_lightning.report import IterationReport


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
    trees = report.result.trees
    leaves = [(t, leaf) for t in trees for leaf in t.leaves()]
    per_leaf = 1.0 / max(len(leaves), 1)
    c = report.counters
    out = {
        "rollout/prompts": float(len(stats)),
        "rollout/effective_ratio": effective_ratio(stats),
        "rollout/success_rate": success_rate(trees),
        "rollout/mixed_root_per_100_leaves": 100 * per_leaf * mixed_roots(stats),
        "rollout/mixed_prefix_per_100_leaves": 100 * per_leaf * mixed_prefixes(stats),
        "rollout/contrastive_pairs_per_leaf": per_leaf * sum(s.contrastive_pairs for s in stats),
        "rollout/prefix_pairs_per_leaf": per_leaf * sum(s.prefix_contrastive_pairs for s in stats),
        "rollout/response_tokens_mean": _mean([_generated(t, leaf) for t, leaf in leaves]),
        "rollout/turns_mean": turns_mean(trees),
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


def won(tree: RolloutTree, leaf: int) -> bool:
    """The leaf's episode succeeded (reward >= `tree.SUCCESS`; an unscored leaf counts as a failure)."""
    return float(tree.nodes[leaf].reward or 0.0) >= SUCCESS


# The shares the console's summary shows and `rollout/*` logs: one definition for both.


def success_rate(trees: list[RolloutTree]) -> float:
    """The share of leaves that won (0 without leaves)."""
    return _mean([won(t, leaf) for t in trees for leaf in t.leaves()])


def turns_mean(trees: list[RolloutTree]) -> float:
    """Turns per episode: the mean leaf depth (0 without leaves)."""
    return _mean([t.nodes[leaf].depth for t in trees for leaf in t.leaves()])


def effective_ratio(stats: list[TreeStats]) -> float:
    """The share of prompts whose tree has both outcomes (0 without trees)."""
    return _mean([s.mixed for s in stats])


def mixed_roots(stats: list[TreeStats]) -> int:
    """Trees whose root is mixed."""
    return sum(int(s.mixed) for s in stats)


def mixed_prefixes(stats: list[TreeStats]) -> int:
    """Mixed nodes at depth >= 1: contrast only Stage 2 can create."""
    return sum(sum(s.mixed_by_depth[1:]) for s in stats)


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
            label = float(won(tree, leaf))
            for n in [0, *tree.path(leaf)[:-1]]:
                if (p := tree.nodes[n].predicted) is not None:
                    pairs["root" if n == 0 else "prefix"].append((p, label))
    return {k: (np.array([p for p, _ in v]), np.array([y for _, y in v])) for k, v in pairs.items()}


def binary_scores(prefix: str, p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Brier, ECE (10 bins), AUROC (only when both outcomes occur) and the two means."""
    if len(p) == 0:
        return {}
    # torch only here: importing this module stays light for readers of the unit vocabulary (compare)
    import torch
    from torchmetrics.functional.classification import binary_auroc, binary_calibration_error

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
