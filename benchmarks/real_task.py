"""The default job, measured: SmolLM2-135M-Instruct from its math_tool warm start, trained by the
product's own command (`python -m trace_lightning.trainer`, vLLM engine), and TRACE against its
baselines on it at an equal sampling cost.

    make run                                       # builds the warm start once (outputs/warm_start/...)
    python benchmarks/real_task.py default         # the default job: benchmarks/results/default_job.json
    python benchmarks/real_task.py default --extra trainer.max_epochs=32 --out /tmp/twice.json
    python benchmarks/real_task.py pilot --tasks mixed     # its room: results/real_pilot_mixed.json
    python benchmarks/real_task.py compare --tasks mixed --methods grpo,trace --seeds 0,1,2 --tokens 1500 \
        --extra eval.every_n_iterations=8          # results/real_learning.json, tasks.mixed

Every run is one trainer process with the overrides printed in the JSON, timed from start to exit
(`trainer_seconds`: engine start-up and the held-out evaluations included). The figures come from the
run's own `summary.json` (console.RunSummary): the held-out learning curve (greedy pass@1 on the
200 problems the warm start never saw), its change since the start paired by problem, and each
iteration's mixed roots, mixed prefixes, leaves, generated tokens and optimizer steps.

`compare` runs every method of a task (`TASKS`: the mixed-difficulty task, where allocation has room,
difficulty 2 alone, the control, and levels 2 and 3 alone, `hard`) from the task's warm start (built
when missing), with the same seeds, the same
optimizer steps (`data.steps_per_iteration`) and the same budget of generated tokens per iteration
(`budget.unit=tokens`: each method's leaves follow what its own leaves cost, at most `--max-leaves`).
Each finished run is kept in `benchmarks/results/real_task_runs/` (commit it as it lands): a later call
reads it back instead of running it again, so the comparison completes in parts, across sessions.
With `--probe N` trace's second seed also runs the predictor's Monte Carlo probe every N iterations
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
# The earlier default, for the runs recorded under it: Stage 1 steered by success rates pooled by the
# task's attributes behind a gate at 0.25, and Stage 2 priced at each bucket's posterior mean, uncapped
POOLED = ["selection.attributes=true", "selection.gate_skill=0.25"]
MEAN_PRICED = ["allocator.pricing.confidence=0.0", "allocator.pricing.growth=null"]
HEAD_GATE0 = ["selection.attributes=false", "selection.gate_skill=0.0"]  # the default's selection, spelt out
GRPO = ["allocator=uniform", "advantage=grpo"]
# A method's training seed is the run's plus its offset here (0 for the others): grpo_reseeded is GRPO
# again on another stream (pools, sampling, the head's init), so its distance from `grpo` on the same seed
# is what one run's training noise alone moves the result
SEED_OFFSET = {"grpo_reseeded": 1000}
METHODS = {  # the default job is trace; GRPO is uniform groups of 4 with its group-mean advantage
    # the head's per-prompt estimates behind a gate at skill 0, Stage 2 priced one posterior std below the
    # mean with each bucket capped at its measured continuations (conf/train.yaml, conf/allocator/trace.yaml)
    "trace": [],
    "grpo": GRPO,
    "grpo_reseeded": GRPO,  # on the training seed SEED_OFFSET gives it
    "knapsack": ["allocator=knapsack", "advantage=grpo"],  # Knapsack RL on the same estimates as trace
    "trace_pooled": [*POOLED, *MEAN_PRICED],  # the earlier default
    # Knapsack RL on the earlier default's estimates
    "knapsack_pooled": ["allocator=knapsack", "advantage=grpo", *POOLED],
    # the variants screened on the way, each spelt out from today's default
    # the head's estimates steering every iteration, Stage 2 at the mean
    "trace_head": ["selection.attributes=false", "selection.gate_skill=null", *MEAN_PRICED],
    # the same behind the gate at 0
    "trace_head_gate0": [*HEAD_GATE0, *MEAN_PRICED],
    # and with Stage 1 alone (N = 0): the steered iterations' continuations gone, roots trained as GRPO's
    "trace_head_gate0_n0": [*HEAD_GATE0, *MEAN_PRICED, "allocator.expansion=0"],
    # and with Stage 2 kept, its tree advantages bounded (advantages.tree_grpo_bounded)
    "trace_head_gate0_bounded": [*HEAD_GATE0, *MEAN_PRICED, "advantage.bounded=true"],
    # the earlier default and the head gated at 0, with the turns sampled from one prefix sharing one
    # trajectory's weight (advantages.branch_weights)
    "trace_split": [*POOLED, *MEAN_PRICED, "advantage.branch_weight=true"],
    "trace_head_gate0_split": [*HEAD_GATE0, *MEAN_PRICED, "advantage.branch_weight=true"],
    # the head gated at 0 with Stage 2 priced in tokens that get a contrast, not leaves (pricing.py)
    "trace_head_gate0_tokens": [*HEAD_GATE0, *MEAN_PRICED, "allocator.pricing.worth=tokens"],
    # ... and with each bucket priced one posterior std below its mean flip rate, uncapped
    "trace_head_gate0_sure": [*HEAD_GATE0, "allocator.pricing.growth=null"],
    # the earlier default's selection with today's Stage 2
    "trace_sure_grow": POOLED,
    # today's default with Stage 1's estimates pooled by the task's attributes (one switch): on a task
    # whose difficulty is in its attributes (math_tool's steps) the head has to learn what they state
    "trace_attributes": ["selection.attributes=true"],
    # ... with steered root groups never smaller than GRPO's 4: on the control task the pooled rates
    # spread its roots over pairs and triples and it lost to GRPO; here steering only picks the prompts
    "trace_attributes_g4": ["selection.attributes=true", "allocator.min_group=4"],
    # ... with Stage 1 on one posterior sample per candidate (selection.thompson): a cell's candidates
    # no longer share one estimate, so the program spreads over cells whose rates are close
    "trace_attributes_thompson": ["selection.attributes=true", "selection.thompson=true"],
    # ... with each attribute cell capped at its share of the prompts GRPO would train (selection.cell_quota)
    "trace_attributes_quota": ["selection.attributes=true", "selection.cell_quota=1.0"],
}


RUNS = RESULTS / "real_task_runs"  # compare's finished runs, committed as they land: it resumes from them


def train(overrides: list[str], run_dir: Path, keep: Path | None = None) -> dict[str, Any]:
    """One trainer process; its summary record plus the command and its wall time. A run this work
    folder (or `keep`, where `compare` keeps its records) already finished with the same command is
    read back, not run again."""
    command = [sys.executable, "-m", "trace_lightning.trainer", *overrides]
    shown = " ".join(["python", *command[1:]])
    done = run_dir.with_suffix(".run.json")
    for path in (done, keep / done.name if keep is not None else None):
        if path is not None and path.is_file() and json.loads(path.read_text())["command"] == shown:
            print("reused:", shown, flush=True)
            return json.loads(path.read_text())
    print("$", shown, flush=True)
    began = time.perf_counter()
    with open(run_dir.with_suffix(".console.log"), "w") as console:
        run = [*command, f"run_dir={run_dir}"]
        subprocess.run(run, cwd=ROOT, check=True, stdout=console, stderr=subprocess.STDOUT)
    record = json.loads((run_dir / "summary.json").read_text())
    record = {"command": shown, "trainer_seconds": time.perf_counter() - began} | record
    done.write_text(json.dumps(record) + "\n")
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / done.name).write_text(json.dumps(record) + "\n")
    return record


def ensure_warm_start(model_dir: str, env: list[str]) -> None:
    """Build a task's warm start (`python -m trace_lightning.warmstart`, 64 demonstrations of the task) when
    its folder is missing, so a comparison resumed on a new machine needs no other step. The warm start is
    seeded: the same code builds the same model (each run records its held-out start, which shows it)."""
    folder = ROOT / model_dir
    if (folder / "warm_start.json").is_file():
        return
    command = [sys.executable, "-m", "trace_lightning.warmstart", *env, f"run_dir={folder.parent}"]
    print("$", " ".join(["python", *command[1:]]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def per_iteration(record: dict[str, Any], field: str) -> list[float]:
    return [float(it[field]) for it in record["iterations"]]


def default_job(args: argparse.Namespace) -> None:
    Path(args.work).mkdir(parents=True, exist_ok=True)
    ensure_warm_start(args.warm_start, [])
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


# The comparison's tasks: the mixed-difficulty task, where prompts range from decided to mixed and
# allocation has room, and difficulty 2 alone (the default job's task), the control where it has little.
TASKS: dict[str, dict[str, Any]] = {
    "mixed": {
        "env": ["env=math_tool_mixed"],
        "warm_start": "outputs/warm_start/smollm2-math_tool_mixed/model",
        "room": True,
        "methods": ["grpo", "trace", "knapsack"],
    },
    "control": {"env": [], "warm_start": WARM_START, "room": False, "methods": ["grpo", "trace"]},
    # levels 2 and 3 only: on the mixed task every run learned to answer after one calculator call, which
    # solves level 1 and nothing else; here no shortcut of that kind pays
    "hard": {
        "env": ["env=math_tool_mixed", "env.difficulty=[2,3]", "env.difficulty_weights=[1,1]"],
        "warm_start": "outputs/warm_start/smollm2-math_tool_hard/model",
        "room": True,
        "methods": ["grpo", "trace", "knapsack"],
    },
}


def compare(args: argparse.Namespace) -> None:
    """Every (task, seed, method) run at an equal budget of generated tokens per iteration and equal
    optimizer steps, seed-major so a cut-off comparison still holds paired seeds; finished runs are read
    back, so the comparison completes in parts (`--only` picks some runs)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = args.tasks.split(",")
    out_path = Path(args.out or RESULTS / "real_learning.json")
    record = json.loads(out_path.read_text()) if out_path.is_file() else {}
    budget = ["budget.unit=tokens", f"budget.max_tokens={args.tokens}", f"budget.leaves={args.max_leaves}"]
    began = time.perf_counter()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for task in tasks:
        spec, runs = TASKS[task], {}
        methods = args.methods.split(",") if args.methods else spec["methods"]
        for seed in seeds:  # the task's other methods are read back where kept, so the report has them all
            for m in dict.fromkeys([*methods, *spec["methods"]]):
                probe = bool(args.probe) and m == "trace" and seed == seeds[min(1, len(seeds) - 1)]
                overrides = [
                    f"model.warm_start={spec['warm_start']}",
                    *spec["env"],
                    # another training seed, the same problems and held-out split as the warm start's (seed 0)
                    f"seed={seed + SEED_OFFSET.get(m, 0)}",
                    "env.seed=0",
                    "data.split_seed=0",
                    *budget,
                    *METHODS[m],
                    *(["callbacks=probe", f"callbacks.probe.every_n_epochs={args.probe}"] if probe else []),
                    *args.extra,
                ]
                name = f"{task}_{m}_seed{seed}"
                path, kept = Path(args.work) / name, RUNS / f"{name}.run.json"
                if m not in methods or (args.only and name not in args.only.split(",")):
                    if not kept.is_file():
                        continue
                    runs.setdefault(m, {})[str(seed)] = json.loads(kept.read_text())  # an earlier part's
                else:
                    ensure_warm_start(spec["warm_start"], spec["env"])
                    runs.setdefault(m, {})[str(seed)] = train(overrides, path, keep=RUNS)
                record.setdefault("tasks", {})[task] = task_report(spec, runs, seeds, args)
                record["seconds_this_part"] = time.perf_counter() - began
                write(out_path, record)


