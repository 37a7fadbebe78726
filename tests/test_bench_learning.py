import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAME_BUDGET = [
    "uniform",
    "grpo_trace_prompts",
    "pcl",
    "random_expand",
    "trace",
    "trace_pooled",
    "trace_shared_sum",
    "trace_head",
    "trace_gate",
    "trace_ungated",
    "trace_bounded",
    "trace_ungated_bounded",
    "uniform_spread",
    "trace_spread",
    "trace_quota",
    "trace_ungated_quota",
    "trace_ungated_n0",
    "true_v_n0",  # not a method either: true_v's Stage 1 without continuations
    "trace_ungated_head",
    "trace_head_gate0",
    "trace_ungated_head_n0",
    "trace_head_gate0_n0",
    "trace_head_gate0_bounded",
    "trace_split",
    "trace_head_gate0_split",
    "trace_head_gate0_tokens",
    "trace_head_gate0_sure",
    "trace_head_gate0_grow",
    "trace_head_gate0_sure_grow",
    "trace_sure_grow",
    "trace_attributes",
    "trace_attributes_thompson",
    "trace_attributes_quota",
    "trace_head_gate",
    "true_v",  # not a method (Stage 1 steered by fresh episodes outside the budget), but the same leaves
    "trace_root_only",
    "trace_prefix_only",
    "trace_explore",
]
# The smoke run trains one method per setting the others combine (the allocators, both predictors, the
# gate, the head's estimates, N = 0, each estimator, the spread, the quota, exploration, each pricing
# rule) and the (M, N) table; `test_every_method_is_built_at_the_same_budget` builds all of them.
SMOKE = [
    "uniform",
    "pcl",
    "random_expand",
    "true_v",
    "trace",
    "trace_head",
    "trace_gate",
    "trace_shared_sum",
    "trace_bounded",
    "trace_spread",
    "trace_quota",
    "trace_explore",
    "trace_ungated_head",
    "trace_head_gate0_n0",
    "trace_split",
    "trace_head_gate0_tokens",
    "trace_sure_grow",
    "trace_root_only",
    "trace_prefix_only",
]
SMOKE_BUDGETS = ["trace_m12_n3", "trace_m24_n1"]  # the (M, N) table at the quick mode's 24 leaves, N = 1


