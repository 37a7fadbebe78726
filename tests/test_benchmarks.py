import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`benchmarks/<script>` with these arguments; fails the test if it exits non-zero."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def test_allocation_benchmark_quick_mode(tmp_path):
    out = tmp_path / "allocation.json"
    proc = benchmark("allocation.py", "--quick", "--out", str(out))
    assert "trace" in proc.stdout and "x uniform" in proc.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["predictor"] for r in rows} == {"oracle", "noisy", "learned"}
    assert len({r["allocator"] for r in rows}) == 7
    for r in rows:  # every allocator spent exactly the same leaves every iteration
        assert r["leaves_per_iter"] == result["config"]["leaves"]
        assert 0.0 <= r["effective_ratio"] <= 1.0
        assert 0.0 <= r["mixed_prompts_per_iter"] <= r["prompts_per_iter"]


def test_env_bounds_benchmark(tmp_path):
    pytest.importorskip("bfcl_eval", reason="the BFCL data ships in bfcl-eval: run `make install`")
    out = tmp_path / "env_bounds.json"
    benchmark("env_bounds.py", "--out", str(out))
    result = json.loads(out.read_text())
    growth, cap = result["growth"], result["growth"]["cap_chars"]
    assert growth["stop_reason"] == "world_cap" and growth["reward"] == 0.0 and growth["calls_until_end"] < 40
    assert all(s["max_world_chars"] < cap / 10 for s in result["ground_truth"].values())
    assert set(result["hostile_slowest_step_ms"]) == {"search_qa", "math_tool", "bfcl", "chain"}


def test_real_learning_quick_mode(tmp_path):
    """The real-model learning benchmark through the product's loop (tiny model on chain): equal
    leaves, held-out tasks never trained on, the issue's figures present and consistent with the rows."""
    out = tmp_path / "real_learning.json"
    proc = benchmark("real_learning.py", "--quick", "--out", str(out))
    assert "held-out before" in proc.stdout
    result = json.loads(out.read_text())
    config, held_out = result["config"], set(result["config"]["held_out_tasks"])
    assert len(held_out) == config["held_out"] and config["train_tasks"] == 256 - config["held_out"]
    assert set(result["results"]) == {"trace", "uniform"}
    for name, s in result["results"].items():
        run = result["runs"][name]
        figures = {
            "mean_turns",
            "prefix_mixed_per_100",
            "effective_ratio",
            "heldout_delta",
            "heldout_delta_se",
        }
        assert figures <= set(s)
        assert s["leaves_per_iteration"] == [config["leaves"]] * config["iterations"]
        for row in run["iterations"]:
            assert not held_out & set(row["task_ids"])  # held-out tasks are never sampled for training
            assert row["seconds"] >= row["seconds_sample"] + row["seconds_train"]
            assert row["prefill_tokens"] > 0
            assert 1.0 <= row["turns_mean"] <= 3.0 and row["loss"] is not None
        totals = s["totals"]  # the budget in every unit: the last running sums
        assert totals["leaves"] == config["leaves"] * config["iterations"] and totals["tokens"] == s["tokens"]
        assert set(totals) == {"leaves", "tokens", "prefill_tokens", "tool_calls", "seconds"}
        # the held-out gain is the mean of the per-task differences, after minus before
        before, after = run["held_out_before"]["per_task"], run["held_out_after"]["per_task"]
        assert len(before) == config["held_out"] * 1 and set(run["held_out_before"]["task_ids"]) == held_out
        assert abs(s["heldout_delta"] - (sum(after) - sum(before)) / len(before)) < 1e-9
        assert s["heldout_before"] == result["results"]["uniform"]["heldout_before"]  # the same start
        leaves = sum(r["leaves"] for r in run["iterations"])
        mixed = sum(r["prefix_mixed_per_100"] * r["leaves"] / 100 for r in run["iterations"])
        assert abs(s["prefix_mixed_per_100"] - 100 * mixed / leaves) < 1e-9


@pytest.mark.slow
def test_real_learning_smollm2_smallest(tmp_path):
    """SmolLM2 + LoRA on search_qa through the product's loop at the smallest sizes: one iteration per
    method, 2 held-out tasks. SmolLM2 as shipped, so that the test needs no warm start built first."""
    out = tmp_path / "real_learning.json"
    benchmark(
        *("real_learning.py", "--warm-start", "none", "--iterations", "1"),
        *("--held-out", "2", "--eval-samples", "1", "--out", str(out)),
        timeout=1800,
    )
    result = json.loads(out.read_text())
    for name, s in result["results"].items():
        assert s["leaves_per_iteration"] == [12]  # the default job's budget, every method
        rows = result["runs"][name]["iterations"]
        assert not set(result["config"]["held_out_tasks"]) & set(rows[0]["task_ids"])


