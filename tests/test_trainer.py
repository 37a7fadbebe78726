"""The Hydra CLI: every shipped config composes and instantiates; a CLI run lands in MLflow; bad
configs fail at start-up naming the key."""

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from mlflow.tracking import MlflowClient
from omegaconf.errors import ValidationError

from trace_lightning import config, trainer
from trace_lightning.allocation import TreeAllocator
from trace_lightning.budget import BudgetError
from trace_lightning.model_folder import policy_path
from trace_lightning.models import prepare_smollm2

CONF = config.conf_dir()
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF.iterdir())
    if group.is_dir() and group.name not in ("experiment", "debug", "__pycache__")
    for option in sorted(group.glob("*.yaml"))
]
# options that build an opt-in resource carry its marker (tests/helpers/optin.py; test_optin.py checks it)
OPT_IN_OPTIONS = {("model", "gemma3_270m"): pytest.mark.gemma}
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def make_cfg(tmp_path, *overrides):
    config.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=[f"output_root={tmp_path}", f"run_dir={tmp_path}/run", *overrides],
        )


@pytest.mark.parametrize(
    ("group", "option"),
    [pytest.param(g, o, marks=OPT_IN_OPTIONS.get((g, o), ()), id=f"{g}={o}") for g, o in GROUP_OPTIONS],
)
def test_every_group_option_composes_and_instantiates(tmp_path, group, option):
    cfg = (
        make_cfg(tmp_path, "model=tiny", f"{group}={option}")
        if group != "model"
        else make_cfg(tmp_path, f"model={option}")
    )
    node = cfg[group]
    if node is None:
        return
    if (
        group == "model" and option == "smollm2"
    ):  # converting takes ~20 s; tests/test_models.py does it (slow)
        assert get_method(node._target_) is prepare_smollm2
        return
    if group == "model" and option == "local":
        with pytest.raises(Exception, match="model.path"):
            policy_path(node)
        return
    if group == "model":  # the trainer builds the model folder through policy_path (model.warm_start)
        assert Path(policy_path(node)).is_dir()
        return
    if group == "callbacks":
        assert all(instantiate(c) is not None for c in node.values())
        return
    if group == "trainer" and node.accelerator == "gpu" and not torch.cuda.is_available():
        assert get_method(node._target_) is L.Trainer and node.use_distributed_sampler is False
        return
    if group == "trainer":
        assert instantiate(node, logger=False, callbacks=[]).max_epochs >= 1
        return
    assert instantiate(node) is not None


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_builds_with_a_valid_budget(tmp_path, experiment):
    """On the quick chain environment, unless the experiment is about its own (env=bfcl's settings)."""
    own_env = "override /env" in (CONF / "experiment" / f"{experiment}.yaml").read_text()
    env = [] if own_env else ["env=chain"]
    cfg = make_cfg(tmp_path, f"experiment={experiment}", "model=tiny", "logger=none", *env)
    _, data, fit = trainer.build(cfg)
    allocator = data.collector.allocator
    assert isinstance(allocator, TreeAllocator)
    assert allocator.n_roots(data.budget) * (1 + allocator.expansion) == cfg.budget.leaves
    assert fit.max_epochs == cfg.trainer.max_epochs


def test_impossible_budget_fails_at_start_up_naming_the_key(tmp_path):
    cfg = make_cfg(tmp_path, "debug=fast", "logger=none", "budget.leaves=7")  # trace: N = 2, 7 % 3 != 0
    with pytest.raises(BudgetError, match="budget.leaves"):
        trainer.build(cfg)


