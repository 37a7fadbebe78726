"""compare.py on hand-made MLflow runs: two runs with known histories in a temp sqlite store, so the
expected table values can be read straight off the logged numbers (no training, no callbacks)."""

import json
import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trace_lightning import compare
from trace_lightning.tree import RolloutTree

START = 1_700_000_000_000  # ms since the epoch; any fixed time will do


def _log(
    client: MlflowClient, run_id: str, key: str, values: list[float], steps: list[int] | None = None
) -> None:
    for step, value in zip(steps or range(len(values)), values, strict=True):
        client.log_metric(run_id, key, value, timestamp=START + step, step=step)


def _run(
    client: MlflowClient,
    exp: str,
    allocator: str,
    wall_ms: int,
    metrics: dict[str, list[float]],
    tags: dict[str, str] | None = None,
) -> str:
    tags = {"allocator": allocator, "env": "chain", **(tags or {"model": "tiny_model"})}
    run_id = client.create_run(exp, start_time=START, tags=tags, run_name=f"{allocator}-run").info.run_id
    for key, values in metrics.items():
        _log(client, run_id, key, values)
    client.set_terminated(run_id, "FINISHED", end_time=START + wall_ms)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """(tracking uri, trace run id, uniform run id), shared by the module: a new sqlite store costs a few
    seconds of schema migrations, and the tests below only add keys no other test reads.

    The trace run logs the running sums the callbacks write (and no per-iteration leaves, so only the
    `_cum` path can give its totals); the uniform run logs only per-iteration leaves and tokens, so its
    totals must come from summing them."""
    tmp_path = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("trace_lightning", artifact_location=str(tmp_path / "artifacts"))
    models = {"base_model": "smollm2-135m-instruct", "warm_start": "smollm2-search_qa"}
    trace = _run(client, exp, "trace", 12_500, {
        "rollout/success_rate": [0.2, 0.5, 0.4],
        "rollout/effective_ratio": [0.5, 1.0, 0.75],
        "budget/leaves_cum": [12, 24, 36],
        "budget/tokens_cum": [100, 190, 300],
        "budget/tool_calls_cum": [10, 21, 30],
        "budget/seconds_cum": [4.0, 7.5, 11.0],
    }, models)  # fmt: skip
    # held-out evaluations before training and after the 2nd and 3rd iterations, as the trainer logs
    # them: the first at step 0, where a one-batch first iteration logs its sums too; the others one
    # step after their iteration's last batch
    for key, values in [
        ("eval/pass_at_1", [0.25, 0.375, 0.5]),
        ("eval/pass_at_1_se", [0.05, 0.06, 0.055]),
        ("eval/iterations_trained", [0, 2, 3]),
    ]:
        _log(client, trace, key, values, steps=[0, 2, 3])
    uniform = _run(client, exp, "uniform", 3_000, {
        "rollout/success_rate": [0.1, 0.3],
        "rollout/effective_ratio": [0.0, 0.5],
        "budget/leaves": [12, 12],
        "budget/tokens": [150, 170],
    })  # fmt: skip
    return uri, trace, uniform


def _rows(uri: str) -> dict[str, dict]:
    client = compare.open_client(uri)
    return {r.data.tags["allocator"]: compare.run_summary(client, r) for r in compare.find_runs(client)}