def test_bfcl_quick_mode(tmp_path):
    """The function-calling benchmark end to end on a tiny random model: the issue's keys, equal leaves
    for both methods, held-out entries never trained on, a tree drawn, prompt tokens for every subset;
    held-out episodes decoded greedily, as the published run does."""
    out = tmp_path / "bfcl.json"
    proc = benchmark(
        *("bfcl.py", "--quick", "--eval-temperature", "0"),
        *("--out", str(out), "--tree-png", str(tmp_path / "t.png")),
        timeout=600,
    )
    assert "held-out success after the warm start" in proc.stdout
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert {"mean_turns", "heldout_success", "mixed_depth2_iterations_share"} <= set(tiny)
    assert set(tiny["heldout_success"]) == {"base", "warm_start", "trace", "uniform"}
    details, config = tiny["details"], tiny["config"]
    assert set(details["prompt_tokens"]) == {"base", "long_context", "miss_func", "miss_param"}
    assert all(sum(p["levels"].values()) == 200 for p in details["prompt_tokens"].values())
    held = set(details["warm_start"]["held_out_task_ids"])
    assert len(held) == 40 and set(details["after_warm_start"]["base"]["entries"]) <= held
    for run in details["rl"].values():
        assert [r["leaves"] for r in run["iterations"]] == [config["leaves"]] * config["iterations"]
        assert not held & {i for r in run["iterations"] for i in r["task_ids"]}
        assert set(run["held_out_after"]["entries"]) == set(details["after_warm_start"]["base"]["entries"])
    assert (tmp_path / "t.png").stat().st_size > 0


def test_allocation_room_quick_mode(tmp_path):
    """The room benchmark's figures obey what the math says of them: Stage 1's exact program on the true
    rates maximises expected mixed prompts over every allocation of groups of 2-16, which GRPO's groups,
    pairs and Knapsack RL's split all are, and a predictor without noise is the true rates."""
    out = tmp_path / "room.json"
    proc = benchmark("allocation_room.py", "--quick", "--out", str(out))
    assert "Spearman" in proc.stdout
    result = json.loads(out.read_text())
    mixed = result["mixed"]
    assert all(mixed["trace_true_v"] >= mixed[k] for k in ("grpo", "pairs", "knapsack_true_v"))
    exact = next(r for r in result["by_skill"] if r["noise_sd"] == 0.0)
    assert exact["spearman"] == pytest.approx(1.0, abs=1e-3)  # rates clipped to [1e-3, 1 - 1e-3] may tie
    assert exact["trace_x_grpo"] == pytest.approx(mixed["trace_true_v"] / mixed["grpo"])
    assert 0.0 < result["screen"]["12"] <= 12 + (result["config"]["roots"] - 24) / 2