def learning(args: list[str], script: str = "learning.py") -> subprocess.CompletedProcess:
    """`benchmarks/<script>` with these arguments; fails the test if it exits non-zero."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def test_learning_benchmark_quick_mode(tmp_path):
    out, png = tmp_path / "learning.json", tmp_path / "learning.png"
    cache = str(tmp_path / "cache")
    args = ["--quick", "--out", str(out), "--plot", str(png), "--cache", cache, "--methods", *SMOKE]
    proc = learning([*args, *SMOKE_BUDGETS])
    for title in ("Main comparison", "Table 1 ablation", "(M, N) budget table"):
        assert title in proc.stdout
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("PASS:", "MISS:"))]
    # equal steps, three on the head online, trace's share of true_v's gain
    assert len(verdicts) == 5 and verdicts[0].startswith("PASS: optimizer steps per iteration equal")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    config = result["config"]
    assert config["tasks"] == 40 and config["heldout_tasks"] == 8
    assert result["verdicts"] == verdicts
    for seed in result["seeds"]:
        runs = {r["method"]: r for r in seed["runs"]}
        assert set(runs) == set(SMOKE + SMOKE_BUDGETS)
        # every method of a seed starts from the same warm start and is evaluated the same way
        assert len({r["evals"][0]["success"] for r in runs.values()}) == 1
        for name, run in runs.items():
            if name in SMOKE:
                assert run["leaves_per_iteration"] == config["leaves"]
            assert len(run["iterations"]) == config["iterations"]
            for i, row in enumerate(run["iterations"]):  # the budget is spent exactly, every iteration
                assert row["leaves"] == run["leaves_per_iteration"]
                # every budget unit, per iteration and as a running sum
                assert row["leaves_cum"] == (i + 1) * row["leaves"] and row["prefill_tokens"] > 0
                assert row["seconds"] >= row["seconds_train"] > 0 and "tool_calls_cum" in row
                assert 0.0 <= row["effective_ratio"] <= 1.0 and 0.0 <= row["train_success"] <= 1.0
                assert 0.0 <= row["pool_pred_sd"] <= 0.5 and 0 <= row["mixed_prompts"] <= row["prompts"]
            for e in run["evals"]:
                assert e["leaves"] == e["iteration"] * run["leaves_per_iteration"]
                assert 0.0 <= e["success"] <= 1.0
    for name in SMOKE:  # same total budget as GRPO: reached within it, never (inf), or undefined (nan)
        assert set(result["summary"][name]["final_success"]) >= {"mean", "std", "per_seed"}
        ratio = result["summary"][name]["leaves_x_grpo"]["per_seed"]
        assert all(0.0 <= x <= 1.0 or math.isinf(x) or math.isnan(x) for x in ratio)
    # a finished run's tables can be reprinted (and its plot redrawn) from its JSON alone
    replot = tmp_path / "again.png"
    again = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--from-json", str(out), "--plot", str(replot)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert [line for line in again.stdout.splitlines() if line.startswith(("PASS:", "MISS:"))] == verdicts
    assert replot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_method_is_built_at_the_same_budget(tmp_path):
    """Every method the benchmark lists is built (no training): the same leaves as GRPO but the (M, N)
    table's, and each pricing variant carries the settings its name says, over the earlier default."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning as bench

    args = bench.parse_args(["--quick"])
    args.trainer, args.experiment = bench.shipped_config(str(tmp_path))
    built = bench.methods(args)
    assert set(SAME_BUDGET) | set(bench.MAIN) | set(SMOKE) <= set(built)
    assert set(built) == set(SAME_BUDGET) | set(SMOKE_BUDGETS)
    for name in SAME_BUDGET:
        assert built[name].leaves == args.leaves == 24, name
    assert [built[n].leaves for n in SMOKE_BUDGETS] == [12 * 4, 24 * 2]
    shipped, earlier = built["trace"], built["trace_pooled"]
    # today's default: the head's estimates behind a gate at 0, each bucket priced one posterior std below
    # its mean and capped at its measured continuations; the earlier one: pooled rates, gate 0.25, the mean
    assert (shipped.selection["gate_skill"], shipped.selection["attributes"]) == (0.0, False)
    assert (shipped.allocator.pricing.confidence, shipped.allocator.pricing.growth) == (1.0, 1.0)
    assert (earlier.selection["gate_skill"], earlier.selection["attributes"]) == (0.25, True)
    assert (earlier.allocator.pricing.confidence, earlier.allocator.pricing.growth) == (0.0, None)
    wanted = {  # pricing fields each variant changes; the rest are the earlier default's
        "trace_head_gate0_tokens": {"worth": "tokens"},
        "trace_head_gate0_sure": {"confidence": 1.0},
        "trace_head_gate0_grow": {"growth": 1.0},
        "trace_head_gate0_sure_grow": {"confidence": 1.0, "growth": 1.0},
        "trace_sure_grow": {"confidence": 1.0, "growth": 1.0},
        "trace_head_gate0": {},
        "trace_bounded": {},
    }
    for name, changes in wanted.items():
        pricing, base = built[name].allocator.pricing, earlier.allocator.pricing
        for key in ("worth", "confidence", "growth"):
            assert getattr(pricing, key) == changes.get(key, getattr(base, key)), (name, key)
    for name in ("trace_head_gate0", "trace_head_gate0_sure_grow", "trace_head_gate0_n0"):
        assert built[name].selection == shipped.selection, name  # the head gated at 0 is today's selection
    attributes = built["trace_attributes"]  # today's default with one switch: rates pooled by attributes
    assert attributes.selection == shipped.selection | {"attributes": True}
    assert attributes.allocator == shipped.allocator
    thompson = built["trace_attributes_thompson"]  # and a second: one posterior sample per candidate
    assert thompson.selection == attributes.selection | {"thompson": True}
    assert thompson.allocator == shipped.allocator
    quota = built["trace_attributes_quota"]  # and a third: no cell above its share of GRPO's prompts
    assert quota.selection == attributes.selection | {"cell_quota": 1.0}
    assert quota.allocator == shipped.allocator
    for name in ("trace_sure_grow", "trace_bounded", "true_v"):
        assert built[name].selection == earlier.selection, name
    assert built["trace_head_gate0_n0"].allocator.expansion == 0 and shipped.allocator.expansion == 1


def test_learning_benchmark_quick_mode_at_an_equal_token_budget(tmp_path):
    """`--tokens`: every method under the same generated-token budget, with the same optimizer steps;
    the leaves are each method's own (tests/test_data.py checks that trace's cheaper leaves buy more)."""
    out = tmp_path / "learning_tokens.json"
    args = ["--quick", "--tokens", "150", "--methods", "uniform", "trace", "random_expand"]
    args += ["--out", str(out), "--plot", str(tmp_path / "p.png"), "--cache", str(tmp_path / "cache")]
    proc = learning(args)
    assert "at 150 generated tokens per iteration trace minus GRPO" in proc.stdout
    result = json.loads(out.read_text())
    for run in result["seeds"][0]["runs"]:
        assert all(row["tokens"] <= 150 for row in run["iterations"]), run["method"]
    summary = result["summary"]
    steps = {m: summary[m]["steps_per_iteration"]["mean"] for m in summary}
    assert len(set(steps.values())) == 1, steps
    assert all(summary[m]["leaves_per_iteration"]["mean"] >= 1 for m in summary)


