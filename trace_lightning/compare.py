"""`python -m trace_lightning.compare`: MLflow runs side by side, and their curves against budget spent.

    python -m trace_lightning.compare                          # every run of experiment trace_lightning
    python -m trace_lightning.compare --runs 1a2b3c4d 5e6f7a8b # chosen runs (full or short ids)
    python -m trace_lightning.compare --tracking-uri sqlite:///outputs/mlflow.db --out outputs/compare

Allocators are compared at an equal budget, so the plots put cumulative leaves (and generated tokens)
spent on the x-axis rather than iterations: an allocator that gets more out of each leaf shows up as a
curve that rises sooner. The metric keys are the ones `trace_lightning.callbacks` logs, one value per
iteration; the functions here only read them, and printing stays in `main`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from trace_lightning.tree import RolloutTree

SUCCESS, EFFECTIVE = "rollout/success_rate", "rollout/effective_ratio"
LEAVES, TOKENS = "budget/leaves", "budget/tokens"
TAGS = ("allocator", "env", "model")  # what the trainer tags every run with
LOWER_IS_BETTER = ("brier", "ece", "mse", "loss", "kl")  # for these metrics "best" means the lowest
SHORT_ID = 8

Curve = tuple[str, list[float], list[float]]  # (label, x, y)


class CompareError(Exception):
    """A store, experiment or run that cannot be found; the message names the flag that fixes it."""


# --------------------------------------------------------------------------- finding runs


def open_client(tracking_uri: str) -> MlflowClient:
    """A client on an existing store. MLflow would quietly create an empty sqlite file instead, and a
    mistyped path would then look like a store with no experiments."""
    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri.removeprefix("sqlite:///"))
        if not path.is_file():
            raise CompareError(
                f"no MLflow store at {path}; pass --tracking-uri sqlite:///<output_root>/mlflow.db "
                "(the trainer writes it under its output_root)"
            )
    return MlflowClient(tracking_uri)


def experiment_runs(client: MlflowClient, experiment: str) -> list[Run]:
    """The active runs of `experiment`, oldest first."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in client.search_experiments())
        raise CompareError(
            f"no experiment {experiment!r} in {client.tracking_uri}; pass --experiment NAME "
            f"(this store has: {', '.join(names) or 'none'})"
        )
    runs = list(client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"]))
    if not runs:
        raise CompareError(f"experiment {experiment!r} has no runs yet; train one, or pass --experiment NAME")
    return runs


def find_runs(
    client: MlflowClient, experiment: str = "trace_lightning", run_ids: Sequence[str] | None = None
) -> list[Run]:
    """The runs named in `run_ids` (full ids, or the short ids the table prints, looked up in
    `experiment`), or every run of `experiment` when none are named."""
    if not run_ids:
        return experiment_runs(client, experiment)
    selected, pool = [], None
    for run_id in run_ids:
        try:
            selected.append(client.get_run(run_id))
            continue
        except MlflowException:
            pool = pool if pool is not None else experiment_runs(client, experiment)
        matches = [r for r in pool if r.info.run_id.startswith(run_id)]
        if len(matches) != 1:
            raise CompareError(
                f"--runs {run_id}: {len(matches)} runs of experiment {experiment!r} start with this id; "
                "pass a full run id, or the --experiment that holds it"
            )
        selected.append(matches[0])
    return selected


# --------------------------------------------------------------------------- metric histories


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """Value per logging step, in step order; where a step was logged twice, the later write wins."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in points}


def cumulative(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """Running total of `key` per step: the logged `<key>_cum` when present (it survives a resume,
    which a sum over this run's history would not), else the running sum of the per-iteration values."""
    if logged := history(client, run_id, f"{key}_cum"):
        return logged
    per_iteration = history(client, run_id, key)
    totals = np.cumsum(list(per_iteration.values())).tolist()
    return dict(zip(per_iteration, totals, strict=True))


def curve(
    client: MlflowClient, run_id: str, y_key: str, x_key: str = LEAVES
) -> tuple[list[float], list[float]]:
    """(cumulative `x_key`, `y_key`) at the steps where both were logged."""
    x, y = cumulative(client, run_id, x_key), history(client, run_id, y_key)
    steps = [s for s in y if s in x]
    return [x[s] for s in steps], [y[s] for s in steps]


# --------------------------------------------------------------------------- the table


def run_summary(client: MlflowClient, run: Run, metric: str = SUCCESS) -> dict[str, Any]:
    """One table row. Missing metrics give NaN (the row still shows tags and wall time), so a run
    trained before the rollout callbacks existed can sit next to a newer one."""
    run_id, name = run.info.run_id, metric.rsplit("/", 1)[-1]
    values = list(history(client, run_id, metric).values())
    effective = list(history(client, run_id, EFFECTIVE).values())
    leaves, tokens = cumulative(client, run_id, LEAVES), cumulative(client, run_id, TOKENS)
    best = min if any(part in name for part in LOWER_IS_BETTER) else max
    return {
        "run": run.info.run_name or "",
        "id": run_id[:SHORT_ID],
        **{tag: run.data.tags.get(tag, "") for tag in TAGS},
        f"{name}_final": _last(values),
        f"{name}_best": best(values) if values else math.nan,
        "effective_ratio_final": _last(effective),
        "effective_ratio_mean": float(np.mean(effective)) if effective else math.nan,
        "leaves_total": _last(list(leaves.values())),
        "tokens_total": _last(list(tokens.values())),
        "iterations": max(len(values), len(effective), len(leaves)),
        "wall_s": _wall_seconds(run),
    }


def _last(values: list[float]) -> float:
    return float(values[-1]) if values else math.nan


def _wall_seconds(run: Run) -> float:
    """End minus start; NaN while the run is still going (MLflow has no end time yet)."""
    if run.info.end_time is None or run.info.start_time is None:
        return math.nan
    return float(run.info.end_time - run.info.start_time) / 1000.0


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain aligned text: text columns left, numbers right; NaN shows as '-'."""
    if not rows:
        return "(no runs)"
    columns = list(dict.fromkeys(c for row in rows for c in row))
    cells = [[_cell(c, row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    numeric = [not isinstance(rows[0].get(c), str) for c in columns]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        )

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(column: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    if column.endswith("_total") or column == "iterations":
        return f"{value:.0f}"
    return f"{value:.1f}" if column == "wall_s" else f"{value:.3f}"


# --------------------------------------------------------------------------- plots


def label(run: Run) -> str:
    """Allocator tag plus short id: run names can repeat (runs with the same seed have been seen to draw
    the same name), ids cannot."""
    return f"{run.data.tags.get('allocator', '?')} {run.info.run_id[:SHORT_ID]}"


def plot_curves(curves: list[Curve], x_key: str, y_key: str, path: Path) -> Path:
    """One line per run. `Figure` renders through the Agg canvas by itself, so the process-wide pyplot
    backend is left alone (this also runs inside notebooks and on headless machines)."""
    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for name, x, y in curves:
        ax.plot(x, y, marker="o", markersize=3, label=name)
    ax.set_xlabel(f"cumulative {x_key.rsplit('/', 1)[-1]} spent")
    ax.set_ylabel(y_key)
    ax.set_title(f"{y_key} against {x_key.rsplit('/', 1)[-1]} spent")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def write_plots(
    client: MlflowClient, runs: Sequence[Run], out_dir: Path, metric: str = SUCCESS
) -> list[Path]:
    """`metric` and the effective ratio against cumulative leaves, and against tokens where logged.
    A plot that no run has data for is skipped rather than drawn empty; returns the files written."""
    written = []
    for y_key in dict.fromkeys([metric, EFFECTIVE]):
        for x_key in (LEAVES, TOKENS):
            curves = [(label(r), *curve(client, r.info.run_id, y_key, x_key)) for r in runs]
            curves = [c for c in curves if c[1]]
            if curves:
                name = f"{y_key.replace('/', '_')}_vs_{x_key.rsplit('/', 1)[-1]}.png"
                out_dir.mkdir(parents=True, exist_ok=True)
                written.append(plot_curves(curves, x_key, y_key, out_dir / name))
    return written


# --------------------------------------------------------------------------- tree artifacts


def tree_artifacts(client: MlflowClient, run_id: str) -> list[str]:
    """Paths of the run's `trees/iteration_NNNN.json` artifacts, oldest iteration first."""
    return sorted(a.path for a in client.list_artifacts(run_id, "trees") if a.path.endswith(".json"))


def load_trees(client: MlflowClient, run_id: str, path: str) -> list[RolloutTree]:
    """The trees of one iteration artifact: either the callbacks' record (a dict whose `trees` holds
    the tree dicts) or a bare list of tree dicts."""
    with tempfile.TemporaryDirectory() as tmp:
        data = json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())
    items = data["trees"] if isinstance(data, dict) else data
    return [RolloutTree.from_dict(item) for item in items]


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trace_lightning.compare",
        description="Compare MLflow runs of trace_lightning: a table, and curves against budget spent.",
    )
    parser.add_argument("--tracking-uri", default="sqlite:///outputs/mlflow.db", help="the MLflow store")
    parser.add_argument(
        "--experiment", default="trace_lightning", help="compare every run of this experiment"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        metavar="ID",
        help="compare these runs instead (full ids, or short ids as printed)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/compare"), help="folder for the PNG plots")
    parser.add_argument("--metric", default=SUCCESS, help="headline metric: table final/best and first plot")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        client = open_client(args.tracking_uri)
        runs = find_runs(client, args.experiment, args.runs)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table([run_summary(client, run, args.metric) for run in runs]))
    written = write_plots(client, runs, args.out, args.metric)
    if not written:
        print(f"\nno plots: none of these runs logged {args.metric} or {EFFECTIVE} with {LEAVES}")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
