"""Quick modes of the cost-profile and learning benchmarks, so that the scripts cannot rot.

Each runs the real script in a subprocess (as the README commands do) and checks invariants of what it
measured, never the measured numbers themselves.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generation", "env", "predictor", "allocation", "old_logprobs", "training", "sync")


def run_script(script: str, *args: str, timeout: int = 300) -> str:
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return proc.stdout


def test_cost_profile_quick_mode(tmp_path):
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    stdout = run_script("cost_profile.py", "--quick", "--out", str(out), "--plot", str(png))
    assert "alloc+pred" in stdout and ("PASS" in stdout or "MISS" in stdout)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["sweep"] for r in rows} == {"budget", "expansion", "turns"}
    assert png.stat().st_size > 0
    for r in rows:
        # every named phase was measured, none is negative, and with `other` they are the whole iteration
        assert set(r["seconds"]) == {*PHASES, "other"}
        assert all(r["seconds"][p] >= 0 for p in PHASES)
        assert r["seconds"]["other"] >= -1e-6  # named phases never add up to more than the wall time
        assert math.isclose(sum(r["shares"].values()), 1.0, rel_tol=1e-6)
        assert r["phase_overlaps"] == 0  # no phase was timed inside another
        assert r["seconds"]["generation"] > 0 and r["seconds"]["training"] > 0
        assert r["seconds"]["predictor"] > 0 and r["seconds"]["allocation"] > 0
        assert all(n == 1 for n in r["sync_calls"])  # one weight sync per iteration, after training
        assert r["leaves_per_iteration"] == [r["leaves"]] * r["iterations"]
        assert r["bare_rollouts"] * (1 + r["expansion"]) == r["leaves"]
        assert r["target_met"] == (r["alloc_plus_predictor_share"] < 0.05)


def check_learning(result: dict, expected_leaves: int) -> None:
    config = result["config"]
    assert set(result["summary"]) == set(config["methods"].split(","))
    assert len(result["held_out_before"]["per_task"]) == config["held_out"]
    held_out = set(config["held_out_tasks"])
    for name, s in result["summary"].items():
        # equal leaf budget for every method, every iteration
        assert s["leaves_per_iteration"] == [expected_leaves] * config["iterations"]
        assert 0.0 <= s["effective_ratio"] <= 1.0
        assert 0.0 <= s["held_out_after"] <= 1.0
        assert s["mixed_per_100_leaves"] >= 0 and math.isfinite(s["policy_update_norm"])
        assert s["held_out_before"] == result["held_out_before"]["success"]
        assert result["results"][name]["phase_overlaps"] == 0
        for row in result["results"][name]["iterations"]:
            split = row["phase_seconds"]
            assert all(split[p] >= 0 for p in PHASES) and split["other"] >= -1e-6
            assert math.isclose(sum(split.values()), row["iteration_seconds"], rel_tol=1e-6)
            assert row["loss"] is not None and math.isfinite(row["loss"])
            assert not held_out & set(row["task_ids"])  # held-out tasks are never sampled for training


def test_real_learning_quick_mode(tmp_path):
    out = tmp_path / "learning.json"
    stdout = run_script("real_learning.py", "--quick", "--out", str(out))
    assert "held-out before" in stdout and "trace" in stdout and "uniform" in stdout
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "tiny"
    check_learning(result, expected_leaves=result["config"]["leaves"])


@pytest.mark.slow
def test_real_learning_smollm2_small(tmp_path):
    """SmolLM2 + search_qa at the smallest sizes: one iteration per method, four held-out tasks."""
    out = tmp_path / "learning.json"
    run_script(
        "real_learning.py",
        *("--iterations", "1", "--warmup", "0", "--held-out", "4", "--eval-samples", "1"),
        *("--out", str(out)),
        timeout=1200,
    )
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "smollm2"
    check_learning(result, expected_leaves=12)