def test_a_token_run_goes_into_the_equal_leaves_json_as_summary_tokens(tmp_path):
    from benchmarks.learning import merge_tokens

    leaves = {"config": {"tokens": None, "seeds": [0, 1]}, "summary": {"trace": 1}, "verdicts": ["a"]}
    tokens = {"config": {"tokens": 900, "seeds": [0, 1]}, "summary": {"trace": 2}, "verdicts": ["b"]}
    path = tmp_path / "learning.json"
    path.write_text(json.dumps(leaves))
    merge_tokens(path, tokens | {"seconds": 3.0})
    merged = json.loads(path.read_text())
    assert merged["summary"] == {"trace": 1} and merged["summary_tokens"] == {"trace": 2}
    assert merged["config_tokens"]["tokens"] == 900 and merged["verdicts_tokens"] == ["b"]
    other = tokens | {"config": {"tokens": 900, "seeds": [0]}, "seconds": 1.0}
    with pytest.raises(SystemExit, match="same seeds"):
        merge_tokens(path, other)


def test_predictor_ceiling_quick_mode_keeps_every_probe_candidate(tmp_path):
    out = tmp_path / "ceiling.json"
    args = ["--quick", "--out", str(out), "--cache", str(tmp_path / "cache")]
    proc = learning(args, "predictor_ceiling.py")
    assert "root oracle" in proc.stdout
    result = json.loads(out.read_text())
    run = result["runs"][0]["runs"][0]
    assert run["method"] == "trace" and len(run["probe_rates"]) == 5  # every iteration after the prior's
    for probe in run["probe_rates"]:
        assert len(probe["task_ids"]) == len(probe["predicted"]) == len(probe["half_a"]) == 8  # the pool
        assert all(0 <= a <= 8 for a in probe["half_a"] + probe["half_b"])  # successes of 8 episodes
    assert result["per_seed"][0]["probes"] == 3  # the first two only train the oracles


def test_root_attributes_are_what_the_question_shows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from predictor_ceiling import all_attributes, root_attributes

    from trace_lightning.envs.decisive import DecisiveTask, render_question

    task = DecisiveTask(0, ("C", "F", "B"), decisive=1, shift=2, tolerance=0, n_letters=8)
    assert render_question(task) == "3 keys, 0 errors ok, A-H. Key 2 +2. Key 1: C."
    assert root_attributes(task) == [2, 0, 3, 8, 1, 2]  # shift, errors, keys, letters, key 2, "C"
    assert all_attributes(task)[6:] == [2, 5, 1, -1]  # C, F, B, no fourth key
    first = DecisiveTask(1, ("F", "B"), decisive=0, shift=2, tolerance=1, n_letters=8)
    assert root_attributes(first)[-1] == 7  # the first cue "F+2=H" shows H


def test_resume_takes_a_seed_file_only_from_the_same_warm_start(tmp_path):
    """`--resume` reuses a seed's kept runs only where they began from the weights cached now: a warm start
    rebuilt elsewhere can differ, and runs from two warm starts are no paired comparison."""
    import torch

    from benchmarks.learning import earlier_runs, fingerprint, parse_args, seed_file

    paths = ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "screen.json")]
    args = parse_args([*paths, "--resume"])
    weights = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.zeros(2)}
    kept = {"seed": 0, "warm_start": {"weights": fingerprint(weights)}, "runs": [{"method": "uniform"}]}
    seed_file(args, 0).write_text(json.dumps(kept))
    assert earlier_runs(args, 0, fingerprint(weights)) == kept
    assert earlier_runs(parse_args(paths), 0, fingerprint(weights)) is None  # without --resume, no reuse
    rebuilt = {"a.weight": weights["a.weight"].clone(), "b.bias": torch.tensor([0.0, 1e-6])}
    assert earlier_runs(args, 0, fingerprint(rebuilt)) is None  # one weight moved: the runs are not reused
    seed_file(args, 0).write_text(json.dumps(kept | {"warm_start": {}}))  # a file from before the record
    assert earlier_runs(args, 0, fingerprint(weights)) is None
