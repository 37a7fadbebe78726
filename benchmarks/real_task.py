"""The default job, measured: SmolLM2-135M-Instruct from its math_tool warm start, trained by the
product's own command (`python -m trace_lightning.trainer`, vLLM engine), and TRACE against GRPO on it.

    make run                                       # builds the warm start once (outputs/warm_start/...)
    python benchmarks/real_task.py default         # the default job: benchmarks/results/default_job.json
    python benchmarks/real_task.py default --extra trainer.max_epochs=32 --out /tmp/twice.json
    python benchmarks/real_task.py compare --seeds 0,1,2   # trace vs uniform: results/real_learning.json

Every run is one trainer process with the overrides printed in the JSON, timed from start to exit
(`trainer_seconds`: engine start-up and the held-out evaluations included). The figures come from the
run's own `summary.json` (console.RunSummary): the held-out learning curve (greedy pass@1 on the
200 problems the warm start never saw), its change since the start paired by problem, and each
iteration's mixed roots, mixed prefixes, leaves, generated tokens and optimizer steps.

`compare` runs the default job (`allocator=trace advantage=tree_grpo`) and `allocator=uniform
advantage=grpo` (GRPO: 12 problems x 4 episodes) at the same leaves, the same optimizer steps
(`data.steps_per_iteration`), the same seeds and the same warm start; trace's seed 0 is the default
job's own run where `default` already made it in the same `--work` folder. With `--probe N` the
first method's second seed also runs the predictor's Monte Carlo probe every N iterations
(`callbacks=probe`), outside the budget: it trains nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WARM_START = "outputs/warm_start/smollm2-math_tool/model"
METHODS = {  # the default job is trace; GRPO is uniform groups of 4 with its group-mean advantage
    "trace": [],
    "uniform": ["allocator=uniform", "advantage=grpo"],
}


def train(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One trainer process; its summary record plus the command and its wall time. A run this work
    folder already finished with the same command is read back, not run again (`compare` reuses the
    default job's run as trace's first seed)."""
    command = [sys.executable, "-m", "trace_lightning.trainer", *overrides]
    shown = " ".join(["python", *command[1:]])
    done = run_dir.with_suffix(".run.json")
    if done.is_file() and json.loads(done.read_text())["command"] == shown:
        print("reused:", shown, flush=True)
        return json.loads(done.read_text())
    print("$", shown, flush=True)
    began = time.perf_counter()
    with open(run_dir.with_suffix(".console.log"), "w") as console:
        run = [*command, f"run_dir={run_dir}"]
        subprocess.run(run, cwd=ROOT, check=True, stdout=console, stderr=subprocess.STDOUT)
    record = json.loads((run_dir / "summary.json").read_text())
    record = {"command": shown, "trainer_seconds": time.perf_counter() - began} | record
    done.write_text(json.dumps(record) + "\n")
    return record


def per_iteration(record: dict[str, Any], field: str) -> list[float]:
    return [float(it[field]) for it in record["iterations"]]


def default_job(args: argparse.Namespace) -> None:
    Path(args.work).mkdir(parents=True, exist_ok=True)
    record = train([f"model.warm_start={args.warm_start}", *args.extra], Path(args.work) / "trace_seed0")
    held = record["held_out"]
    out = {
        "env": "math_tool (difficulty 2: two-step word problems, a calculator call per step)",
        "command": record["command"],
        "trainer_seconds": record["trainer_seconds"],
        "fit_seconds": record["wall_seconds"],
        "held_out": {
            k: held[k]
            for k in (
                "tasks",
                "samples",
                "temperature",
                "start",
                "final",
                "change",
                "change_se",
                "point_se_max",
                "curve",
            )
        },
        "change_over_se": held["change"] / held["change_se"],
        "optimizer_steps": sum(per_iteration(record, "optimizer_steps")),
        "train_success": per_iteration(record, "success_rate"),
        "mixed_roots": per_iteration(record, "mixed_roots"),
        "mixed_prefixes": per_iteration(record, "mixed_prefixes"),
        "targets": {
            "change >= 0.10": held["change"] >= 0.10,
            "change / change_se >= 3": held["change"] / held["change_se"] >= 3,
            "point_se_max <= 0.04": held["point_se_max"] <= 0.04,
            "trainer_seconds <= 1200": record["trainer_seconds"] <= 1200,
        },
    }
    out_path = Path(args.out or RESULTS / "default_job.json")
    write(out_path, out)
    plot_curve(out["held_out"], out_path.with_suffix(".png"))


