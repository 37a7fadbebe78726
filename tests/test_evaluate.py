"""`python -m trace_lightning.evaluate`: a saved run's checkpoint or a warm start,
evaluated without training through the trainer's own pieces; held-out sets that overlap a warm start's
training tasks are refused; runs name their base model and warm start."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from trace_lightning import config, trainer
from trace_lightning.checkpoints import CheckpointError, validate_checkpoint
from trace_lightning.evaluate import checkpoint_path, evaluate
from trace_lightning.model_folder import MARKER, check_held_out, model_tags


def compose_cfg(name, tmp_path, *overrides):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose(name, overrides=[f"output_root={tmp_path}", "debug=fast", "logger=none", *overrides])


def fake_warm_start(
    folder: Path, held_out: list[int], base_model: str | None = "smollm2-135m-instruct"
) -> str:
    folder.mkdir(parents=True)
    record = {"env": "chain", "held_out_task_ids": held_out}
    (folder / MARKER).write_text(json.dumps(record | ({"base_model": base_model} if base_model else {})))
    return str(folder)


def test_held_out_tasks_must_be_ones_the_warm_start_held_out(tmp_path):
    path = fake_warm_start(tmp_path / "ws" / "model", [3, 5, 8, 13])
    check_held_out(path, [5, 13])  # a subset: never trained on
    with pytest.raises(ValueError, match=r"data.held_out=3 would evaluate on tasks \[21\]") as err:
        check_held_out(path, [5, 13, 21])
    assert "held_out=3" in str(err.value) and "it held out 4" in str(err.value)


def test_the_trainer_refuses_a_held_out_set_the_warm_start_trained_on(tmp_path):
    path = fake_warm_start(tmp_path / "ws" / "model", [])  # it held out nothing
    cfg = compose_cfg(
        "train", tmp_path, f"run_dir={tmp_path}/run", f"model.warm_start={path}", "data.held_out=4"
    )
    with pytest.raises(ValueError, match="data.held_out=4 would evaluate on tasks"):
        trainer.build(cfg)


def test_runs_name_the_base_model_and_the_warm_start_folder(tmp_path):
    path = fake_warm_start(tmp_path / "smollm2-search_qa" / "model", [])
    assert model_tags(path, path) == {
        "base_model": "smollm2-135m-instruct",
        "warm_start": "smollm2-search_qa",
    }
    old = fake_warm_start(tmp_path / "older", [], base_model=None)  # an older marker, no base_model
    assert model_tags(old, old) == {"base_model": "unknown", "warm_start": "older"}
    assert model_tags(None, "/cache/smollm2-135m-instruct") == {
        "base_model": "smollm2-135m-instruct",
        "warm_start": "none",
    }


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A debug=fast run of 2 iterations with its checkpoints (no MLflow)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    cfg = compose_cfg("train", tmp_path, f"run_dir={tmp_path}/run", "data.held_out=4")
    trainer.train(cfg)
    return tmp_path


def test_evaluate_a_saved_run_without_training(trained_run, tmp_path):
    run_dir = trained_run / "run"
    newest = checkpoint_path(str(run_dir))
    assert newest is not None and newest.parent == run_dir / "checkpoints"
    cfg = compose_cfg(
        "evaluate", trained_run, f"run_dir={tmp_path}/eval", f"ckpt_path={run_dir}", "data.held_out=4",
        "eval.samples=3", "eval.k=2", "eval.temperature=null",  # the training temperature (default: greedy)
    )  # fmt: skip
    result, out = evaluate(cfg)
    assert len(result.task_ids) == 4 and result.samples == 3 and result.k == 2 and result.episodes == 12
    assert 0 <= result.pass_at_1 <= result.pass_at_k <= 1 and result.temperature == 0.8
    record = json.loads(out.read_text())
    assert record["ckpt_path"] == str(newest) and record["result"]["successes"] == list(result.successes)
    assert record["eval"]["samples"] == 3 and record["env"] == "chain"


def test_evaluate_loads_the_checkpoint_weights(trained_run, tmp_path, monkeypatch):
    """The module evaluated holds the checkpoint's weights, not the freshly built model's."""
    from trace_lightning import evaluate as ev

    seen = {}
    real = ev.load_checkpoint

    def spy(cfg, path, ckpt, module):
        real(cfg, path, ckpt, module)
        seen.update({k: v.clone() for k, v in module.state_dict().items()})

    monkeypatch.setattr(ev, "load_checkpoint", spy)
    newest = checkpoint_path(str(trained_run / "run"))
    cfg = compose_cfg(
        "evaluate", trained_run, f"run_dir={tmp_path}/e", f"ckpt_path={newest}", "data.held_out=4"
    )
    evaluate(cfg)
    saved = validate_checkpoint(newest)["state_dict"]
    assert seen.keys() == saved.keys() and all(torch.equal(seen[k], saved[k]) for k in saved)


def test_evaluate_reads_the_checkpoint_once_so_it_loads_the_bytes_it_checked(
    trained_run, tmp_path, monkeypatch
):
    """`ckpt_path=<run_dir>`: the newest valid checkpoint is read once; its checks and its load use those
    bytes, so a file swapped in between the two could not be loaded under this run's name."""
    import pathlib

    reads = []
    real = pathlib.Path.read_bytes

    def counting(self):
        if self.suffix == ".ckpt":
            reads.append(self.name)
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", counting)
    cfg = compose_cfg(
        "evaluate",
        trained_run,
        f"run_dir={tmp_path}/e",
        f"ckpt_path={trained_run / 'run'}",
        "data.held_out=4",
    )
    evaluate(cfg)
    assert len(reads) == 1, reads