def test_summary_values(store: tuple[str, str, str]) -> None:
    uri, trace_id, _ = store
    rows = _rows(uri)
    trace, uniform = rows["trace"], rows["uniform"]
    # the table leads with the run, its models, and held-out pass@1 +- SE (the last evaluation)
    assert list(trace)[:8] == [
        "run",
        "id",
        "base_model",
        "warm_start",
        "allocator",
        "env",
        "held_out_pass_at_1",
        "held_out_pass_at_1_se",
    ]
    assert (trace["run"], trace["id"], trace["env"]) == ("trace-run", trace_id[:8], "chain")
    assert (trace["base_model"], trace["warm_start"]) == ("smollm2-135m-instruct", "smollm2-search_qa")
    assert (trace["held_out_pass_at_1"], trace["held_out_pass_at_1_se"]) == (0.5, 0.055)
    assert "held_out_pass_at_1_best" not in trace  # a best over evaluations is chosen on the test set
    # training success last 0.4; effective mean (0.5 + 1 + 0.75) / 3 = 0.75; totals = last _cum
    assert trace["train_success_last"] == 0.4 and trace["effective_ratio_mean"] == pytest.approx(0.75)
    assert (trace["leaves_total"], trace["tokens_total"], trace["iterations"]) == (36, 300, 3)
    assert (trace["tool_calls_total"], trace["seconds_total"]) == (30, 11.0)
    assert math.isnan(trace["prefill_tokens_total"])  # not logged by this run
    assert trace["wall_s"] == pytest.approx(12.5)
    # uniform: an older run, tagged "model", no evaluation; totals are sums: 12 + 12 leaves, 150 + 170
    assert uniform["base_model"] == "tiny_model" and uniform["warm_start"] == ""
    assert math.isnan(uniform["held_out_pass_at_1"]) and uniform["train_success_last"] == 0.3
    assert uniform["effective_ratio_mean"] == pytest.approx(0.25)
    assert (uniform["leaves_total"], uniform["tokens_total"], uniform["iterations"]) == (24, 320, 2)
    assert uniform["wall_s"] == pytest.approx(3.0)


def test_curves_are_aligned_on_cumulative_budget(store: tuple[str, str, str]) -> None:
    uri, trace_id, uniform_id = store
    client = compare.open_client(uri)
    assert compare.curve(client, trace_id, compare.SUCCESS) == ([12, 24, 36], [0.2, 0.5, 0.4])
    assert compare.curve(client, uniform_id, compare.SUCCESS) == ([12, 24], [0.1, 0.3])
    assert compare.curve(client, uniform_id, compare.EFFECTIVE, compare.TOKENS) == ([150, 320], [0.0, 0.5])
    # an evaluation sits at the budget of the iterations it followed: 0 before training, then the
    # running sums after iterations 0-1 and 0-2 (not at its step: step 0 holds iteration 0's sums)
    tool_calls, seconds = compare.UNITS["tool_calls"], compare.UNITS["seconds"]
    assert compare.curve(client, trace_id, compare.HELD_OUT, tool_calls) == ([0, 21, 30], [0.25, 0.375, 0.5])
    assert compare.curve(client, trace_id, "eval/pass_at_1_se", seconds) == (
        [0, 7.5, 11.0],
        [0.05, 0.06, 0.055],
    )


def test_format_table() -> None:
    rows = [
        {
            "run": "a",
            "allocator": "trace",
            "success_rate_final": math.nan,
            "leaves_total": 36.0,
            "wall_s": 1.25,
        }
    ]
    text = compare.format_table(rows)
    header, _, row = text.splitlines()
    assert header.split() == ["run", "allocator", "success_rate_final", "leaves_total", "wall_s"]
    assert row.split() == ["a", "trace", "-", "36", "1.2"]
    assert compare._cell("seconds_total", 11.04) == "11.0" and compare._cell("tool_calls_total", 30.0) == "30"


def test_brier_best_is_the_lowest(store: tuple[str, str, str]) -> None:
    uri, trace_id, _ = store
    client = compare.open_client(uri)
    _log(client, trace_id, "predictor/brier", [0.3, 0.1, 0.2])
    row = compare.run_summary(client, client.get_run(trace_id), "predictor/brier")
    assert (row["brier"], row["brier_best"]) == (0.2, 0.1)