def task_report(
    spec: dict[str, Any], runs: dict[str, dict[str, Any]], seeds: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """One task's figures per method: what the issue of fair comparison asks for, per seed where it
    varies, plus the paired differences to GRPO."""
    methods = {}
    for m, by_seed in runs.items():
        done = [(s, by_seed[str(s)]) for s in seeds if str(s) in by_seed]
        its = [r["iterations"] for _, r in done]
        methods[m] = {
            "overrides": METHODS[m],
            "seeds": [s for s, _ in done],
            "final_per_seed": [r["held_out"]["final"] for _, r in done],
            "final_se_per_seed": [r["held_out"]["curve"][-1]["pass_at_1_se"] for _, r in done],
            "final_by_problem": {  # seed -> {problem: pass@1}, where the run recorded it
                s: dict(
                    zip(
                        r["held_out"]["final_task_ids"],
                        [c / r["held_out"]["samples"] for c in r["held_out"]["final_successes"]],
                        strict=True,
                    )
                )
                for s, r in done
                if "final_successes" in r["held_out"]
            },
            "start_per_seed": [r["held_out"]["start"] for _, r in done],
            "curve_per_seed": [[p["pass_at_1"] for p in r["held_out"]["curve"]] for _, r in done],
            # held-out pass@1 by level at the start and the end (runs that recorded it)
            "by_group_start_final_per_seed": [
                [r["held_out"]["curve"][i].get("by_group") for i in (0, -1)] for _, r in done
            ],
            "tokens_per_seed": [sum(it["tokens"] for it in i) for i in its],
            "tokens_per_iteration_max_per_seed": [max(it["tokens"] for it in i) for i in its],
            "leaves_per_iteration_per_seed": [float(np.mean([it["leaves"] for it in i])) for i in its],
            "optimizer_steps_per_seed": [sum(it["optimizer_steps"] for it in i) for i in its],
            "mixed_share": float(np.mean([it["effective_ratio"] for i in its for it in i])),
            "mixed_prompts_per_iteration": float(np.mean([it["mixed_roots"] for i in its for it in i])),
            "prompts_per_iteration": float(np.mean([it.get("prompts", 0) for i in its for it in i])),
            "distinct_prompts_per_optimizer_step": float(
                np.mean([it.get("prompts", 0) / max(it["optimizer_steps"], 1) for i in its for it in i])
            ),
            # GRPO's uniform groups read no prediction, so a gate there would steer nothing
            "gate_open_share": None
            if m == "grpo"
            else float(np.mean([it.get("steered", True) for i in its for it in i])),
            "returned_leaves_per_iteration": float(
                np.mean([it.get("returned_leaves", 0) for i in its for it in i])
            ),
            "continuations_by_depth": _summed(
                [it.get("continuations_by_depth", []) for i in its for it in i]
            ),
            "flips_by_depth": _summed([it.get("flips_by_depth", []) for i in its for it in i]),
            **_stage_prices([it for i in its for it in i]),
            "gate_skill_last_per_seed": [i[-1].get("gate_skill") for i in its],
            "trainer_seconds_per_seed": [r["trainer_seconds"] for _, r in done],
            **{f"probe_seed{s}": r["probe"] for s, r in done if "probe" in r},
        }
    out = {
        "env": spec["env"],
        "warm_start": spec["warm_start"],
        "room": spec["room"],
        "budget": {"unit": "tokens", "per_iteration": args.tokens, "max_leaves": args.max_leaves},
        "extra": args.extra,
        "methods": methods,
    }
    if "grpo" in methods:
        out["versus_grpo"] = {m: _paired(methods[m], methods["grpo"]) for m in methods if m != "grpo"}
    return out


def _stage_prices(iterations: list[dict[str, Any]]) -> dict[str, float | None]:
    """What each stage spent and earned, in generated tokens, over the iterations that recorded
    `expand_tokens` (older runs did not): Stage 2's share of the tokens; mixed root groups per 1,000
    root-rollout tokens; mixed prefixes (the contrast only continuations create) per 1,000 continuation
    tokens."""
    iterations = [it for it in iterations if "expand_tokens" in it]
    if not iterations:
        return dict.fromkeys(
            ("expand_token_share", "mixed_roots_per_1k_root_tokens", "mixed_prefixes_per_1k_expand_tokens")
        )
    expand = sum(it["expand_tokens"] for it in iterations)
    roots = sum(it["tokens"] for it in iterations) - expand
    return {
        "expand_token_share": expand / max(expand + roots, 1),
        "mixed_roots_per_1k_root_tokens": 1000 * sum(it["mixed_roots"] for it in iterations) / max(roots, 1),
        "mixed_prefixes_per_1k_expand_tokens": (
            1000 * sum(it["mixed_prefixes"] for it in iterations) / expand if expand else None
        ),
    }


def _summed(rows: list[list[int]]) -> list[int]:
    width = max((len(r) for r in rows), default=0)
    return [sum(r[d] for r in rows if d < len(r)) for d in range(width)]


def _paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """a - b on the seeds both finished: final held-out pass@1 (mean, SE over seeds, wins), mixed share
    and mixed prompts as ratios."""
    common = [s for s in a["seeds"] if s in b["seeds"]]
    fa = dict(zip(a["seeds"], a["final_per_seed"], strict=True))
    fb = dict(zip(b["seeds"], b["final_per_seed"], strict=True))
    d = [fa[s] - fb[s] for s in common]
    # per seed, the difference paired by held-out problem (runs that recorded the final per-problem
    # successes): its SE counts only the two policies' disagreement, not the problems' difficulty
    by_problem = []
    for s in common:
        ra, rb = a["final_by_problem"].get(s), b["final_by_problem"].get(s)
        if ra is None or rb is None:
            by_problem.append(None)
            continue
        diffs = [ra[t] - rb[t] for t in ra if t in rb]
        by_problem.append(
            {"diff": float(np.mean(diffs)), "se": float(np.std(diffs, ddof=1) / np.sqrt(len(diffs)))}
        )
    return {
        "seeds": common,
        "final_diff_per_seed": d,
        "final_diff_paired_by_problem_per_seed": by_problem,
        "final_diff": float(np.mean(d)) if d else None,
        "final_diff_se": float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None,
        "seeds_above": int(sum(x > 0 for x in d)),
        "mixed_share_ratio": a["mixed_share"] / max(b["mixed_share"], 1e-9),
        "mixed_prompts_ratio": a["mixed_prompts_per_iteration"] / max(b["mixed_prompts_per_iteration"], 1e-9),
    }


def pilot(args: argparse.Namespace) -> None:
    """Is there room for allocation on a task? Its warm start plays every held-out problem
    `--pilot-samples` times at the training temperature (`python -m trace_lightning.evaluate`), and from
    the per-problem successes: pass@1 per difficulty level, GRPO's mixed share (groups of that many on
    uniformly drawn problems), and the expected mixed pairs that an allocator knowing each level's mean
    success (pooled over the level: what the attribute estimates can reach) buys over random pairs, on
    random pools of `data.pool_size` candidates with 16 root rollouts, as in the default job."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from trace_lightning import config
    from trace_lightning.envs.math_tool import generated_attributes
    from trace_lightning.gauges import mixed_prob_unbiased

    spec = TASKS[args.tasks.split(",")[0]]
    run_dir = Path(args.work) / f"pilot_{args.tasks.split(',')[0]}"
    overrides = [
        f"model.warm_start={spec['warm_start']}",
        *spec["env"],
        f"eval.samples={args.pilot_samples}",
        "eval.temperature=null",
        "logger=none",
        f"run_dir={run_dir}",
        *args.extra,
    ]
    if not (run_dir / "evaluation.json").is_file():
        ensure_warm_start(spec["warm_start"], spec["env"])
        subprocess.run([sys.executable, "-m", "trace_lightning.evaluate", *overrides], cwd=ROOT, check=True)
    result = json.loads((run_dir / "evaluation.json").read_text())["result"]
    config.register()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):  # the task the trainer builds
        env = instantiate(compose("train", overrides=[*spec["env"], *args.extra]).env)
    tasks = {t.task_id: t for t in env.tasks()}
    ids, wins = np.array(result["task_ids"]), np.array(result["successes"], dtype=float)
    n = np.full(len(ids), result["samples"])
    level = np.array([generated_attributes(tasks[i].question, tasks[i].answer[0])[0] for i in ids])
    mixed_group = mixed_prob_unbiased(wins, n, n)  # [P] P(a group of `samples` is mixed), unbiased
    mixed_pair = mixed_prob_unbiased(wins, n, np.full(len(ids), 2))  # [P]
    by_level = {}
    for lv in sorted(set(level)):
        sel = level == lv
        by_level[lv] = {
            "problems": int(sel.sum()),
            "pass_at_1": float(wins[sel].sum() / n[sel].sum()),
            "mixed_share_groups": float(mixed_group[sel].mean()),
        }
    level_rate = {lv: by_level[lv]["pass_at_1"] for lv in by_level}
    rng = np.random.default_rng(0)
    oracle, random_ = [], []
    for _ in range(2000):  # random pools of 24 candidates, 16 root rollouts = 8 pairs
        pool = rng.choice(len(ids), size=24, replace=False)
        v = np.array([level_rate[level[i]] for i in pool])
        best = pool[np.argsort(-(1 - v**2 - (1 - v) ** 2), kind="stable")[:8]]
        oracle.append(mixed_pair[best].sum())
        random_.append(mixed_pair[rng.choice(pool, size=8, replace=False)].sum())
    out = {
        "task": args.tasks.split(",")[0],
        "overrides": overrides,
        "samples": int(result["samples"]),
        "temperature": result["temperature"],
        "pass_at_1": result["pass_at_1"],
        "grpo_mixed_share": float(mixed_group.mean()),
        "by_level": by_level,
        "expected_mixed_pairs_level_oracle": float(np.mean(oracle)),
        "expected_mixed_pairs_random": float(np.mean(random_)),
        "level_oracle_over_random": float(np.mean(oracle) / max(np.mean(random_), 1e-9)),
        "targets": {"GRPO's mixed share in [0.25, 0.40]": 0.25 <= float(mixed_group.mean()) <= 0.40},
    }
    out["targets"]["level oracle >= 1.5x random"] = out["level_oracle_over_random"] >= 1.5
    path = Path(args.out or RESULTS / f"real_pilot_{out['task']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    shown = ("held_out", "targets", "results", "verdicts")
    if "tasks" in record:
        shown, record = ("tasks",), {"tasks": {t: r.get("versus_grpo") for t, r in record["tasks"].items()}}
    print(
        json.dumps(
            {k: record[k] for k in shown if k in record},
            indent=1,
            default=str,
        )[:3000]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["default", "compare", "pilot"])
    parser.add_argument("--pilot-samples", type=int, default=4, help="pilot: episodes per held-out problem")
    parser.add_argument("--warm-start", default=WARM_START)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tasks", default="mixed,control", help=f"compare: of {sorted(TASKS)}")
    parser.add_argument("--methods", default=None, help="compare: these methods (default: the task's)")
    parser.add_argument("--only", default=None, help="compare: run only these <task>_<method>_seed<s>")
    parser.add_argument("--tokens", type=int, default=1200, help="compare: generated tokens per iteration")
    parser.add_argument(
        "--max-leaves", type=int, default=96, help="compare: the most leaves an iteration may spend"
    )
    parser.add_argument(
        "--probe",
        type=int,
        default=0,
        help="every this many iterations, the predictor probe on trace's second seed (0: none)",
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
    {"default": default_job, "compare": compare, "pilot": pilot}[args.what](args)


if __name__ == "__main__":
    main()
