"""Logging callbacks: pure metric functions on hand-built trees, the tree drawing, and one Lightning
fit that logs everything to a throwaway MLflow store."""

import functools
import json
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import quiet_trainer, rollout_data, trace_module
from lightning.pytorch.loggers import MLFlowLogger

from trace_lightning import allocation as alloc
from trace_lightning.artifacts import samples_markdown, tree_to_draw, write_artifacts
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.callbacks import PredictorCalibration, RolloutStats, TreeArtifacts
from trace_lightning.engines.base import EngineStats
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.iteration import Iteration
from trace_lightning.metrics import (
    BUDGET_UNITS,
    binary_scores,
    budget_seconds,
    budget_spend,
    calibration_metrics,
    rollout_metrics,
)
from trace_lightning.plots import COLOURS, draw_tree, layout, outcome_colours
from trace_lightning.report import IterationReport
from trace_lightning.runner import RolloutCounters
from trace_lightning.tree import RolloutTree

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mixed_tree() -> RolloutTree:
    """Task 1: bare 1 -> 2 (win), bare 3 (loss), continuation 4 from prefix 1 (loss).

        0 (p=0.6)
       /        \\
      1 (p=0.8)  3: r=0, 4 tokens
     /   \\
    2     4 (expand)
    r=1   r=0
    """
    t = RolloutTree(task_id=1, prompt_ids=[100, 101])
    t.root.predicted = 0.6
    a = t.add_turn(0, "bare", [1, 2, 3], [9])
    t.finish(t.add_turn(a, "bare", [4, 5], []), 1.0, "answer")
    t.finish(t.add_turn(0, "bare", [6, 7, 8, 9], []), 0.0, "answer")
    t.finish(t.add_turn(a, "expand", [10], []), 0.0, "turn_cap")
    t.nodes[a].predicted = 0.8
    return t


def failed_tree() -> RolloutTree:
    """Task 2: two one-turn bare rollouts, both lost, 2 tokens each; root p = 0.3."""
    t = RolloutTree(task_id=2, prompt_ids=[100])
    t.root.predicted = 0.3
    for _ in range(2):
        t.finish(t.add_turn(0, "bare", [11, 12], []), 0.0, "turn_cap")
    return t


def make_report(
    iteration: int = 0, used_prior: bool = False, engine_stats: EngineStats | None = None
) -> IterationReport:
    ledger = BudgetLedger(Budget(leaves=6))
    ledger.reserve_leaves(4, "bare")
    ledger.reserve_leaves(1, "expand")
    for n, stage, depth in [(3, "bare", 1), (2, "bare", 2), (4, "bare", 1), (4, "bare", 1), (1, "expand", 2)]:
        ledger.charge_tokens(n, stage, depth)  # the action tokens of the two trees, turn by turn
    counters = RolloutCounters(Counter(answer=2, turn_cap=3), 6, 1, 3, 0, ["RuntimeError: boom"])
    result = Iteration([mixed_tree(), failed_tree()], ledger, np.array([0.6, 0.3, 0.9]), np.array([2, 2, 0]))
    return IterationReport(
        iteration, result, counters, used_prior, policy_fingerprint=0.0, engine_stats=engine_stats
    )


def test_rollout_metrics_on_two_hand_built_trees():
    stats = EngineStats(generated_tokens=14, prefill_tokens=40, reused_prefill_tokens=7)
    m = rollout_metrics(make_report(engine_stats=stats))
    assert m["rollout/prompts"] == 2
    assert m["rollout/effective_ratio"] == 0.5  # tree 1 mixed, tree 2 all failures
    assert m["rollout/success_rate"] == pytest.approx(1 / 5)  # one win among five leaves
    assert m["rollout/mixed_root_per_100_leaves"] == pytest.approx(20.0)  # 1 mixed root / 5 leaves
    assert m["rollout/mixed_prefix_per_100_leaves"] == pytest.approx(20.0)  # prefix 1 / 5 leaves
    # opposite-outcome leaf pairs: (2, 3) anchored at the root, (2, 4) at prefix 1
    assert m["rollout/contrastive_pairs_per_leaf"] == pytest.approx(2 / 5)
    assert m["rollout/prefix_pairs_per_leaf"] == pytest.approx(1 / 5)
    assert m["rollout/response_tokens_mean"] == pytest.approx((5 + 4 + 4 + 2 + 2) / 5)  # 3+2, 4, 3+1, 2, 2
    assert m["rollout/turns_mean"] == pytest.approx((2 + 1 + 2 + 1 + 1) / 5)
    assert (m["rollout/format_errors"], m["rollout/tool_calls"], m["rollout/env_errors"]) == (1, 3, 1)
    assert (m["rollout/stop/answer"], m["rollout/stop/turn_cap"], m["rollout/used_prior"]) == (2, 3, 0)
    assert (m["tree/leaves_per_prompt"], m["tree/depth_mean"], m["tree/depth_max"]) == (2.5, 1.5, 2)
    assert m["tree/branching_mean"] == 2.0  # every internal node has two children
    assert (m["tree/mixed_depth_0"], m["tree/mixed_depth_1"], m["tree/mixed_depth_2"]) == (1, 1, 0)


