"""The console: the end-of-fit summary from known reports, one progress bar per
iteration through a real fit, no repeated sync_dist warnings, and vLLM-style loggers sent to the log
file."""

import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import quiet_trainer, trace_module
from helpers.chain_fixtures import make_data
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from test_callbacks import make_report
from torch.utils._pytree import LeafSpec

from trace_lightning.callbacks import RolloutStats
from trace_lightning.console import (
    FitSummary,
    IterationProgress,
    IterationSummary,
    RunSummary,
    iteration_summary,
    quiet_known_warnings,
    summary_record,
    summary_text,
)
from trace_lightning.engines.base import EngineStats
from trace_lightning.engines.vllm import route_logger_to_run_log
from trace_lightning.evaluation import score
from trace_lightning.tree import RolloutTree

SYNC_DIST = "It is recommended to use `self.log("


def row(
    iteration,
    success,
    effective,
    roots,
    prefixes,
    tokens,
    turns,
    sample,
    train,
    prefill=500,
    tools=3,
    steps=2,
):
    return IterationSummary(
        iteration,
        success,
        effective,
        roots,
        prefixes,
        12,
        tokens,
        prefill,
        tools,
        turns,
        sample,
        0.5,
        train,
        steps,
    )


def test_iteration_summary_of_a_hand_built_report():
    # test_callbacks: a mixed tree (3 leaves, 1 win) and a failed one (2 leaves), 3 tool calls
    report = make_report(engine_stats=EngineStats(prefill_tokens=40))
    report.sample_seconds, report.sync_seconds = 2.5, 0.25
    got = iteration_summary(report, train_seconds=1.5)
    # 1 win in 5 leaves; 1 of 2 trees mixed, at its root and at prefix node 1; the ledger charged
    # 3+2+4+4+1 = 14 tokens, 1 of them by Stage 2's continuation; 40 prefill tokens; leaf depths 2, 1,
    # 2, 1, 1.
    assert got == IterationSummary(
        0, 0.2, 0.5, 1, 1, 5, 14, 40, 3, 1.4, 2.5, 0.25, 1.5, prompts=2, expand_tokens=1
    )


def test_summary_text_from_known_iterations():
    summary = FitSummary(
        (
            row(0, 0.25, 0.5, 2, 0, 1234, 1.5, sample=10.0, train=3.5),
            row(1, 0.75, 1.0, 3, 2, 2000, 2.0, sample=12.0, train=4.5),
        ),
        wall_seconds=95.0,
    )
    assert summary_text(summary).splitlines() == [
        "TRACE summary: 2 iterations in 1 min 35 s",
        "  iter  success  effective  mixed root/prefix  leaves   tokens  turns  steps  sample s  train s",
        "     0     0.25       0.50              2 / 0      12    1,234   1.50      2      10.0      3.5",
        "     1     0.75       1.00              3 / 2      12    2,000   2.00      2      12.0      4.5",
        # (0.25 * 12 + 0.75 * 12) / 24 leaves; (0.5 + 1.0) / 2 iterations
        "success 0.50 over all leaves (first iteration 0.25, last 0.75); effective ratio 0.75",
        "mixed anchors: 5 roots, 2 turn prefixes",
        "spent: 24 leaves, 3,234 generated tokens, 1,000 prefill tokens, 6 tool calls; 4 optimizer steps",
        # 95 s of wall time less 22 s sampling, 2 x 0.5 s sync and 8 s training; 95 s / 24 leaves
        "time: sampling 22.0 s, weight sync 1.0 s, training 8.0 s, other 1 min 04 s; 4.0 s per leaf",
    ]


def test_a_long_run_summary_stays_one_screen():
    its = tuple(row(i, 0.5, 0.5, 1, 0, 100, 1.0, 1.0, 1.0) for i in range(40))
    lines = summary_text(FitSummary(its, 200.0)).splitlines()
    assert len(lines) == 2 + 6 + 1 + 6 + 4  # title, header, first 6, "... 28 more", last 6, totals
    assert "  ... 28 more" in lines and lines[-5].split()[0] == "39"
    assert summary_text(FitSummary((), 3.0)) == "TRACE summary: no iteration finished (3.0 s)."


def evaluated(successes, samples=4, k=4, temperature=0.8, groups=()):
    """An evaluation of tasks 0, 1, ... with these success counts (scored by evaluation.score)."""
    trees = []
    for task, c in enumerate(successes):
        tree = RolloutTree(task, [1, 2])
        for r in [1.0] * c + [0.0] * (samples - c):
            tree.finish(tree.add_turn(0, "bare", [3], []), r, "answer")
        trees.append(tree)
    return score(trees, k, temperature, 1.0, groups)


