"""`python -m trace_lightning.compare`: MLflow runs side by side, and their curves against budget spent.

    python -m trace_lightning.compare                          # every run of experiment trace_lightning
    python -m trace_lightning.compare --runs 1a2b3c4d 5e6f7a8b # chosen runs (full or short ids)
    python -m trace_lightning.compare --x tokens tool_calls seconds   # success against other units
    python -m trace_lightning.compare --tracking-uri sqlite:///outputs/mlflow.db --out outputs/compare

The table leads with each run's held-out pass@1 and its standard error (the last evaluation of
`callbacks.HeldOutSuccess`), then names its base model and warm start. Training success per iteration
follows which prompts were drawn, so it comes later. Allocators are compared at an equal budget, so the
plots put a cumulative budget unit on the x-axis rather than iterations: leaves, generated tokens,
prefill tokens, tool calls or seconds (`--x`; `metrics.budget_spend`, `budget_seconds`). A run that
gets more out of each unit shows up as a curve that rises sooner. The metric keys are the ones
`trace_lightning.callbacks` logs (computed in `trace_lightning.metrics`); the functions here only read
them, and printing stays in `main`.

A store's names, tags and values are read as hostile input (a run name is whatever its creator typed,
or a model wrote): control characters print escaped (`\\x1b`, `\\n`), so no cell can recolour the
terminal or forge a table row; `$` in plot labels is escaped, so matplotlib's mathtext never parses it;
points that cannot be placed (a negative, fractional, out-of-range or non-finite
`eval/iterations_trained`, a non-finite value) are left out of the plots, and counted in the output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from trace_lightning.metrics import BUDGET_UNITS
from trace_lightning.tree import RolloutTree

HELD_OUT = "eval/pass_at_1"  # the headline: held-out success (its SE is logged as <key>_se)
TRAINED = "eval/iterations_trained"  # logged with every evaluation: where it sits on a budget axis
SUCCESS, EFFECTIVE = "rollout/success_rate", "rollout/effective_ratio"
LEAVES, TOKENS = "budget/leaves", "budget/tokens"
# --x choices: the per-iteration key whose running sum is the x-axis, one per budget unit
UNITS = {unit: f"budget/{unit}" for unit in BUDGET_UNITS}
TAGS = ("base_model", "warm_start", "allocator", "env")  # what the trainer tags every run with
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
    """(cumulative `x_key` spent, `y_key`) at each point where `y_key` was logged: `curve_points`
    without its count of points left out."""
    x, y, _ = curve_points(client, run_id, y_key, x_key)
    return x, y


def curve_points(
    client: MlflowClient, run_id: str, y_key: str, x_key: str = LEAVES
) -> tuple[list[float], list[float], int]:
    """(cumulative `x_key` spent, `y_key`, points left out) at each point where `y_key` was logged.

    A per-iteration metric is logged at the same step as the iteration's running sums. An evaluation
    (`eval/*`) is placed by the iterations it followed (`eval/iterations_trained`): x = 0 before any
    training, the running sum of iterations 0..k-1 after k. (Lightning logs an epoch's metrics at its
    last batch's step and the evaluation after it one step later, and a first epoch of one batch logs
    at step 0, where the evaluation before training also sits: steps alone cannot place it.)

    A point whose place or value is not a finite number, or whose `eval/iterations_trained` is not an
    iteration this run logged (negative, fractional, past its last), is left out and counted: a store
    may hold anything, and a plot must not fail, nor draw an evaluation at a made-up budget."""
    x, y = cumulative(client, run_id, x_key), history(client, run_id, y_key)
    if not x:  # this run never logged the unit: no curve (rather than a lone point at 0)
        return [], [], 0
    trained = history(client, run_id, TRAINED) if y_key.startswith("eval/") else {}
    if trained:
        spent = [0.0, *(x[s] for s in sorted(x))]  # after 0, 1, 2, ... iterations
        pairs = [(_spent_after(spent, trained[s]), v) for s, v in y.items() if s in trained]
    else:
        pairs = [(x[s], v) for s, v in y.items() if s in x]
    kept = [(a, b) for a, b in pairs if a is not None and math.isfinite(a) and math.isfinite(b)]
    return [p[0] for p in kept], [p[1] for p in kept], len(pairs) - len(kept)


def _spent_after(spent: list[float], iterations: float) -> float | None:
    """The budget spent after `iterations` iterations, or None when this run has no such count (a
    negative one would otherwise index `spent` from its end)."""
    if not (math.isfinite(iterations) and iterations == int(iterations) and 0 <= iterations < len(spent)):
        return None
    return spent[int(iterations)]


# --------------------------------------------------------------------------- the table


def run_summary(client: MlflowClient, run: Run, metric: str = HELD_OUT) -> dict[str, Any]:
    """One table row: the headline `metric` (the last value, its `_se` when logged, and for a metric
    logged every iteration its best), the run's models, the budget spent in every unit and the wall
    time. Missing metrics give NaN, so a run trained before a metric existed still sits in the table."""
    run_id, tags = run.info.run_id, run.data.tags
    name = ("held_out_" if metric.startswith("eval/") else "") + metric.rsplit("/", 1)[-1]
    values = list(history(client, run_id, metric).values())
    effective = list(history(client, run_id, EFFECTIVE).values())
    row: dict[str, Any] = {
        "run": run.info.run_name or "",
        "id": run_id[:SHORT_ID],
        "base_model": tags.get("base_model", tags.get("model", "")),  # older runs tag "model"
        **{tag: tags.get(tag, "") for tag in TAGS[1:]},
        name: _last(values),
        f"{name}_se": _last(list(history(client, run_id, f"{metric}_se").values())),
    }
    if not metric.startswith("eval/"):  # an evaluation's best would be chosen on the test set itself
        best = min if any(part in name for part in LOWER_IS_BETTER) else max
        row[f"{name}_best"] = best(values) if values else math.nan
    totals = {unit: _last(list(cumulative(client, run_id, key).values())) for unit, key in UNITS.items()}
    return row | {
        "train_success_last": _last(list(history(client, run_id, SUCCESS).values())),
        "effective_ratio_mean": float(np.mean(effective)) if effective else math.nan,
        "iterations": max(len(effective), len(cumulative(client, run_id, LEAVES))),
        **{f"{unit}_total": total for unit, total in totals.items()},
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
    keys = list(dict.fromkeys(c for row in rows for c in row))
    cells = [[_cell(c, row.get(c)) for c in keys] for row in rows]
    columns = [visible(c) for c in keys]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    numeric = [not isinstance(rows[0].get(c), str) for c in keys]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        )

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(column: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return visible(value)
    if column == "seconds_total" or column == "wall_s":
        return f"{value:.1f}"
    if column.endswith("_total") or column == "iterations":
        return f"{value:.0f}"
    return f"{value:.3f}"


def visible(text: str) -> str:
    """`text` with every control, format or surrogate character written as its escape (`\\x1b`, `\\n`,
    `\\u202e`): a run name or tag printed raw could recolour the terminal, move its cursor, forge a row
    of the table or reverse the text after it."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# --------------------------------------------------------------------------- plots