def test_budget_metrics_add_up():
    m = rollout_metrics(make_report(engine_stats=EngineStats(prefill_tokens=40, reused_prefill_tokens=7)))
    assert m["budget/leaves"] == m["budget/leaves_bare"] + m["budget/leaves_expand"] == 5
    assert m["budget/leaves"] + m["budget/leaves_unused"] == 6  # the configured budget
    assert m["budget/tokens"] == m["budget/tokens_bare"] + m["budget/tokens_expand"] == 14
    assert m["budget/tokens"] == m["budget/tokens_depth_1"] + m["budget/tokens_depth_2"]  # 11 + 3
    assert (m["budget/prefill_tokens"], m["budget/reused_prefill_tokens"]) == (40, 7)
    assert "budget/tokens_unused" not in m  # no token cap configured
    assert "budget/prefill_tokens" not in rollout_metrics(make_report())  # no engine, no engine keys


def test_budget_units_of_a_hand_built_report():
    report = make_report(engine_stats=EngineStats(prefill_tokens=40))
    report.sample_seconds, report.sync_seconds, report.collect_seconds = 3.0, 0.5, 5.0
    # the ledger: 5 leaves, 14 tokens; the counters: 3 tool calls; the engine: 40 prefill tokens
    assert budget_spend(report) == {
        "budget/leaves": 5,
        "budget/tokens": 14,
        "budget/prefill_tokens": 40,
        "budget/tool_calls": 3,
    }
    assert rollout_metrics(report)["budget/tool_calls"] == 3  # logged with the iteration's metrics
    # 5 s collecting (3 sampling, 0.5 syncing, so 1.5 other) + 2 s of optimizer steps
    assert budget_seconds(report, train_seconds=2.0) == {
        "budget/seconds": 7.0,
        "budget/seconds_sample": 3.0,
        "budget/seconds_sync": 0.5,
        "budget/seconds_train": 2.0,
        "budget/seconds_other": 1.5,
    }
    assert {f"budget/{unit}" for unit in BUDGET_UNITS} <= set(
        budget_spend(report) | budget_seconds(report, 0)
    )


def test_cumulative_budget_sums_count_each_iteration_once_and_resume():
    stats = RolloutStats()
    first = make_report(iteration=0, engine_stats=EngineStats(prefill_tokens=40))
    first.collect_seconds = 5.0
    stats.units(first, 1.0)
    stats.units(first, 1.0)  # the same iteration seen again: not added twice
    m = stats.units(make_report(iteration=1), 2.0)  # no engine counters: 0 prefill tokens
    assert (m["budget/leaves_cum"], m["budget/tokens_cum"], m["budget/tool_calls_cum"]) == (10, 28, 6)
    assert (m["budget/prefill_tokens_cum"], m["budget/seconds_cum"]) == (40, 5.0 + 1.0 + 0.0 + 2.0)
    assert m["budget/seconds_train_cum"] == 3.0 and m["budget/seconds_train"] == 2.0
    resumed = RolloutStats()
    resumed.load_state_dict(stats.state_dict())
    assert resumed.units(make_report(iteration=2), 0.0)["budget/leaves_cum"] == 15
    old = RolloutStats()  # a checkpoint written before the budget units kept two running sums
    old.load_state_dict({"leaves_cum": 10, "tokens_cum": 28, "last_iteration": 1})
    assert old.units(make_report(iteration=2), 0.0)["budget/tokens_cum"] == 42


def test_calibration_metrics_by_hand():
    m = calibration_metrics(make_report())
    # root pairs, one per bare rollout: (0.6, 1), (0.6, 0), (0.3, 0), (0.3, 0); prefix pair: (0.8, 1)
    # (the continuation 4 is left out: its prefix was chosen from these very outcomes)
    assert m["predictor/root_samples"] == 4 and m["predictor/prefix_samples"] == 1
    assert m["predictor/root_brier"] == pytest.approx((0.16 + 0.36 + 0.09 + 0.09) / 4)  # 0.175
    assert m["predictor/prefix_brier"] == pytest.approx(0.04)
    assert m["predictor/brier"] == pytest.approx((0.70 + 0.04) / 5)
    # ECE: bin of 0.6 holds 2 of 4 with accuracy 0.5 (gap 0.1); bin of 0.3 holds 2 with accuracy 0 (gap 0.3)
    assert m["predictor/root_ece"] == pytest.approx(0.5 * 0.1 + 0.5 * 0.3, abs=1e-6)
    # AUROC: the win at 0.6 beats the two 0.3 losses and ties the 0.6 loss: 2.5 / 3
    assert m["predictor/root_auroc"] == pytest.approx(2.5 / 3)
    assert "predictor/prefix_auroc" not in m  # a single outcome class: AUROC is undefined
    assert m["predictor/mean_predicted"] == pytest.approx(2.6 / 5)
    assert m["predictor/mean_realised"] == pytest.approx(2 / 5)
    # against V̂: root 1 (0.6 vs 1/3), prefix 1 (0.8 vs 1/2), root 2 (0.3 vs 0)
    assert m["predictor/value_mse"] == pytest.approx(((0.6 - 1 / 3) ** 2 + 0.3**2 + 0.3**2) / 3)
    assert m["predictor/source"] == 1.0
    assert calibration_metrics(make_report(used_prior=True))["predictor/source"] == 0.0