def test_the_summary_ends_with_the_held_out_learning_curve():
    its = (row(0, 0.5, 0.5, 1, 0, 100, 1.0, 1.0, 1.0),)
    # before: tasks solved 0, 2 and 4 times of 4: pass@1 0.5, SE = std([0, .5, 1]) / sqrt(3) = 0.5 /
    # 1.732 = 0.29; pass@4: 0, 1, 1 -> 0.67 +- 0.33. After: 1, 3, 4 of 4: pass@1 0.67 +- 0.22 (by
    # hand: std([.25, .75, 1]) = 0.382), pass@4 1.00 +- 0. Change per task +0.25, +0.25, 0: +0.17 +- 0.08.
    curve = ((0, evaluated([0, 2, 4])), (2, evaluated([1, 3, 4])))
    lines = summary_text(FitSummary(its, 10.0, curve)).splitlines()
    assert lines[-3:] == [
        "held-out pass@1 ± SE (3 tasks x 4 episodes, temperature 0.8): "
        "0.50 ± 0.29 after 0, 0.67 ± 0.22 after 2",
        "held-out pass@4 ± SE: 0.67 ± 0.33 after 0, 1.00 ± 0.00 after 2",
        "pass@1 change since the start (paired by task): +0.17 ± 0.08",
    ]
    greedy = summary_text(FitSummary(its, 10.0, ((0, evaluated([0, 1], samples=1, k=1, temperature=0.0)),)))
    assert (
        greedy.splitlines()[-1] == "held-out pass@1 ± SE (2 tasks x 1 episodes, greedy): 0.50 ± 0.50 after 0"
    )
    assert "held-out" not in summary_text(FitSummary(its, 10.0))  # no held-out tasks, no line


def test_the_summary_shows_held_out_pass_at_1_by_group_where_tasks_carry_attributes():
    its = (row(0, 0.5, 0.5, 1, 0, 100, 1.0, 1.0, 1.0),)
    groups = ("steps=1", "steps=1", "steps=2")
    # steps=1: tasks solved 0 and 2 of 4 -> 0.25, then 4 and 4 -> 1.00; steps=2: 4 of 4 -> 1.00,
    # then 1 -> 0.25
    curve = ((0, evaluated([0, 2, 4], groups=groups)), (2, evaluated([4, 4, 1], groups=groups)))
    lines = summary_text(FitSummary(its, 10.0, curve)).splitlines()
    assert (
        lines[-1] == "held-out pass@1 by group, start -> last: "
        "steps=1 (2 tasks) 0.25 -> 1.00, steps=2 (1 tasks) 1.00 -> 0.25"
    )
    record = json.loads(json.dumps(summary_record(FitSummary(its, 10.0, curve))))
    assert [p["by_group"] for p in record["held_out"]["curve"]] == [
        {"steps=1": 0.25, "steps=2": 1.0},
        {"steps=1": 1.0, "steps=2": 0.25},
    ]
    plain = summary_record(FitSummary(its, 10.0, ((0, evaluated([0, 2, 4])),)))
    assert "by_group" not in plain["held_out"]["curve"][0]  # no attributes, no groups


def test_the_summary_record_holds_the_curve_and_its_paired_change():
    its = (row(0, 0.5, 0.5, 1, 0, 100, 1.0, 1.0, 1.0), row(1, 0.5, 0.5, 1, 0, 100, 1.0, 1.0, 1.0))
    # the curve above plus a middle point: before 0, 2, 4 of 4; after 1, 3, 4 (see the previous test)
    curve = ((0, evaluated([0, 2, 4])), (1, evaluated([4, 4, 4])), (2, evaluated([1, 3, 4])))
    record = json.loads(json.dumps(summary_record(FitSummary(its, 10.0, curve))))
    held = record["held_out"]
    assert (held["tasks"], held["samples"], held["start"], held["final"]) == (3, 4, 0.5, pytest.approx(2 / 3))
    # per-task changes .25, .25, 0: mean 1/6, SE = std / sqrt(3) with std (ddof 1) = 0.1443
    assert held["change"] == pytest.approx(1 / 6)
    assert held["change_se"] == pytest.approx(0.14434 / 3**0.5, abs=1e-4)
    assert held["point_se_max"] == pytest.approx(0.5 / 3**0.5, abs=1e-4)  # the first point's SE, 0.29
    assert [p["iterations"] for p in held["curve"]] == [0, 1, 2]
    assert (held["final_task_ids"], held["final_successes"]) == ([0, 1, 2], [1, 3, 4])
    assert [it["optimizer_steps"] for it in record["iterations"]] == [2, 2]
    assert "held_out" not in summary_record(FitSummary(its, 10.0))


def fit_two_iterations(tiny_model_dir, callbacks, progress_bar=False):
    torch.manual_seed(0)
    module = trace_module(tiny_model_dir, torch.optim.AdamW)
    data = make_data()
    quiet_trainer(max_epochs=2, callbacks=callbacks, enable_progress_bar=progress_bar).fit(
        module, datamodule=data
    )
    return data