def plot_curve(held: dict[str, Any], path: Path) -> None:
    """The held-out curve with its standard errors, as the README shows it."""
    from matplotlib.figure import Figure

    x = [p["iterations"] for p in held["curve"]]
    y = [p["pass_at_1"] for p in held["curve"]]
    se = [p["pass_at_1_se"] for p in held["curve"]]
    fig = Figure(figsize=(5.5, 3.2), dpi=120)
    ax = fig.subplots()
    ax.errorbar(x, y, yerr=se, marker="o", capsize=3, color="tab:blue")
    ax.axhline(held["start"], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training iterations (48 trajectories, 4 optimizer steps each)")
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.set_title(
        f"{held['tasks']} held-out problems: {held['change']:+.3f} ± {held['change_se']:.3f} (paired)",
        fontsize=9,
    )
    ax.set_xticks(x)
    fig.tight_layout()
    fig.savefig(path)


def compare(args: argparse.Namespace) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = args.methods.split(",")
    out_path = Path(args.out or RESULTS / "real_learning.json")
    runs: dict[str, dict[str, Any]] = {m: {} for m in methods}
    began = time.perf_counter()
    for seed in seeds:  # seed-major: a cut-off run still holds paired seeds
        for m in methods:
            probe = bool(args.probe) and m == methods[0] and seed == seeds[min(1, len(seeds) - 1)]
            overrides = [  # seed 0 of trace is the default job's command exactly
                f"model.warm_start={args.warm_start}",
                # another training seed, the same problems and held-out split as the warm start's (seed 0)
                *([f"seed={seed}", "env.seed=0", "data.split_seed=0"] if seed else []),
                *METHODS[m],
                *(["callbacks=probe", f"callbacks.probe.every_n_epochs={args.probe}"] if probe else []),
                *args.extra,
            ]
            runs[m][str(seed)] = train(overrides, Path(args.work) / f"{m}_seed{seed}")
            write(out_path, report(runs, seeds, args, time.perf_counter() - began))


def report(
    runs: dict[str, dict[str, Any]], seeds: list[int], args: argparse.Namespace, seconds: float
) -> dict[str, Any]:
    results = {}
    for m, by_seed in runs.items():
        seeds_done = [s for s in seeds if str(s) in by_seed]
        done = [by_seed[str(s)] for s in seeds_done]
        if not done:
            continue
        deltas = [r["held_out"]["change"] for r in done]
        mixed = [float(np.mean(per_iteration(r, "mixed_roots"))) for r in done]
        results[m] = {
            "seeds": [s for s in seeds if str(s) in by_seed],
            "heldout_before": float(np.mean([r["held_out"]["start"] for r in done])),
            "heldout_after": float(np.mean([r["held_out"]["final"] for r in done])),
            "heldout_delta": float(np.mean(deltas)),
            "heldout_delta_se": float(np.std(deltas, ddof=1) / np.sqrt(len(deltas)))
            if len(done) > 1
            else done[0]["held_out"]["change_se"],
            "final_per_seed": [r["held_out"]["final"] for r in done],
            "final_se_per_seed": [r["held_out"]["curve"][-1]["pass_at_1_se"] for r in done],
            "heldout_delta_per_seed": deltas,
            "heldout_delta_se_per_seed": [r["held_out"]["change_se"] for r in done],
            "mixed_prompts_per_iteration": float(np.mean(mixed)),
            "mixed_prompts_per_iteration_per_seed": mixed,
            "mixed_prefixes_per_iteration": float(
                np.mean([np.mean(per_iteration(r, "mixed_prefixes")) for r in done])
            ),
            "train_success": [per_iteration(r, "success_rate") for r in done],
            "leaves_per_iteration": per_iteration(done[0], "leaves"),
            "optimizer_steps": [sum(per_iteration(r, "optimizer_steps")) for r in done],
            "tokens": [sum(per_iteration(r, "tokens")) for r in done],
            "trainer_seconds": [r["trainer_seconds"] for r in done],
            **{f"probe_seed{s}": r["probe"] for s, r in zip(seeds_done, done, strict=True) if "probe" in r},
        }
    verdicts = []
    if {"trace", "uniform"} <= results.keys():
        paired = [s for s in results["trace"]["seeds"] if s in results["uniform"]["seeds"]]
        t = {s: f for s, f in zip(results["trace"]["seeds"], results["trace"]["final_per_seed"], strict=True)}
        u = {
            s: f
            for s, f in zip(results["uniform"]["seeds"], results["uniform"]["final_per_seed"], strict=True)
        }
        wins = sum(t[s] >= u[s] for s in paired)
        ratio = results["trace"]["mixed_prompts_per_iteration"] / max(
            results["uniform"]["mixed_prompts_per_iteration"], 1e-9
        )
        verdicts = [
            f"trace's final held-out pass@1 >= uniform's in {wins} of {len(paired)} paired seeds",
            f"mixed prompts per iteration: trace / uniform = {ratio:.2f}",
        ]
    return {
        "config": {"warm_start": args.warm_start, "methods": list(runs), "seeds": seeds, "extra": args.extra},
        "overrides": {m: METHODS[m] for m in runs},
        "results": results,
        "verdicts": verdicts,
        "runs": runs,
        "seconds": seconds,
    }


def write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(
        json.dumps(
            {k: record[k] for k in ("held_out", "targets", "results", "verdicts") if k in record},
            indent=1,
            default=str,
        )[:3000]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["default", "compare"])
    parser.add_argument("--warm-start", default=WARM_START)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="trace,uniform")
    parser.add_argument(
        "--probe",
        type=int,
        default=0,
        help="every this many iterations, the predictor probe on the first method's second seed (0: none)",
    )
    parser.add_argument("--extra", nargs="*", default=[], help="more trainer overrides, for every run")
    parser.add_argument("--work", default="outputs/real_task", help="where the runs' folders go")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw default_job.png from its JSON")
    args = parser.parse_args()
    if args.plot_only:
        out_path = Path(args.out or RESULTS / "default_job.json")
        plot_curve(json.loads(out_path.read_text())["held_out"], out_path.with_suffix(".png"))
        return
    (default_job if args.what == "default" else compare)(args)


if __name__ == "__main__":
    main()