def test_binary_scores_skip_empty_input():
    assert binary_scores("p/", np.zeros(0), np.zeros(0)) == {}


def test_layout_spreads_leaves_and_centres_parents():
    xy = layout(mixed_tree())
    # depth-first slots: leaf 2 -> 0, leaf 4 -> 1, leaf 3 -> 2; prefix 1 over (0, 1); root over (0.5, 2)
    assert xy[:, 0].tolist() == [1.25, 0.5, 0.0, 2.0, 1.0]
    assert xy[:, 1].tolist() == [0, -1, -2, -1, -2]


def test_outcome_colours():
    t = mixed_tree()
    t.add_turn(1, "expand", [1], [])  # an unfinished turn under prefix 1: no leaf yet
    got = outcome_colours(t)
    assert got == [COLOURS[k] for k in ("mixed", "mixed", "success", "failure", "failure", "open")]


@pytest.mark.parametrize("make", [mixed_tree, failed_tree])
def test_draw_tree_writes_a_png(tmp_path, make):
    path = draw_tree(make(), tmp_path / "deep" / "tree.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def test_draw_tree_single_leaf(tmp_path):
    t = RolloutTree(task_id=7)
    t.finish(t.add_turn(0, "bare", [1], []), 1.0, "answer")
    assert draw_tree(t, tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "|".join(map(str, ids)) + "\n" + "x" * 500


def test_artifacts_round_trip(tmp_path):
    report = make_report(iteration=3)
    written = write_artifacts(report, tmp_path, FakeTokenizer())
    assert [(folder, p.name) for folder, p in written] == [
        ("trees", "iteration_0003.json"),
        ("trees", "iteration_0003.png"),
        ("samples", "iteration_0003.md"),
    ]
    record = json.loads((tmp_path / "trees" / "iteration_0003.json").read_text())
    assert record["task_ids"] == [1, 2] and record["ledger"]["leaves"] == {"bare": 4, "expand": 1}
    assert RolloutTree.from_dict(record["trees"][0]) == mixed_tree()
    assert tree_to_draw(report.result.trees).task_id == 1  # the mixed one
    table = samples_markdown(report.result.trees, FakeTokenizer()).splitlines()
    assert len(table) == 4  # header, rule, one row per tree
    assert "1\\|2\\|3" in table[2] and "\n" not in table[2] and len(table[2]) < 400  # escaped and cut


def test_fit_logs_metrics_and_artifacts_to_mlflow(tiny_model_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # whatever MLflow writes by default lands in the throwaway folder
    torch.manual_seed(0)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(
        experiment_name="t", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    module = trace_module(tiny_model_dir)
    engine = functools.partial(HFEngine, max_batch_size=16)
    env, allocator = ChainEnv(n_tasks=24, turns=3, seed=0), alloc.trace(expansion=2, max_per_prompt=4)
    data = rollout_data(env, allocator, engine, pool_size=8, max_turns=3, max_episode_tokens=96)
    callbacks = [RolloutStats(), PredictorCalibration(), TreeArtifacts(str(tmp_path / "out"))]
    trainer = quiet_trainer(max_epochs=2, logger=logger, callbacks=callbacks)
    trainer.fit(module, datamodule=data)
    client = MlflowClient(uri)
    history = {
        k: [m.value for m in client.get_metric_history(logger.run_id, k)]
        for k in (
            "rollout/effective_ratio",
            "budget/leaves",
            "budget/leaves_cum",
            "predictor/source",
            "budget/prefill_tokens",
            "budget/prefill_tokens_cum",
            "budget/tool_calls_cum",
            "budget/seconds",
            "budget/seconds_cum",
            "budget/seconds_train",
        )
    }
    assert len(history["rollout/effective_ratio"]) == 2
    assert history["budget/leaves"] == [12, 12] and history["budget/leaves_cum"] == [12, 24]
    prefill = history["budget/prefill_tokens"]
    assert history["budget/prefill_tokens_cum"] == [prefill[0], prefill[0] + prefill[1]]
    assert history["budget/tool_calls_cum"] == [0, 0]  # the chain task has no tool
    seconds = history["budget/seconds"]
    assert all(s > t > 0 for s, t in zip(seconds, history["budget/seconds_train"], strict=True))
    assert history["budget/seconds_cum"] == pytest.approx([seconds[0], seconds[0] + seconds[1]])
    assert history["predictor/source"] == [1.0, 1.0] and all(v > 0 for v in history["budget/prefill_tokens"])
    artifacts = {
        a.path for folder in ("trees", "samples") for a in client.list_artifacts(logger.run_id, folder)
    }
    assert {"trees/iteration_0000.json", "trees/iteration_0000.png", "samples/iteration_0001.md"} <= artifacts
    assert (tmp_path / "out" / "trees" / "iteration_0001.png").stat().st_size > 0
