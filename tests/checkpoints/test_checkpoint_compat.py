"""The `trace_lightning/checkpoints/` package: old import paths still work, checkpoints written
before the move resume after it, and no import hides inside a function (the import graph, circles
included, is checked by tests/test_architecture.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

import trace_lightning.checkpoints as package
from trace_lightning import config, trainer
from trace_lightning.checkpoints import CheckpointError, fingerprint
from trace_lightning.checkpoints.files import Manifest
from trace_lightning.checkpoints.fingerprint import same_group

FIXTURES = Path(__file__).parents[1] / "fixtures" / "checkpoints_6395ee8"  # see its README.md
# The overrides the fixtures were written with (the fingerprint and the seeded tiny model depend on them)
WRITTEN_WITH = [
    "debug=fast",
    "logger=none",
    "~callbacks.progress",
    "~callbacks.summary",
    "model.hidden_size=8",
    "model.heads=1",
    "model.kv_heads=1",
    "model.layers=1",
]
OLD_HEAD = ("policy_features=true", "text_buckets=0", "posterior_features=false", "width=256")
ADAPTERS = {
    "full": ["adapter=none"],
    "lora": ["adapter=lora", "adapter.r=2", "adapter.target_modules=[q_proj,v_proj]"],
}


def test_old_module_paths_resolve_to_the_same_objects_without_the_old_files() -> None:
    """The modules that moved have no file at their old path; a fingerprint's old `_target_` still names
    the same object through `fingerprint.MOVED`."""
    old = {
        "trace_lightning.checkpoint_io": ("AtomicCheckpointIO", "plain_state"),
        "trace_lightning.checkpoint_files": ("Manifest", "digest_path", "write_atomic", "pid_alive"),
        "trace_lightning.checkpoint_shards": ("validate_folder", "write_digests", "INDEX_GLOBALS"),
        "trace_lightning.envs.jail": ("JailUnavailableError",),
        "trace_lightning.envs.sandbox_worker": ("PROGRAM", "STARTED"),
    }
    for module, names in old.items():
        assert importlib.util.find_spec(module) is None, f"{module} should be gone"
        new = importlib.import_module(fingerprint.MOVED[module])
        for name in names:
            assert fingerprint._resolve(f"{module}.{name}") is getattr(new, name), (module, name)


def test_the_package_imports_nothing_inside_a_function() -> None:
    """The circle checkpoints.py <-> checkpoint_shards.py once hid behind an import inside a function;
    every import here stays at the top of its module, where a reader sees it. The import graph itself
    (no circle, nothing imported from outside checkpoints/) is tests/test_architecture.py's."""
    nested = [
        f"{path.name}:{inner.lineno}"
        for path in Path(package.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Import | ast.ImportFrom)
    ]
    assert nested == []


def _resume(tmp_path: Path, kind: str, *extra: str) -> tuple[dict, dict, int, Manifest]:
    """Resume the fixture's run for one more iteration; the weights and DataModule iteration it started
    with, and its manifest afterwards."""
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / kind, run_dir / "checkpoints", dirs_exist_ok=True)
    config.register()
    overrides = [f"output_root={tmp_path}", f"run_dir={run_dir}", *WRITTEN_WITH, *ADAPTERS[kind], *extra]
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", [*overrides, "ckpt_path=last", "trainer.max_epochs=2"])
    module, data, fit = trainer.build(cfg)
    seen: dict = {}

    class Start(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            """After Lightning restored the weights, before anything trains (or refits the head)."""
            seen["weights"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.setdefault("iteration", trainer.datamodule.report.iteration)

    fit.callbacks.append(Start())
    fit.fit(module, datamodule=data, ckpt_path=fit.strategy.checkpoint_io.resume_from)
    return seen["weights"], data, seen["iteration"], Manifest.read(run_dir / "checkpoints")


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_a_checkpoint_written_before_the_move_resumes_after_it(tmp_path: Path, kind: str) -> None:
    """The fixtures predate the text-feature predictor and the settings exposed since, so the config check
    names those groups (a setting added since is a difference: today's default need not be what the old
    run did); past that override, the files from before the modules moved load and the run continues."""
    saved = torch.load(FIXTURES / kind / "iteration-0000.ckpt", weights_only=True)
    with pytest.raises(CheckpointError, match="another allocator, model, predictor config"):
        _resume(tmp_path, kind)
    anyway = ["checkpoints.allow_config_change=true", *(f"predictor.{k}" for k in OLD_HEAD)]  # same shapes
    weights, _, iteration, manifest = _resume(tmp_path, kind, *anyway)
    trained = [k for k in saved["state_dict"] if "lora_" in k or kind == "full"]
    assert trained
    for key in trained:  # the resumed module starts from the checkpoint's weights
        assert torch.equal(weights[key], saved["state_dict"][key]), key
    assert iteration == 1  # the next iteration after the checkpoint's, not a fresh start at 0
    assert manifest.run == Manifest.read(FIXTURES / kind).run  # the same run continues
    assert manifest.files[-1] == "iteration-0001.ckpt"


def test_a_fingerprint_is_the_same_across_a_moved_target_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    target = "trace_lightning.checkpoints.plugin.AtomicCheckpointIO"
    now = {"_target_": target, "keep_last": 2}
    stored = {"_target_": "trace_lightning.checkpoint_io.AtomicCheckpointIO", "keep_last": 2}  # old path

    def same(a: dict, b: dict) -> bool:
        return same_group(json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True))

    assert same(stored, now)  # the old path names the same class
    assert not same(stored, {**now, "frozen": None})  # a setting added since, even at its default
    assert not same({**stored, "keep_last": 3}, now)  # a changed setting
    assert not same({**stored, "_target_": "trace_lightning.checkpoints.plugin.plain_state"}, now)
    imported: list[str] = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    assert not same({**stored, "_target_": "json.JSONDecoder"}, now)  # never imported: not our code
    assert not any(name.startswith("json") for name in imported)