def test_one_bar_per_iteration_then_the_summary(tiny_model_dir, capsys, tmp_path):
    summary = RunSummary(record_path=tmp_path / "run" / "summary.json")
    data = fit_two_iterations(tiny_model_dir, [IterationProgress(), summary], progress_bar=True)
    out = capsys.readouterr()
    leaves = data.budget.leaves
    for k in range(2):  # the bar counted every episode against the leaf budget, then the steps
        assert f"iteration {k}: sampling:   0%|          | 0/{leaves} [" in out.err
        assert f"iteration {k}: {leaves} episodes sampled, training: 100%" in out.err
    assert [r.iteration for r in summary.rows] == [0, 1]
    assert summary.rows[-1] == iteration_summary(data.report, summary.rows[-1].train_seconds)
    assert "TRACE summary: 2 iterations in" in out.out and out.out.count("TRACE summary") == 1
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [it["iteration"] for it in written["iterations"]] == [0, 1]


@pytest.fixture
def single_process_group(tmp_path):
    """torch.distributed initialised with world size 1 in this process, as vLLM does at start-up."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sync_dist_warnings(record):
    return [w for w in record if SYNC_DIST in str(w.message) and "sync_dist=True" in str(w.message)]


def test_no_sync_dist_warning_per_metric_in_a_single_process(tiny_model_dir, single_process_group):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_two_iterations(tiny_model_dir, [RolloutStats()])
    assert len(sync_dist_warnings(record)) > 20  # the cause is real: one warning per metric
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_two_iterations(tiny_model_dir, [RolloutStats(), RunSummary()])
    assert sync_dist_warnings(record) == []


def test_the_sync_dist_filter_stays_off_with_several_processes():
    message = (
        f"{SYNC_DIST}'rollout/x', ..., sync_dist=True)` when logging on epoch level in distributed setting"
    )
    for world, expected in ((2, 1), (1, 0)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            quiet_known_warnings(world)
            warnings.warn(message, PossibleUserWarning, stacklevel=1)
            LeafSpec()  # torch's deprecation, raised inside Lightning every iteration: always silenced
        assert len(record) == expected


def test_a_library_logger_goes_to_the_run_log_file(tmp_path):
    library = logging.getLogger("fake_vllm")
    console = io.StringIO()
    library.addHandler(logging.StreamHandler(console))  # what vLLM does at import
    library.propagate, library.level = False, logging.INFO
    log_file = logging.FileHandler(tmp_path / "trainer.log")  # what Hydra puts on the root logger
    root = logging.getLogger()
    saved = root.handlers[:]  # pytest's own handlers, put back below
    try:
        root.handlers = [logging.StreamHandler(console), log_file]  # Hydra's console and file
        route_logger_to_run_log("fake_vllm")
        library.warning("libtcmalloc is not found in LD_PRELOAD.")
        assert library.handlers == [log_file] and not library.propagate
        root.handlers = []  # no Hydra: records propagate as usual
        route_logger_to_run_log("fake_vllm")
        assert library.propagate and library.handlers == []
    finally:
        root.handlers = saved
        log_file.close()
    assert console.getvalue() == ""  # neither its own handler nor the root's console saw it
    assert "libtcmalloc is not found" in (tmp_path / "trainer.log").read_text()


def test_the_cli_console_holds_only_bars_the_summary_and_our_lines(tmp_path):
    """`python -m trace_lightning.trainer` as a user runs it: stderr carries only the iteration and
    evaluation bars, stdout only the summary and the run's whereabouts; the library lines a user cannot
    act on (MLflow's table creation, Lightning's experiment creation and parameter table, transformers'
    generation flags) are in the run's log file instead."""
    env = {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("MLFLOW_CONFIGURE_LOGGING", None)
    command = [
        "-m",
        "trace_lightning.trainer",
        "debug=fast",
        f"output_root={tmp_path}",
        f"run_dir={tmp_path}/run",
    ]
    proc = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    segments = [s.strip() for s in re.split(r"[\r\n]|\x1b\[A", proc.stderr) if s.strip()]
    stray = [s for s in segments if not s.startswith(("iteration ", "evaluation after "))]
    assert segments and not stray, stray[:5]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("TRACE summary:") and lines[-1].lstrip().startswith("compare:")
    library = r"WARNING|INFO|Warning|\[transformers\]|mlflow\.(store|tracking|utils)"
    noise = [line for line in lines if re.search(library, line)]
    assert not noise, noise
    log = (tmp_path / "run" / "trainer.log").read_text()
    for moved in ("Creating initial MLflow database tables", "Experiment with name", "Trainable params"):
        assert moved in log, moved