def test_evaluate_refuses_a_checkpoint_of_another_adapter(trained_run, tmp_path):
    cfg = compose_cfg(
        "evaluate", trained_run, f"run_dir={tmp_path}/e", f"ckpt_path={trained_run / 'run'}", "adapter=lora"
    )
    with pytest.raises(CheckpointError, match="was trained with adapter="):
        evaluate(cfg)


def test_evaluate_the_model_itself_greedily_on_every_task(tmp_path):
    cfg = compose_cfg(
        "evaluate", tmp_path, f"run_dir={tmp_path}/e", "eval.tasks=all", "eval.temperature=0",
        "eval.samples=1", "env.n_tasks=12", "data.held_out=4",
    )  # fmt: skip
    result, _ = evaluate(cfg)
    assert sorted(result.task_ids) == list(range(12)) and result.temperature == 0.0 and result.samples == 1
    with pytest.raises(ValueError, match="eval.tasks=held_out with data.held_out=0"):
        evaluate(compose_cfg("evaluate", tmp_path, f"run_dir={tmp_path}/f", "data.held_out=0"))


def test_the_evaluate_command_logs_to_mlflow(tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    args = [
        "debug=fast",
        f"output_root={tmp_path}",
        f"run_dir={tmp_path}/e",
        "eval.samples=2",
        "eval.temperature=null",  # sampled at the training temperature (the default is greedy)
        "env.n_tasks=12",
        "data.held_out=4",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trace_lightning.evaluate", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@1" in proc.stdout and "evaluating: 100%" in proc.stderr
    assert "litlogger" not in proc.stdout + proc.stderr  # Lightning's INFO lines go to the log file
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("trace_lightning").experiment_id])
    assert run.info.run_name == "evaluate-chain" and run.data.tags["stage"] == "evaluate"
    assert {"eval/pass_at_1", "eval/pass_at_1_se", "eval/pass_at_2", "eval/pass_at_2_se"} <= set(
        run.data.metrics
    )
    assert run.data.tags["base_model"] == "tiny_model" and run.data.params["eval.samples"] == "2"