def test_wrong_type_and_unknown_key_fail_naming_the_key(tmp_path):
    with pytest.raises((ValidationError, ConfigCompositionException), match="budget.leaves"):
        make_cfg(tmp_path, "budget.leaves=abc")
    with pytest.raises(ConfigCompositionException, match="leavs"):
        make_cfg(tmp_path, "budget.leavs=3")
    with pytest.raises(ConfigCompositionException, match="allocator"):
        make_cfg(tmp_path, "allocator=nonsense")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.pool_size=1000", "data.pool_size"),  # more than the chain task's 24 tasks
        ("data.max_turns=0", "data.max_turns"),
        ("loss.clip_low=1.5", "loss.clip_low"),
        ("loss.kl_kind=k2", "loss.kl_kind"),
        ("sampling.temperature=0", "sampling.temperature"),
        ("sampling.top_p=0.9", "sampling.top_p"),  # log-probs would ignore the truncation
        ("data.steps_per_iteration=0", "data.steps_per_iteration"),
        ("trainer.accumulate_grad_batches=4", "data.steps_per_iteration"),  # the DataModule owns it
        ("predictor.pooling=max", "predictor.pooling"),
        ("cold_start.decay=2", "cold_start.decay"),
        ("module.max_skipped_steps=0", "module.max_skipped_steps"),
        ("checkpoints.keep_last=0", "checkpoints.keep_last"),
        ("trainer.reload_dataloaders_every_n_epochs=2", "trainer.reload_dataloaders_every_n_epochs"),
    ],
)
def test_bad_values_fail_before_any_model_engine_or_mlflow_run(tmp_path, monkeypatch, override, key):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad value was caught")

    monkeypatch.setattr(trainer, "build_policy", no_model)
    cfg = make_cfg(tmp_path, "debug=fast", "env.n_tasks=24", override)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        trainer.build(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was opened (nor left FAILED)


def test_a_misspelt_setting_names_the_real_one():
    with pytest.raises(config.UnknownSettingError, match=r"did you mean budget\.leaves"):
        config.check_overrides(["budget.leavs=3"])
    with pytest.raises(config.UnknownSettingError, match=r"env\.sandbox\.wall_seconds"):
        config.check_overrides(["env=math_tool", "env.sandbox.wall_secnds=2"])  # a key of the chosen group
    config.check_overrides(["env=math_tool", "env.sandbox.wall_seconds=2", "budget.leaves=6"])  # real keys
    config.check_overrides(["+extra.key=1", "-m", "allocator=uniform,trace", "allocator.expansion=2"])


def run_cli(tmp_path, *overrides):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trace_lightning.trainer",
            "debug=fast",
            f"output_root={tmp_path}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )


def test_cli_run_lands_in_mlflow_and_resume_continues_the_run(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(tmp_path, f"run_dir={run_dir}", "trainer.max_epochs=1", "budget.leaves=6")
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("trace_lightning")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # a training experiment
    (run,) = client.search_runs([experiment.experiment_id])
    # the printed link opens the run page in the UI's Model training view (tests/test_mlflow_ui.py)
    link = f"#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert link in first.stdout
    assert run.data.params["budget.leaves"] == "6"
    assert run.data.tags["allocator"] == "trace" and run.data.tags["env"] == "chain"
    assert (run.data.tags["base_model"], run.data.tags["warm_start"]) == ("tiny_model", "none")
    # the console: Lightning's INFO lines (seed, accelerator, the litlogger tip) go to the log file
    assert "litlogger" not in first.stdout + first.stderr and "Seed set to" not in first.stderr
    assert "litlogger" in (run_dir / "trainer.log").read_text()
    assert "train/loss" in run.data.metrics
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert client.list_artifacts(run.info.run_id), "the checkpoint should be attached to the run"
    steps = len(client.get_metric_history(run.info.run_id, "train/loss"))

    again = run_cli(
        tmp_path, f"run_dir={run_dir}", "trainer.max_epochs=2", "budget.leaves=6", "ckpt_path=last"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # the same MLflow run, continued
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) > steps


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    cfg = make_cfg(tmp_path, "debug=fast", "ckpt_path=last")
    with pytest.raises(FileNotFoundError, match="ckpt_path=last"):
        trainer.build(cfg)


def test_configs_ship_inside_the_package_or_checkout():
    assert (CONF / "train.yaml").is_file()
    assert (
        Path(config.__file__).resolve().parents[1].joinpath("conf", "train.yaml").is_file()
        or CONF.parent.name == "trace_lightning"
    )


def test_scheduler_from_config_steps_the_learning_rate(tmp_path):
    cfg = make_cfg(tmp_path, "debug=fast", "logger=none", "scheduler=warmup", "callbacks=none")
    module, data, fit = trainer.build(cfg)
    fit.fit(module, datamodule=data)
    (scheduler,) = fit.lr_scheduler_configs
    assert scheduler.interval == "step"
    assert scheduler.scheduler.last_epoch == fit.global_step > 0  # stepped once per optimizer step