def plain(text: str) -> str:
    """`text` as matplotlib shows it literally: an even number of `$` would make it parse the text as
    mathtext, which raises on most tags (`$\\frac{$`) and so loses the whole figure."""
    return visible(text).replace("$", r"\$")


def label(run: Run) -> str:
    """Allocator tag plus short id: run names can repeat (runs with the same seed have been seen to draw
    the same name), ids cannot."""
    return f"{run.data.tags.get('allocator', '?')} {run.info.run_id[:SHORT_ID]}"


def plot_curves(
    curves: list[Curve], x_key: str, y_key: str, path: Path, errors: list[list[float]] | None = None
) -> Path:
    """One line per run, with ±1 standard error bars where `errors` gives them. `Figure` renders through
    the Agg canvas by itself, so the process-wide pyplot backend is left alone (this also runs inside
    notebooks and on headless machines)."""
    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for i, (name, x, y) in enumerate(curves):
        err = errors[i] if errors is not None and len(errors[i]) == len(y) else None
        ax.errorbar(x, y, yerr=err, marker="o", markersize=3, capsize=3 if err else 0, label=plain(name))
    unit = x_key.rsplit("/", 1)[-1]
    ax.set_xlabel(plain(f"cumulative {unit} spent"))
    ax.set_ylabel(plain(y_key + (" (± SE)" if errors is not None else "")))
    ax.set_title(plain(f"{y_key} against {unit} spent"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def write_plots(
    client: MlflowClient,
    runs: Sequence[Run],
    out_dir: Path,
    metric: str = HELD_OUT,
    units: Sequence[str] = ("leaves", "tokens"),
) -> list[Path]:
    """`metric` (with its SE bars where logged) and the effective ratio against each cumulative budget
    unit in `units` (keys of `UNITS`). A plot that no run has data for is skipped rather than drawn
    empty; returns the files written (`plot_all` also counts the points left out)."""
    return plot_all(client, runs, out_dir, metric, units).written


@dataclass
class PlotReport:
    """The plots written, and per plot and run the points left out (`curve_points`)."""

    written: list[Path] = field(default_factory=list)
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)  # (plot file, short run id): count


def plot_all(
    client: MlflowClient,
    runs: Sequence[Run],
    out_dir: Path,
    metric: str = HELD_OUT,
    units: Sequence[str] = ("leaves", "tokens"),
) -> PlotReport:
    """`write_plots`, reporting the points left out as well as the files written."""
    report = PlotReport()
    for y_key in dict.fromkeys([metric, EFFECTIVE]):
        for unit in units:
            _plot_one(client, runs, out_dir / f"{y_key.replace('/', '_')}_vs_{unit}.png", y_key, unit, report)
    return report


def _plot_one(
    client: MlflowClient, runs: Sequence[Run], path: Path, y_key: str, unit: str, report: PlotReport
) -> None:
    """One plot of `y_key` against `unit`, added to `report` (nothing written when no run has a point)."""
    x_key = UNITS[unit]
    points = [curve_points(client, r.info.run_id, y_key, x_key) for r in runs]
    for run, (_, _, skipped) in zip(runs, points, strict=True):
        if skipped:
            report.skipped[(path.name, run.info.run_id[:SHORT_ID])] = skipped
    curves = [(label(r), x, y) for r, (x, y, _) in zip(runs, points, strict=True)]
    errors = [_se_values(client, r.info.run_id, y_key) for r in runs]
    keep = [i for i, c in enumerate(curves) if c[1]]
    if keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        bars = [errors[i] for i in keep] if any(errors[i] for i in keep) else None
        report.written.append(plot_curves([curves[i] for i in keep], x_key, y_key, path, bars))


def _se_values(client: MlflowClient, run_id: str, key: str) -> list[float]:
    """The standard errors logged beside `key` (`<key>_se`), one per logged value, or []."""
    se, values = history(client, run_id, f"{key}_se"), history(client, run_id, key)
    return [se[s] for s in values] if se and all(s in se for s in values) else []


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
    parser.add_argument(
        "--metric", default=HELD_OUT, help="headline metric: the table's first figures and the first plot"
    )
    parser.add_argument(
        "--x",
        nargs="+",
        choices=sorted(UNITS),
        default=["leaves", "tokens"],
        help="budget units for the x-axes (running sums of budget/<unit>)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        client = open_client(args.tracking_uri)
        runs = find_runs(client, args.experiment, args.runs)
    except CompareError as err:
        print(f"error: {visible(str(err))}", file=sys.stderr)  # it may quote the store's names
        return 2
    print(format_table([run_summary(client, run, args.metric) for run in runs]))
    report = plot_all(client, runs, args.out, args.metric, args.x)
    if not report.written:
        keys = ", ".join(UNITS[u] for u in args.x)
        print(f"\nno plots: none of these runs logged {args.metric} or {EFFECTIVE} with {keys}")
    for (plot, run_id), count in report.skipped.items():
        print(
            f"{plot}: left out {count} point(s) of run {run_id} that cannot be placed (a value that is not "
            f"finite, or {TRAINED} negative, fractional, not finite or past the run's last iteration)"
        )
    for path in report.written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
