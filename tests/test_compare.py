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


def _log(client: MlflowClient, run_id: str, key: str, values: list[float]) -> None:
    for step, value in enumerate(values):
        client.log_metric(run_id, key, value, timestamp=START + step, step=step)


def _run(
    client: MlflowClient, exp: str, allocator: str, wall_ms: int, metrics: dict[str, list[float]]
) -> str:
    tags = {"allocator": allocator, "env": "chain", "model": "tiny_model"}
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
    trace = _run(client, exp, "trace", 12_500, {
        "rollout/success_rate": [0.2, 0.5, 0.4],
        "rollout/effective_ratio": [0.5, 1.0, 0.75],
        "budget/leaves_cum": [12, 24, 36],
        "budget/tokens_cum": [100, 190, 300],
    })  # fmt: skip
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
    assert (trace["run"], trace["id"], trace["env"], trace["model"]) == (
        "trace-run",
        trace_id[:8],
        "chain",
        "tiny_model",
    )
    # trace: final 0.4, best 0.5; effective final 0.75, mean (0.5 + 1 + 0.75) / 3 = 0.75; totals = last _cum
    assert (trace["success_rate_final"], trace["success_rate_best"]) == (0.4, 0.5)
    assert trace["effective_ratio_final"] == 0.75 and trace["effective_ratio_mean"] == pytest.approx(0.75)
    assert (trace["leaves_total"], trace["tokens_total"], trace["iterations"]) == (36, 300, 3)
    assert trace["wall_s"] == pytest.approx(12.5)
    # uniform: effective mean (0 + 0.5) / 2 = 0.25; totals are sums: 12 + 12 = 24 leaves, 150 + 170 = 320
    assert (uniform["success_rate_final"], uniform["success_rate_best"]) == (0.3, 0.3)
    assert uniform["effective_ratio_mean"] == pytest.approx(0.25)
    assert (uniform["leaves_total"], uniform["tokens_total"], uniform["iterations"]) == (24, 320, 2)
    assert uniform["wall_s"] == pytest.approx(3.0)


def test_curves_are_aligned_on_cumulative_budget(store: tuple[str, str, str]) -> None:
    uri, trace_id, uniform_id = store
    client = compare.open_client(uri)
    assert compare.curve(client, trace_id, compare.SUCCESS) == ([12, 24, 36], [0.2, 0.5, 0.4])
    assert compare.curve(client, uniform_id, compare.SUCCESS) == ([12, 24], [0.1, 0.3])
    assert compare.curve(client, uniform_id, compare.EFFECTIVE, compare.TOKENS) == ([150, 320], [0.0, 0.5])


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


def test_brier_best_is_the_lowest(store: tuple[str, str, str]) -> None:
    uri, trace_id, _ = store
    client = compare.open_client(uri)
    _log(client, trace_id, "predictor/brier", [0.3, 0.1, 0.2])
    row = compare.run_summary(client, client.get_run(trace_id), "predictor/brier")
    assert (row["brier_final"], row["brier_best"]) == (0.2, 0.1)


def test_main_prints_table_and_writes_plots(
    store: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, trace_id, uniform_id = store
    assert compare.main(["--tracking-uri", uri, "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert trace_id[:8] in out and uniform_id[:8] in out and "success_rate_best" in out
    names = ["rollout_success_rate", "rollout_effective_ratio"]
    for png in [tmp_path / "plots" / f"{n}_vs_{x}.png" for n in names for x in ("leaves", "tokens")]:
        assert png.is_file() and png.stat().st_size > 0, png


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
