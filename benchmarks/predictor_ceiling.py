"""The predictor against what the root can know, on the learning testbed (`benchmarks/learning.py`).

    python benchmarks/predictor_ceiling.py            # 2 seeds of trace, a probe every 2 iterations (~2 min)
    python benchmarks/predictor_ceiling.py --quick    # the test suite's smoke run

`trace` runs as in the learning benchmark (same warm start, testbed and seeds), with the Monte Carlo
probe (16 fresh episodes of each of the 64 candidates) every `--probe-every` iterations; the probe's
per-candidate outcomes are kept. For every probe after the first two, averaged:

- head: Spearman of the online head's raw root predictions with the probed rates (as learning.py);
- noise ceiling: what knowing each candidate's true rate would reach against this probe
  (`gauges.noise_ceiling`: the halves' Spearman, stepped up by Spearman-Brown);
- root oracle: a gradient-boosted regressor (scikit-learn, in the dev extra) on the task attributes
  a prompt shows before any turn (shift, mistakes allowed, keys, letters, which key shifts, the first
  cue) and the iteration, fitted on the probed rates of every earlier probe: clean, unbiased labels
  for every candidate, dozens of times what training gives the head. Roughly the best a root
  predictor can do on this testbed;
- full oracle: the same, also told what the prompt does not show (every key's letter).

Between the oracles and the noise ceiling lies what the task's attributes do not tell, even with
clean labels from many other tasks: how this policy does on this particular task, which only playing
it (or many earlier visits to it) reveals. `true_v`'s fresh episodes see it; a root prediction made
before any turn does not.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from learning import parse_args as learning_args
from learning import run_seeds, shared_warm_start, shipped_config, testbed
from sklearn.ensemble import HistGradientBoostingRegressor

from trace_lightning import gauges
from trace_lightning.envs.decisive import DecisiveTask

EARLIER = 2  # probes before the first one scored: the oracles need something to fit


def root_attributes(task: DecisiveTask) -> list[float]:
    """What the question shows: "3 keys, 0 errors ok, A-H. Key 2 +2. Key 1: C." (the first cue is the
    shifted letter when the first key is the decisive one)."""
    first = ord(task.answer(0)) - ord("A")
    return [task.shift, task.tolerance, task.turns, task.n_letters, task.decisive, first]


def all_attributes(task: DecisiveTask) -> list[float]:
    """The root's attributes and every key's letter (-1 past the last key)."""
    letters = [ord(x) - ord("A") for x in task.shown] + [-1] * (4 - task.turns)
    return root_attributes(task) + letters


def oracle_spearman(
    probes: list[dict[str, Any]], i: int, tasks: dict[int, DecisiveTask], full: bool
) -> float:
    """Fit on probes[:i] (attributes + iteration -> probed rate), score probe i."""
    features = all_attributes if full else root_attributes

    def rows(p: dict[str, Any]) -> list[list[float]]:
        return [[*features(tasks[t]), p["iteration"]] for t in p["task_ids"]]

    x = [r for p in probes[:i] for r in rows(p)]
    y = [v for p in probes[:i] for v in rates(p)]
    model = HistGradientBoostingRegressor(max_iter=200, learning_rate=0.05, max_leaf_nodes=15, random_state=0)
    model.fit(np.array(x), np.array(y))
    return gauges.spearman(model.predict(np.array(rows(probes[i]))), rates(probes[i]))


def rates(p: dict[str, Any]) -> np.ndarray:
    """A probe's success rate per candidate, over both halves."""
    return (np.array(p["half_a"]) + np.array(p["half_b"])) / p["episodes"]


def score_run(run: dict[str, Any], tasks: dict[int, DecisiveTask]) -> dict[str, float]:
    probes = run["probe_rates"]
    cols: dict[str, list[float]] = {"head": [], "noise_ceiling": [], "root_oracle": [], "full_oracle": []}
    for i in range(EARLIER, len(probes)):
        p = probes[i]
        cols["head"].append(gauges.spearman(np.array(p["predicted"]), rates(p)))
        cols["noise_ceiling"].append(gauges.noise_ceiling(np.array(p["half_a"]), np.array(p["half_b"])))
        cols["root_oracle"].append(oracle_spearman(probes, i, tasks, full=False))
        cols["full_oracle"].append(oracle_spearman(probes, i, tasks, full=True))
    return {k: _mean(v) for k, v in cols.items()} | {"probes": len(cols["head"])}


def _mean(values: list[float]) -> float:
    """The mean of the finite values (NaN: none; a probe where nothing varies has no Spearman)."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run for the test suite")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--probe-every", type=int, default=2)
    p.add_argument("--cache", type=Path, default=Path("benchmarks/results/.cache"), help="warm-start cache")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/predictor_ceiling.json"))
    own = p.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp())
    shared = ["--methods", "trace", "--probe-every", str(own.probe_every), "--cache", str(own.cache)]
    shared += ["--out", str(run_dir / "runs.json"), "--seeds", *map(str, own.seeds)]
    args = learning_args([*shared, "--quick"] if own.quick else shared)
    if own.quick:
        args.iterations, args.eval_every, args.seeds = 6, 3, own.seeds[:1]  # a probe every iteration
    args.probe_rates = True
    torch.set_num_threads(1)
    clock = time.perf_counter()
    args.trainer, args.experiment = shipped_config(str(run_dir))
    shared_warm_start(args)  # once, before the workers start
    args.workers = own.workers
    results = list(run_seeds(args, args.seeds).values())
    tasks = testbed(args)[0].by_id
    per_seed = [{"seed": r["seed"], **score_run(r["runs"][0], tasks)} for r in results]
    columns = ("head", "root_oracle", "full_oracle", "noise_ceiling")
    print(f"\n{'seed':>4s} {'probes':>6s}" + "".join(f"{c.replace('_', ' '):>14s}" for c in columns))
    for s in per_seed:
        print(f"{s['seed']:4d} {s['probes']:6d}" + "".join(f"{s[c]:14.3f}" for c in columns))
    mean = {k: float(np.mean([s[k] for s in per_seed])) for k in columns}
    print("mean       " + "".join(f"{mean[c]:14.3f}" for c in columns))
    print(
        f"head / root oracle {mean['head'] / mean['root_oracle']:.2f}; "
        f"total {time.perf_counter() - clock:.0f} s"
    )
    own.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(own).items()}
    own.out.write_text(json.dumps({"config": config, "mean": mean, "per_seed": per_seed, "runs": results}))


if __name__ == "__main__":
    main()
