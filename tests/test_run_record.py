"""The MLflow lifecycle across deaths and resumes: a dead process's run is closed, a resume into a
moved run_dir continues the run, and no metric step is logged twice."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from trace_lightning import config, trainer
from trace_lightning.run_record import RECORD, close_dead_run

FAST = ["debug=fast", "~callbacks.progress"]


def make_cfg(tmp_path: Path, run_dir: Path, *overrides: str):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides])


def client_for(tmp_path: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_whose_process_died_is_marked_killed_when_its_run_dir_is_next_used(tmp_path: Path) -> None:
    """A process SIGKILLed before its first checkpoint: only process.json and a RUNNING run remain."""
    client = client_for(tmp_path)
    experiment = client.create_experiment("trace_lightning")
    orphan = client.create_run(experiment).info.run_id  # RUNNING, as a killed process leaves it
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"pid": dead_pid(), "host": socket.gethostname(), "mlflow_run_id": orphan}
    (run_dir / RECORD).write_text(json.dumps({**record, "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}))
    assert client.get_run(orphan).info.status == "RUNNING"
    trainer.build(make_cfg(tmp_path, run_dir, "logger=none"))  # the next use of the run_dir
    assert client.get_run(orphan).info.status == "KILLED"
    assert close_dead_run(run_dir) is None  # the new record names this (live) process: nothing to close


def test_a_live_process_run_is_left_alone(tmp_path: Path) -> None:
    client = client_for(tmp_path)
    running = client.create_run(client.create_experiment("trace_lightning")).info.run_id
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"pid": os.getppid(), "host": socket.gethostname()}
    (run_dir / RECORD).write_text(json.dumps({**record, "mlflow_run_id": running, "tracking_uri": None}))
    assert close_dead_run(run_dir) is None
    assert client.get_run(running).info.status == "RUNNING"


def test_resume_into_a_moved_run_dir_continues_the_run_without_duplicate_steps(tmp_path: Path) -> None:
    first, moved = tmp_path / "first", tmp_path / "moved"
    trainer.train(make_cfg(tmp_path, first, "trainer.max_epochs=2"))
    client = client_for(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("trace_lightning").experiment_id])
    steps_before = max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    # Resume from iteration 0 although iteration 1 was logged: like a kill mid-iteration, the run holds
    # steps past the checkpoint. The moved run_dir also moves the tiny model, so model.out_dir changes.
    start = first / "checkpoints" / "iteration-0000.ckpt"
    trainer.train(make_cfg(tmp_path, moved, "trainer.max_epochs=3", f"ckpt_path={start}"))
    runs = client.search_runs([client.get_experiment_by_name("trace_lightning").experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # the same run continued, no second one
    resumed = client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.params["model.out_dir"] == str(first / "tiny_model")  # the first value stays
    assert resumed.data.tags["resumed/model.out_dir"] == str(moved / "tiny_model")  # the change is kept
    for key in resumed.data.metrics:
        steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert max(steps.values()) == 1, f"{key}: steps logged twice {[s for s, n in steps.items() if n > 1]}"
    steps_after = max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps_after > steps_before  # the third iteration was logged
    assert json.loads((moved / RECORD).read_text())["mlflow_run_id"] == run.info.run_id


def test_resume_under_another_output_root_starts_a_run_that_names_the_one_it_continues(
    tmp_path: Path,
) -> None:
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    trainer.train(make_cfg(old_root, old_root / "run", "trainer.max_epochs=1"))
    old = client_for(old_root)
    (first,) = old.search_runs([old.get_experiment_by_name("trace_lightning").experiment_id])
    start = old_root / "run" / "checkpoints" / "iteration-0000.ckpt"
    trainer.train(make_cfg(new_root, new_root / "run", "trainer.max_epochs=2", f"ckpt_path={start}"))
    new = client_for(new_root)  # the new store does not hold the first run, so a new one continues it
    (second,) = new.search_runs([new.get_experiment_by_name("trace_lightning").experiment_id])
    assert second.data.tags["resumed_from_run"] == first.info.run_id
    assert second.info.status == "FINISHED"
