"""Resume: corrupt checkpoints are named, `last` skips them, and a resumed run samples exactly the
iteration an uninterrupted run would have (also after SIGKILL), continuing the same MLflow run."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from trace_lightning import config, trainer
from trace_lightning.checkpoints import CheckpointError, newest_valid_checkpoint, validate_checkpoint
from trace_lightning.checkpoints.files import Manifest, digest_path

FAST = ["debug=fast", "~callbacks.progress", "budget.leaves=12"]


def make_cfg(tmp_path, run_dir, *overrides):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides])


def iteration_trees(run_dir: Path, k: int) -> dict:
    record = json.loads((run_dir / "artifacts" / "trees" / f"iteration_{k:04d}.json").read_text())
    return {"trees": record["trees"], "root_counts": record["root_counts"]}


def test_truncated_checkpoint_is_named_and_last_skips_it(tmp_path):
    run_dir = tmp_path / "run"
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=2", "logger=none"))
    folder = run_dir / "checkpoints"
    assert Manifest.read(folder).files == ["iteration-0000.ckpt", "iteration-0001.ckpt"]
    newest = folder / "iteration-0001.ckpt"
    assert (folder / "last.ckpt").resolve() == newest  # last.ckpt links to the newest iteration file
    newest.write_bytes(newest.read_bytes()[:1000])  # a save cut short (its digest is now stale)
    with pytest.raises(CheckpointError, match="iteration-0001.ckpt does not match its SHA-256 digest"):
        validate_checkpoint(newest)
    write_digest(newest)  # even with a matching digest, the loader names it
    with pytest.raises(CheckpointError, match="iteration-0001.ckpt is truncated or corrupt"):
        validate_checkpoint(newest)
    assert newest_valid_checkpoint(folder) == folder / "iteration-0000.ckpt"
    with pytest.raises(CheckpointError, match="iteration-0001.ckpt"):
        trainer.build(make_cfg(tmp_path, run_dir, f"ckpt_path={newest}", "logger=none"))


def write_digest(path: Path) -> None:
    digest_path(path).write_text(hashlib.sha256(path.read_bytes()).hexdigest())


def test_resumed_run_samples_the_same_next_iteration(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trainer.train(make_cfg(tmp_path, straight, "trainer.max_epochs=3", "logger=none"))
    trainer.train(make_cfg(tmp_path, resumed, "trainer.max_epochs=2", "logger=none"))
    trainer.train(make_cfg(tmp_path, resumed, "trainer.max_epochs=3", "logger=none", "ckpt_path=last"))
    assert iteration_trees(resumed, 2) == iteration_trees(straight, 2)
    assert iteration_trees(resumed, 1) == iteration_trees(straight, 1)


def cli(tmp_path, run_dir, *overrides):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    args = [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "trace_lightning.trainer", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoints(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until the run has finished `n` iterations (its n-th tree artifact is written)."""
    deadline = time.time() + timeout
    target = run_dir / "artifacts" / "trees" / f"iteration_{n - 1:04d}.json"
    while not target.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the run made no progress"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    long = ["trainer.max_epochs=4", "budget.leaves=24", "data.pool_size=16"]
    assert cli(tmp_path, straight, *long).wait(timeout=600) == 0
    proc = cli(tmp_path, killed, *long)
    wait_for_checkpoints(killed, 2, proc)
    time.sleep(0.3)  # into the third iteration
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = cli(tmp_path, killed, *long, "ckpt_path=last")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    for k in range(4):
        assert iteration_trees(killed, k) == iteration_trees(straight, k), f"iteration {k} differs"
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("trace_lightning").experiment_id])
    assert len(runs) == 2  # straight + killed; the resume continued the killed run instead of a third
    by_name = {Path(r.data.params["run_dir"]).name: r for r in runs}
    straight_run, killed_run = by_name["straight"].info.run_id, by_name["killed"].info.run_id
    assert client.get_run(killed_run).info.status == "FINISHED"
    for key in client.get_run(killed_run).data.metrics:  # the killed iteration's steps were logged once
        steps = [m.step for m in client.get_metric_history(killed_run, key)]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice"
    loss = {m.step: m.value for m in client.get_metric_history(killed_run, "train/loss")}
    assert loss == {m.step: m.value for m in client.get_metric_history(straight_run, "train/loss")}


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_marked_killed_on_the_next_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(tmp_path, run_dir, "trainer.max_epochs=4", "budget.leaves=24", "data.pool_size=16")
    deadline = time.time() + 300
    while not (run_dir / "process.json").exists():  # the MLflow run exists once this is written
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "checkpoints" / "manifest.json").exists()  # killed before its first checkpoint
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    orphan = json.loads((run_dir / "process.json").read_text())["mlflow_run_id"]
    assert client.get_run(orphan).info.status == "RUNNING"
    again = cli(tmp_path, run_dir, "trainer.max_epochs=1")  # nothing to resume: a fresh start
    assert again.wait(timeout=600) == 0, again.stderr.read()[-3000:]
    assert client.get_run(orphan).info.status == "KILLED"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_before_exit(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(tmp_path, run_dir, "trainer.max_epochs=50", "logger=none")
    wait_for_checkpoints(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM  # the shell's code for a SIGTERM'd process
    saved = run_dir / "checkpoints" / "stop.ckpt"
    assert saved.is_file() and validate_checkpoint(saved)["global_step"] > 0
    assert newest_valid_checkpoint(run_dir / "checkpoints") == saved
    resumed = cli(tmp_path, run_dir, "trainer.max_epochs=3", "logger=none", "ckpt_path=last")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    from trace_lightning.checkpoints.plugin import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {}, "epoch": 1, "global_step": 3}, target)

    def dies_midway(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the process is killed while writing

    monkeypatch.setattr("trace_lightning.checkpoints.plugin.torch.save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {}, "epoch": 2, "global_step": 6}, target)
    assert validate_checkpoint(target)["epoch"] == 1  # the old file, whole
    # no partial file left behind; the digest and the manifest are the first save's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256", "manifest.json"]
    assert Manifest.read(tmp_path).files == ["last.ckpt"]


def test_a_bfloat16_lora_run_trains_checkpoints_and_resumes_exactly(tmp_path):
    """model.dtype=bfloat16: the base weights in bf16, the LoRA adapter in float32; a resumed run samples
    the same next iteration as an uninterrupted one, as in float32."""
    bf16 = ["model.dtype=bfloat16", "adapter=lora", "adapter.r=2", "adapter.target_modules=[q_proj,v_proj]"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trainer.train(make_cfg(tmp_path, straight, "trainer.max_epochs=2", "logger=none", *bf16))
    trainer.train(make_cfg(tmp_path, resumed, "trainer.max_epochs=1", "logger=none", *bf16))
    trainer.train(make_cfg(tmp_path, resumed, "trainer.max_epochs=2", "logger=none", "ckpt_path=last", *bf16))
    assert iteration_trees(resumed, 1) == iteration_trees(straight, 1)
    saved = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    lora = {k: v.dtype for k, v in saved.items() if "lora_" in k}
    assert lora and set(lora.values()) == {torch.float32}