def test_allocation_room_expected_mixed_matches_sampling():
    """The closed form sum 1 - v^m - (1 - v)^m against counting mixed groups in simulated outcomes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from allocation_room import expected_mixed

    rng = np.random.default_rng(0)
    v, counts = np.array([0.1, 0.5, 0.9, 0.3]), np.array([4, 2, 0, 7])
    successes = rng.binomial(counts, v, size=(200_000, 4))  # [trials, prompts]
    sampled = ((successes > 0) & (successes < counts) & (counts > 0)).sum(axis=1).mean()
    assert expected_mixed(v, counts) == pytest.approx(sampled, abs=0.01)


def test_budget_by_rate_against_a_hand_count(tmp_path):
    # two probes of 4 episodes: rates 0, 1/2, 1 with 2, 4, 2 rollouts; rates 1/4, 3/4 with 4 and 4
    probes = [
        {"episodes": 4, "half_a": [0, 1, 2], "half_b": [0, 1, 2], "counts": [2, 4, 2]},
        {"episodes": 4, "half_a": [1, 1], "half_b": [0, 2], "counts": [4, 4]},
    ]
    result = {"seeds": [{"runs": [{"method": "m", "seed": 0, "probe_rates": probes}]}]}
    path, out = tmp_path / "run.json", tmp_path / "tables.json"
    path.write_text(json.dumps(result))
    proc = benchmark("budget_by_rate.py", str(path), "--out", str(out))
    assert "mixed/100" in proc.stdout
    t = json.loads(out.read_text())["m"]
    # five candidates, one in each bin but (3/4, 1); 16 rollouts
    assert list(t["pool_share"].values()) == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.0, 0.2])
    assert list(t["budget_share"].values()) == pytest.approx([2 / 16, 4 / 16, 4 / 16, 4 / 16, 0.0, 2 / 16])
    assert t["mean_rate"] == pytest.approx((0.5 * 4 + 1 * 2 + 0.25 * 4 + 0.75 * 4) / 16)
    assert t["mean_variance"] == pytest.approx((0.25 * 4 + 0.1875 * 8) / 16)
    # a group of 4 drawn from 4 episodes is those episodes: mixed unless they all agree (3 of 5 candidates)
    assert t["mixed_per_100"] == pytest.approx(100 * 3 / 16)
    result["seeds"][0]["runs"][0].pop("probe_rates")
    path.write_text(json.dumps(result))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        benchmark("budget_by_rate.py", str(path))
    assert "--probe-rates" in failed.value.stderr


def test_budget_by_rate_cell_spread_by_hand():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from budget_by_rate import cell_spread

    cell = {1: ("a",), 2: ("a",), 3: ("b",), 4: ("c",)}.__getitem__
    # probe 1: all 8 rollouts on cell a (one cell); probe 2: 2, 2 on cells b and c (shares 1/2, 1/2)
    probes = [{"task_ids": [1, 2, 3], "counts": [4, 4, 0]}, {"task_ids": [3, 4, 1], "counts": [2, 2, 0]}]
    got = cell_spread(probes, cell)
    assert got["top_cell_share"] == pytest.approx((1.0 + 0.5) / 2)
    assert got["effective_cells"] == pytest.approx((1.0 + 2.0) / 2)  # exp(0) and exp(log 2)


def test_replay_pricing_by_hand(tmp_path):
    """One saved iteration, priced at the prior (flip rate 0.05 everywhere): two bare rollouts of turns of
    10, 10 and 2 tokens, one won and one lost, 44 bare tokens in all; N = 2 gives a budget of 4."""
    from trace_lightning.tree import RolloutTree

    tree = RolloutTree(0, prompt_ids=[7])
    for won in (1.0, 0.0):
        a = tree.add_turn(0, "bare", [1] * 10, [2])
        b = tree.add_turn(a, "bare", [1] * 10, [2])
        tree.finish(tree.add_turn(b, "bare", [1] * 2, []), won, "answer")
    tree.finish(tree.add_turn(1, "expand", [1] * 12, []), 0.0, "answer")  # the run's one continuation: a flip
    saved = {"iteration": 0, "ledger": {"tokens": {"bare": 44}}, "trees": [tree.to_dict()]}
    trees_dir = tmp_path / "run" / "artifacts" / "trees"
    trees_dir.mkdir(parents=True)
    (trees_dir / "iteration_0000.json").write_text(json.dumps(saved))
    out = tmp_path / "replay.json"
    benchmark("replay_pricing.py", str(tmp_path / "run"), "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    leaves, tokens = rows["leaves"][0], rows["tokens"][0]
    # leaves: the mixed group earns 2 leaves in 44 tokens (rate 1/22). A 2-token last turn nets
    # 2 * 0.05 - 2/22 = 0.009, then 0.095 - 0.091 > 0, then 0.090 - 0.091 < 0: two at each of the two;
    # the 12-token prefixes net 0.1 - 12/22 < 0
    assert leaves["rate"] == pytest.approx(1 / 22)
    assert leaves["bought"] == 4 and leaves["bought_by_bucket"] == {"1 left, won": 2, "1 left, lost": 2}
    # tokens: all 44 bare tokens sit in the mixed group (rate 1); a flip is worth 2 * 0.05 * t < t
    assert tokens["rate"] == pytest.approx(1.0) and tokens["bought"] == 0
    assert (leaves["budget"], leaves["run_continuations"], leaves["run_flips"]) == (4, 1, 1)
    with pytest.raises(subprocess.CalledProcessError) as failed:
        benchmark("replay_pricing.py", str(tmp_path))
    assert "no saved trees" in failed.value.stderr
