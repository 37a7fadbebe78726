"""Checkpoints that hold what trains: with LoRA a checkpoint holds the adapter, the
head, the optimizer, scheduler and DataModule state, and names the base model by folder and digest; a
resume refuses a changed base; full-weights runs keep full checkpoints; MLflow receives the trained
weights once, as a loadable adapter, instead of every checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from mlflow.tracking import MlflowClient
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trace_lightning import config, trainer
from trace_lightning.checkpoints import CheckpointError, validate_checkpoint
from trace_lightning.checkpoints.files import Manifest
from trace_lightning.checkpoints.frozen import FrozenWeights
from trace_lightning.model_folder import MARKER
from trace_lightning.models import build_policy, build_tiny_model

FAST = ["debug=fast", "~callbacks.progress", "~callbacks.summary", "budget.leaves=12"]
LORA = ["adapter=lora", "adapter.r=4"]


def make_cfg(tmp_path: Path, run_dir: Path, *overrides: str):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides])


def trees(run_dir: Path, k: int) -> dict:
    record = json.loads((run_dir / "artifacts" / "trees" / f"iteration_{k:04d}.json").read_text())
    return {"trees": record["trees"], "root_counts": record["root_counts"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    # every step moves AdamW, so that the checkpoint holds the adapter's moments (see test_checkpoints)
    hold = "module.hold_on_zero_gradient=false"
    trainer.train(make_cfg(root, root / "run", "trainer.max_epochs=1", "logger=none", hold, *LORA))
    return root / "run"


def test_a_lora_checkpoint_holds_what_trains_and_names_its_base(lora_run: Path) -> None:
    ckpt = validate_checkpoint(lora_run / "checkpoints" / "iteration-0000.ckpt")
    policy = build_policy(lora_run / "tiny_model", instantiate(make_cfg(lora_run, lora_run, *LORA).adapter))
    trainable = {f"policy.{n}" for n, p in policy.model.named_parameters() if p.requires_grad}
    frozen = {f"policy.{n}" for n, p in policy.model.named_parameters() if not p.requires_grad}
    saved = set(ckpt["state_dict"])
    assert trainable and trainable <= saved  # every adapter weight
    assert not saved & frozen  # no base weight
    assert {k for k in saved if not k.startswith("policy.")} == {k for k in saved if k.startswith("head.")}
    base = ckpt["trace_run"]["base"]
    assert base["path"] == str(lora_run / "tiny_model") and len(base["sha256"]) == 64
    assert base["frozen"] >= len(frozen)  # tied weights appear under two state_dict keys
    moments = ckpt["optimizer_states"][0]["state"]
    assert len(moments) == len([p for p in policy.model.parameters() if p.requires_grad])  # the adapter's
    assert ckpt["RolloutDataModule"]["iteration"] == 1


def test_the_digest_is_of_the_frozen_values(tiny_policy) -> None:
    model = tiny_policy.model.requires_grad_(False)
    first = FrozenWeights.of(model, "here")
    assert first is not None and first.keys == set(model.state_dict())
    assert FrozenWeights.of(model, "elsewhere").sha256 == first.sha256  # the values, not the path
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] += 1e-3
    assert FrozenWeights.of(model, "here").sha256 != first.sha256
    assert FrozenWeights.of(model.requires_grad_(True), "here") is None  # full weights: nothing left out


def test_a_full_weights_checkpoint_stays_full(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=1", "logger=none"))
    ckpt = validate_checkpoint(run_dir / "checkpoints" / "iteration-0000.ckpt")
    assert "base" not in ckpt["trace_run"]
    policy = build_policy(run_dir / "tiny_model")
    assert {f"policy.{k}" for k in policy.model.state_dict()} <= set(ckpt["state_dict"])


@pytest.mark.slow  # three runs; tests/test_fsdp.py resumes a sharded LoRA run exactly too
def test_a_lora_run_resumes_exactly(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    weights = {}
    for run_dir, epochs in ((straight, [3]), (resumed, [2, 3])):
        for i, n in enumerate(epochs):
            extra = ["ckpt_path=last"] if i else []
            trainer.train(
                make_cfg(tmp_path, run_dir, f"trainer.max_epochs={n}", "logger=none", *LORA, *extra)
            )
        weights[run_dir] = validate_checkpoint(run_dir / "checkpoints" / "iteration-0002.ckpt")["state_dict"]
    assert trees(resumed, 2) == trees(straight, 2)
    for key, value in weights[straight].items():  # the adapter and head after the resumed iteration
        assert torch.equal(value, weights[resumed][key]), key


def _warm_start(folder: Path, seed: int) -> Path:
    """A model folder as `python -m trace_lightning.warmstart` leaves it (the tiny model, its marker)."""
    build_tiny_model(folder, hidden_size=128, heads=2, kv_heads=1, seed=seed)
    (folder / MARKER).write_text("{}")
    return folder


def test_a_changed_base_model_is_refused(tmp_path: Path) -> None:
    """The same model.warm_start folder (so the same config fingerprint), trained again in place."""
    base = _warm_start(tmp_path / "warm", seed=0)
    run_dir = tmp_path / "run"
    common = [f"model.warm_start={base}", "data.held_out=0", "logger=none", *LORA]  # it held none out
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=1", *common))
    _warm_start(base, seed=1)
    with pytest.raises(CheckpointError, match="the base model changed since") as err:
        trainer.build(make_cfg(tmp_path, run_dir, "trainer.max_epochs=2", "ckpt_path=last", *common))
    assert err.value.reason == "base_changed" and str(base) in str(err.value)
    _warm_start(base, seed=0)  # the same base again: resumes
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=2", "ckpt_path=last", *common))
    assert Manifest.read(run_dir / "checkpoints").files[-1] == "iteration-0001.ckpt"


def test_mlflow_gets_a_loadable_adapter_once_and_no_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = make_cfg(
        tmp_path,
        run_dir,
        "trainer.max_epochs=2",
        *LORA,
        "callbacks.model_artifact.best=train/loss",
        "callbacks.model_artifact.mode=min",
    )
    module, data, fit = trainer.build(cfg)
    fit.fit(module, datamodule=data)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = fit.logger.run_id
    top = {a.path for a in client.list_artifacts(run_id)}
    assert "model" in top and not any(p.endswith(".ckpt") for p in top)  # no checkpoint copies
    final = {Path(a.path).name for a in client.list_artifacts(run_id, "model/final")}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "head.safetensors",
        "trace_lightning.json",
    } <= final
    assert {Path(a.path).name for a in client.list_artifacts(run_id, "model/best")}  # asked for, logged
    folder = Path(client.download_artifacts(run_id, "model/final", str(tmp_path / "download")))
    info = json.loads((folder / "trace_lightning.json").read_text())
    assert info["adapter"] and info["base_model"] == str(run_dir / "tiny_model")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(info["base_model"]), folder)
    trained = {k: v for k, v in module.policy.state_dict().items() if "lora_" in k}
    restored = loaded.state_dict()
    assert trained
    for key, value in trained.items():  # the adapter as trained, on its base
        assert torch.equal(restored[key], value.cpu()), key
    head = load_file(folder / "head.safetensors")
    for key, value in module.head.state_dict().items():
        assert torch.equal(head[key], value.cpu()), key
    assert sum(f.stat().st_size for f in folder.iterdir()) < 2e6  # the tiny model's adapter: kilobytes


@pytest.mark.slow
def test_a_sharded_lora_checkpoint_leaves_the_base_out_and_resumes(tmp_path: Path) -> None:
    import torch.distributed as dist

    from trace_lightning.checkpoints.shards import VERIFIED

    run_dir, fsdp2 = tmp_path / "run", ["trainer=fsdp2", "trainer.devices=1", "logger=none", *LORA]
    environ = dict(os.environ)  # the one-process group sets MASTER_PORT and ranks: not for later tests
    try:
        trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=1", *fsdp2))
        folder = run_dir / "checkpoints" / "iteration-0000.ckpt"
        ckpt = validate_checkpoint(folder)
        assert "base" in ckpt["trace_run"] and not any("base_layer" in k for k in ckpt["state_dict"])
        assert any("lora_A" in k for k in ckpt["state_dict"]) and ckpt[VERIFIED].processes == 1
        trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=2", "ckpt_path=last", *fsdp2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert Manifest.read(run_dir / "checkpoints").files[-1] == "iteration-0001.ckpt"
    shutil.rmtree(run_dir)