def test_main_prints_table_and_writes_plots(
    store: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, trace_id, uniform_id = store
    assert compare.main(["--tracking-uri", uri, "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert trace_id[:8] in out and uniform_id[:8] in out and "held_out_pass_at_1_se" in out
    names = ["eval_pass_at_1", "rollout_effective_ratio"]
    for png in [tmp_path / "plots" / f"{n}_vs_{x}.png" for n in names for x in ("leaves", "tokens")]:
        assert png.is_file() and png.stat().st_size > 0, png
    units = ["--x", "tool_calls", "seconds", "prefill_tokens"]
    assert compare.main(["--tracking-uri", uri, "--out", str(tmp_path / "units"), *units]) == 0
    written = sorted(p.name for p in (tmp_path / "units").iterdir())
    # no run logged prefill tokens: that plot is skipped rather than drawn empty
    assert written == [f"{n}_vs_{x}.png" for n in names for x in ("seconds", "tool_calls")]
    with pytest.raises(SystemExit):
        compare.main(["--tracking-uri", uri, "--x", "dollars"])  # argparse names the choices


def test_runs_by_short_id(
    store: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, trace_id, uniform_id = store
    assert compare.main(["--tracking-uri", uri, "--runs", uniform_id[:8], "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert uniform_id[:8] in out and trace_id[:8] not in out


def test_clear_errors(
    store: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _, _ = store
    assert compare.main(["--tracking-uri", uri, "--experiment", "nope", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "no experiment 'nope'" in err and "--experiment" in err and "trace_lightning" in err
    missing = f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"
    assert compare.main(["--tracking-uri", missing]) == 2
    assert "--tracking-uri" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists()  # the check must not create the store it looked for
    assert compare.main(["--tracking-uri", uri, "--runs", "zzzz"]) == 2
    assert "--runs zzzz" in capsys.readouterr().err


def test_tree_artifacts_round_trip(store: tuple[str, str, str], tmp_path: Path) -> None:
    uri, trace_id, _ = store
    client = compare.open_client(uri)
    tree = RolloutTree(task_id=3, prompt_ids=[1, 2])
    tree.finish(tree.add_turn(0, "bare", [5], [6]), 1.0, "answer")
    (tmp_path / "trees").mkdir()
    for i, record in enumerate([[tree.to_dict()], {"iteration": 1, "trees": [tree.to_dict()]}]):
        (tmp_path / "trees" / f"iteration_{i:04d}.json").write_text(json.dumps(record))
        client.log_artifact(trace_id, str(tmp_path / "trees" / f"iteration_{i:04d}.json"), "trees")
    paths = compare.tree_artifacts(client, trace_id)
    assert paths == ["trees/iteration_0000.json", "trees/iteration_0001.json"]
    assert [compare.load_trees(client, trace_id, p) for p in paths] == [[tree], [tree]]


def test_a_hostile_store_prints_escaped_and_still_plots(
    store: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run name with a terminal escape and a newline, a tag that is mathtext, and an evaluation logged
    at -3 iterations trained (which indexed the budget list from its end, or past its start): the table
    shows them escaped on one line, the plot is written without that point, and the output counts it."""
    uri, _, _ = store
    client = MlflowClient(uri)
    exp = client.create_experiment("hostile", artifact_location=str(tmp_path / "artifacts"))
    tags = {"allocator": "$\\frac{$", "env": "a\x1b[2J\u202eb"}
    run_id = client.create_run(exp, START, tags, run_name="a\x1b[31mred\nforged | row").info.run_id
    _log(client, run_id, "budget/leaves_cum", [12])
    _log(client, run_id, "eval/pass_at_1", [0.25, 0.5])
    _log(client, run_id, "eval/iterations_trained", [-3, 1])
    client.set_terminated(run_id, "FINISHED", end_time=START + 1000)
    # -3 has no place; 1 iteration trained sits at the 12 leaves it spent
    assert compare.curve_points(client, run_id, compare.HELD_OUT) == ([12], [0.5], 1)
    out_dir = tmp_path / "plots"
    assert compare.main(["--tracking-uri", uri, "--experiment", "hostile", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert not any(line.startswith("forged") for line in out.splitlines())
    assert "a\\x1b[31mred\\nforged | row" in out and "a\\x1b[2J\\u202eb" in out
    assert f"eval_pass_at_1_vs_leaves.png: left out 1 point(s) of run {run_id[:8]}" in out
    assert (out_dir / "eval_pass_at_1_vs_leaves.png").stat().st_size > 0
    assert compare.plain("$\\frac{$ x") == "\\$\\frac{\\$ x" and compare.visible("\x1b\n") == "\\x1b\\n"
