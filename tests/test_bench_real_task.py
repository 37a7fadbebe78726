"""The real-task comparison's arithmetic (benchmarks/real_task.py) on hand-built run records: each figure
worked out by hand from the records, never by the code under test."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_task  # noqa: E402


def run(final, successes, iterations):
    """A run record as the trainer's summary.json holds it (the fields the report reads)."""
    return {
        "trainer_seconds": 10.0,
        "held_out": {
            "samples": 1,
            "start": 0.2,
            "final": final,
            "curve": [
                {"iterations": 0, "pass_at_1": 0.2, "pass_at_1_se": 0.1},
                {"iterations": 2, "pass_at_1": final, "pass_at_1_se": 0.1, "by_group": {"steps=1": 1.0}},
            ],
            "final_task_ids": [10, 11, 12, 13],
            "final_successes": successes,
        },
        "iterations": iterations,
    }


def iteration(tokens, expand, mixed_roots, mixed_prefixes, prompts=4, steps=2):
    return {
        "tokens": tokens,
        "expand_tokens": expand,
        "mixed_roots": mixed_roots,
        "mixed_prefixes": mixed_prefixes,
        "leaves": 8,
        "optimizer_steps": steps,
        "effective_ratio": mixed_roots / prompts,
        "prompts": prompts,
    }


def test_stage_prices_by_hand():
    its = [iteration(100, 20, 2, 1), iteration(50, 0, 1, 0)]
    got = real_task._stage_prices(its)
    # continuations 20 of 150 tokens; 3 mixed roots on 130 root tokens; 1 mixed prefix on 20 expand tokens
    assert got["expand_token_share"] == pytest.approx(20 / 150)
    assert got["mixed_roots_per_1k_root_tokens"] == pytest.approx(3000 / 130)
    assert got["mixed_prefixes_per_1k_expand_tokens"] == pytest.approx(50.0)
    assert real_task._stage_prices([iteration(10, 0, 1, 0)])["mixed_prefixes_per_1k_expand_tokens"] is None
    old = {k: v for k, v in iteration(10, 0, 1, 0).items() if k != "expand_tokens"}  # an older record
    assert real_task._stage_prices([old])["expand_token_share"] is None


def test_methods_are_compared_per_seed_and_paired_by_problem():
    # seed 0: trace solves problems 10, 11, 12; GRPO 10 and 13. Per problem 0, +1, +1, -1: mean +0.25,
    # deviations -0.25, 0.75, 0.75, -1.25 -> squares 0.0625 + 0.5625 + 0.5625 + 1.5625 = 2.75, sample
    # variance 2.75 / 3, SE = sqrt(2.75 / 3 / 4) = 0.4787
    runs = {
        "trace": {"0": run(0.75, [1, 1, 1, 0], [iteration(100, 30, 2, 1), iteration(90, 10, 1, 0)])},
        "grpo": {"0": run(0.5, [1, 0, 0, 1], [iteration(100, 0, 1, 0), iteration(95, 0, 1, 0)])},
    }
    args = type("Args", (), {"tokens": 100, "max_leaves": 96, "extra": []})()
    spec = {"env": [], "warm_start": "w", "room": True}
    report = real_task.task_report(spec, runs, [0], args)
    trace, grpo = report["methods"]["trace"], report["methods"]["grpo"]
    assert trace["tokens_per_seed"] == [190] and grpo["tokens_per_seed"] == [195]
    assert trace["optimizer_steps_per_seed"] == [4]
    assert trace["mixed_share"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert trace["by_group_start_final_per_seed"] == [[None, {"steps=1": 1.0}]]
    versus = report["versus_grpo"]["trace"]
    assert versus["final_diff_per_seed"] == [pytest.approx(0.25)] and versus["seeds_above"] == 1
    paired = versus["final_diff_paired_by_problem_per_seed"][0]
    assert paired["diff"] == pytest.approx(0.25) and paired["se"] == pytest.approx(0.4787, abs=1e-4)
    assert versus["mixed_share_ratio"] == pytest.approx(0.375 / 0.25)


def test_reseeded_grpo_differs_from_grpo_only_in_its_training_seed(tmp_path, monkeypatch):
    """`grpo_reseeded`, the noise floor, runs GRPO's command on another training seed (1000 + the run's):
    the same warm start, problems, held-out split, budget and allocator."""
    commands = {}

    def fake_train(overrides, run_dir, keep=None):
        commands[run_dir.name] = overrides
        return run(0.5, [1, 0, 0, 1], [iteration(100, 0, 1, 0)])

    monkeypatch.setattr(real_task, "train", fake_train)
    monkeypatch.setattr(real_task, "ensure_warm_start", lambda *a: None)
    monkeypatch.setattr(real_task, "RUNS", tmp_path / "runs")
    args = real_task.argparse.Namespace(
        seeds="2",
        tasks="control",
        methods="grpo,grpo_reseeded",
        out=str(tmp_path / "report.json"),
        tokens=1500,
        max_leaves=96,
        probe=0,
        extra=[],
        work=str(tmp_path / "work"),
        only=None,
    )
    real_task.compare(args)
    grpo, reseeded = commands["control_grpo_seed2"], commands["control_grpo_reseeded_seed2"]
    assert grpo[-1] == "advantage=grpo" and reseeded[-1] == "advantage=grpo" and "seed=1002" in reseeded
    assert "seed=2" in grpo and "env.seed=0" in reseeded and "data.split_seed=0" in reseeded
    assert ["seed=2" if o == "seed=1002" else o for o in reseeded] == grpo  # only the seed differs
