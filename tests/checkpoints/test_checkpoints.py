"""Checkpoint corruptions, each refused with a named error, and no code run from a planted file.

One real checkpoint is trained once per module (debug=fast, one iteration); every case copies it and
damages the copy in its own way. The table's size and results are the red-team pass's figures:
`pytest tests/checkpoints/test_checkpoints.py -k corruption -v`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import OverrideParseException

from trace_lightning import config, trainer
from trace_lightning.checkpoints import CheckpointError, newest_valid_checkpoint, validate_checkpoint
from trace_lightning.checkpoints.files import Manifest, clean_stale_temps, digest_path
from trace_lightning.checkpoints.plugin import AtomicCheckpointIO, plain_state

FAST = ["debug=fast", "~callbacks.progress", "logger=none"]


def make_cfg(tmp_path: Path, run_dir: Path, *overrides: str):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one iteration; its checkpoint folder holds iteration-0000.ckpt, digest, manifest. Every
    step moves AdamW (the tiny model's random policy rarely has contrast: without this its steps would
    be held and the checkpoint would hold no Adam moments to damage)."""
    root = tmp_path_factory.mktemp("trained")
    trainer.train(make_cfg(root, root / "run", "trainer.max_epochs=1", "module.hold_on_zero_gradient=false"))
    return root / "run" / "checkpoints" / "iteration-0000.ckpt"


def write_digest(path: Path) -> None:
    """What an attacker who can write the folder can also do: make the digest match."""
    digest_path(path).write_text(hashlib.sha256(path.read_bytes()).hexdigest())


class Planted:
    """Unpickling this calls open(marker, "w"): code running inside the loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# --------------------------------------------------------------------------- the corruption table
# Each case turns a copy of the good checkpoint (`path`) into a damaged file at `path` and names the
# `reason` the loader must give. `marker` is a file only planted code would create.


def truncated(path: Path, marker: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def truncated_digest_redone(path: Path, marker: Path) -> None:
    truncated(path, marker)
    write_digest(path)


def empty_file(path: Path, marker: Path) -> None:  # what a kill during a plain open(..., "wb") leaves
    path.write_bytes(b"")
    write_digest(path)


def bytes_flipped_mid_file(path: Path, marker: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def digest_missing(path: Path, marker: Path) -> None:
    digest_path(path).unlink()


def planted_pickle_in_zip(path: Path, marker: Path) -> None:
    """A torch.save archive whose pickle runs code; its digest is valid (the attacker wrote it)."""
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "x": Planted(marker)}, path)
    write_digest(path)


def planted_pickle_protocol_4(path: Path, marker: Path) -> None:  # STACK_GLOBAL instead of GLOBAL
    torch.save(
        {"state_dict": {}, "epoch": 0, "global_step": 0, "x": Planted(marker)}, path, pickle_protocol=4
    )
    write_digest(path)


def planted_raw_pickle(path: Path, marker: Path) -> None:  # the legacy (non-zip) torch format
    path.write_bytes(pickle.dumps({"state_dict": Planted(marker)}))
    write_digest(path)


def planted_numpy_reduce(path: Path, marker: Path) -> None:
    """A global that torch's own weights_only list may allow once a library widened it: still refused."""
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "rng": np.arange(3)}, path)
    write_digest(path)


def _resave(path: Path, edit: Callable[[dict], None]) -> None:
    """Edit the checkpoint and write it the way the trainer does (valid digest, same run)."""
    ckpt = torch.load(path, weights_only=True)
    edit(ckpt)
    AtomicCheckpointIO(run="test").save_checkpoint(ckpt, path)


def nan_in_adam_state(path: Path, marker: Path) -> None:
    def edit(ckpt: dict) -> None:
        state = next(iter(ckpt["optimizer_states"][0]["state"].values()))
        state["exp_avg_sq"].view(-1)[0] = float("nan")

    _resave(path, edit)


def inf_in_a_weight(path: Path, marker: Path) -> None:
    def edit(ckpt: dict) -> None:
        next(v for v in ckpt["state_dict"].values() if v.is_floating_point()).view(-1)[0] = float("inf")

    _resave(path, edit)


def not_a_lightning_checkpoint(path: Path, marker: Path) -> None:
    AtomicCheckpointIO(run="test").save_checkpoint({"weights": torch.zeros(2)}, path)


def deleted(path: Path, marker: Path) -> None:
    path.unlink()


CORRUPTIONS = {
    truncated: "digest_mismatch",
    truncated_digest_redone: "corrupt",
    empty_file: "corrupt",
    bytes_flipped_mid_file: "digest_mismatch",
    digest_missing: "no_digest",
    planted_pickle_in_zip: "unsafe_pickle",
    planted_pickle_protocol_4: "unsafe_pickle",
    planted_raw_pickle: "corrupt",
    planted_numpy_reduce: "unsafe_pickle",
    nan_in_adam_state: "non_finite",
    inf_in_a_weight: "non_finite",
    not_a_lightning_checkpoint: "not_lightning",
    deleted: "missing",
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS), ids=[f.__name__ for f in CORRUPTIONS])
def test_corruption_is_refused_with_a_named_error(trained: Path, tmp_path: Path, damage: Callable) -> None:
    path = tmp_path / trained.name
    shutil.copy(trained, path)
    shutil.copy(digest_path(trained), digest_path(path))
    marker = tmp_path / "code-ran"
    damage(path, marker)
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint(path)
    assert err.value.reason == CORRUPTIONS[damage]
    assert path.name in str(err.value)
    with pytest.raises(CheckpointError):  # Lightning's own load goes through the same checks
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()  # no planted code ran, in either load


def test_corruption_table_covers_the_issue_kinds() -> None:
    """>= 6 kinds, and the 5 the red-team pass named are among them (plus model size and other runs below)."""
    kinds = {f.__name__ for f in CORRUPTIONS}
    assert len(kinds) >= 6
    assert {"truncated", "bytes_flipped_mid_file", "planted_pickle_in_zip", "digest_missing"} <= kinds
    assert {"nan_in_adam_state", "inf_in_a_weight"} <= kinds


PLANTED = [planted_pickle_in_zip, planted_pickle_protocol_4, planted_raw_pickle]


@pytest.mark.parametrize("plant", PLANTED, ids=[f.__name__ for f in PLANTED])
def test_the_planted_pickles_would_run_code_if_loaded_unsafely(tmp_path: Path, plant: Callable) -> None:
    """The oracle for the table: the planted files are live, so 'marker absent' above means refused."""
    path, marker = tmp_path / "x.ckpt", tmp_path / "code-ran"
    plant(path, marker)
    with contextlib.suppress(RuntimeError):  # the raw pickle fails torch's magic check, after it ran
        torch.load(path, weights_only=False)
    assert marker.exists()


# --------------------------------------------------------------------------- resume-level refusals


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained.parents[1], run_dir)
    return run_dir


def test_a_planted_file_via_last_or_explicit_path_never_runs(trained: Path, tmp_path: Path) -> None:
    run_dir = _copy_run(trained, tmp_path)
    folder, marker = run_dir / "checkpoints", tmp_path / "code-ran"
    planted = folder / "iteration-0009.ckpt"
    planted_pickle_in_zip(planted, marker)
    manifest = Manifest.read(folder)
    manifest.add(planted.name)  # even listed as the newest of the run, with a valid digest
    manifest.write(folder)
    assert newest_valid_checkpoint(folder) == folder / "iteration-0000.ckpt"
    with pytest.raises(CheckpointError, match="iteration-0009.ckpt refused: its pickle imports"):
        trainer.build(make_cfg(tmp_path, run_dir, f"ckpt_path={planted}"))
    assert not marker.exists()


def test_last_never_chooses_another_runs_checkpoint(trained: Path, tmp_path: Path) -> None:
    run_dir = _copy_run(trained, tmp_path)
    folder = run_dir / "checkpoints"
    other = folder / "iteration-0005.ckpt"  # a valid, newer checkpoint of another run, digest and all
    shutil.copy(trained, other)
    write_digest(other)
    os.utime(other, (other.stat().st_mtime + 100,) * 2)
    assert validate_checkpoint(other)  # nothing wrong with the file itself
    assert newest_valid_checkpoint(folder) == folder / "iteration-0000.ckpt"


def test_other_allocator_or_model_size_is_a_named_error(trained: Path, tmp_path: Path) -> None:
    run_dir = _copy_run(trained, tmp_path)
    ckpt = f"ckpt_path={run_dir / 'checkpoints' / 'iteration-0000.ckpt'}"  # no "=" in the name: no quotes
    with pytest.raises(CheckpointError, match=r"another allocator config .*checkpoints.allow_config_change"):
        trainer.build(make_cfg(tmp_path, run_dir, ckpt, "allocator=uniform"))
    with pytest.raises(CheckpointError, match=r"another model config") as err:
        trainer.build(make_cfg(tmp_path, run_dir, ckpt, "model.hidden_size=64"))
    assert err.value.reason == "config_mismatch"
    # overriding the fingerprint still cannot load weights of another size: named, not a raw size error
    with pytest.raises(CheckpointError, match=r"holds another model: \d+ tensors differ in shape") as err:
        trainer.build(
            make_cfg(tmp_path, run_dir, ckpt, "model.hidden_size=64", "checkpoints.allow_config_change=true")
        )
    assert err.value.reason == "shape_mismatch"


def test_a_fresh_run_refuses_a_folder_that_holds_another_runs_checkpoints(
    trained: Path, tmp_path: Path
) -> None:
    run_dir = _copy_run(trained, tmp_path)
    with pytest.raises(
        CheckpointError, match="resume it with ckpt_path=last, or start this run in another run_dir"
    ):
        trainer.build(make_cfg(tmp_path, run_dir))


# --------------------------------------------------------------------------- files around checkpoints


def test_names_hold_no_equals_sign_and_the_run_wrote_a_manifest(trained: Path) -> None:
    names = sorted(p.name for p in trained.parent.iterdir())
    assert names == ["iteration-0000.ckpt", "iteration-0000.ckpt.sha256", "last.ckpt", "manifest.json"]
    assert Manifest.read(trained.parent).files == ["iteration-0000.ckpt"]
    assert digest_path(trained).read_text().strip() == hashlib.sha256(trained.read_bytes()).hexdigest()


def test_stale_temp_files_of_dead_processes_are_cleaned(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free (and will not be reused within this test)
    stale = tmp_path / f".iteration-0001.ckpt.tmp-{dead.pid}"
    alive = tmp_path / f".iteration-0002.ckpt.tmp-{os.getppid()}"  # a live writer: left alone
    own = tmp_path / f".iteration-0003.ckpt.tmp-{os.getpid()}"
    for p in (stale, alive, own):
        p.write_bytes(b"")
    AtomicCheckpointIO(run="r").save_checkpoint(
        {"state_dict": {}, "epoch": 0, "global_step": 0}, tmp_path / "a.ckpt"
    )
    assert not stale.exists() and alive.exists() and own.exists()
    assert clean_stale_temps(tmp_path) == []


def test_keep_last_prunes_older_checkpoints_with_their_digests(tmp_path: Path) -> None:
    io = AtomicCheckpointIO(run="r", keep_last=2)
    for i in range(4):
        io.save_checkpoint(
            {"state_dict": {}, "epoch": i, "global_step": i}, tmp_path / f"iteration-{i:04d}.ckpt"
        )
    assert Manifest.read(tmp_path).files == ["iteration-0002.ckpt", "iteration-0003.ckpt"]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt*")) == [
        "iteration-0002.ckpt",
        "iteration-0002.ckpt.sha256",
        "iteration-0003.ckpt",
        "iteration-0003.ckpt.sha256",
    ]
    io.remove_checkpoint(tmp_path / "iteration-0002.ckpt")  # Lightning's own removal keeps the manifest true
    assert Manifest.read(tmp_path).files == ["iteration-0003.ckpt"]


def test_numpy_state_is_saved_as_plain_python_and_loads_safely(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    state = {"counts": np.array([1, 2, 3]), "mean": np.float64(0.25), "rng": rng.bit_generator.state}
    assert plain_state(state) == {"counts": [1, 2, 3], "mean": 0.25, "rng": rng.bit_generator.state}
    AtomicCheckpointIO().save_checkpoint(
        {"state_dict": {}, "epoch": 0, "global_step": 0, "dm": state}, tmp_path / "a.ckpt"
    )
    loaded = validate_checkpoint(tmp_path / "a.ckpt")["dm"]
    assert loaded["counts"] == [1, 2, 3] and type(loaded["mean"]) is float
    restored = np.random.default_rng()
    restored.bit_generator.state = loaded["rng"]  # numpy's RNG state (big ints) round-trips exactly
    assert restored.integers(2**62) == np.random.default_rng(3).integers(2**62)


def test_a_resumed_run_prunes_the_checkpoint_it_started_from_once_superseded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=2"))
    folder = run_dir / "checkpoints"
    assert Manifest.read(folder).files == ["iteration-0000.ckpt", "iteration-0001.ckpt"]
    trainer.train(make_cfg(tmp_path, run_dir, "trainer.max_epochs=4", "ckpt_path=last"))  # from 0001
    assert Manifest.read(folder).files == ["iteration-0002.ckpt", "iteration-0003.ckpt"]
    assert sorted(p.name for p in folder.glob("*.ckpt")) == [
        "iteration-0002.ckpt",
        "iteration-0003.ckpt",
        "last.ckpt",
    ]
    assert (folder / "last.ckpt").resolve() == folder / "iteration-0003.ckpt"


def test_checkpoint_and_skip_limits_reach_their_owners(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, tmp_path / "run", "checkpoints.keep_last=5", "module.max_skipped_steps=3")
    module, _, fit = trainer.build(cfg)
    assert module.settings.max_skipped_steps == 3
    assert fit.strategy.checkpoint_io.keep_last == 5
    with pytest.raises(ValueError, match=r"checkpoints.keep_last=0 must be >= 1"):
        trainer.build(make_cfg(tmp_path, tmp_path / "run", "checkpoints.keep_last=0"))


@pytest.mark.parametrize("value", [{1, 2}, torch.device("cpu"), Path("x")], ids=["set", "device", "path"])
def test_state_the_loader_would_refuse_fails_at_save_not_at_resume(tmp_path: Path, value: object) -> None:
    io = AtomicCheckpointIO(run="r")
    with pytest.raises(CheckpointError, match=r"cannot save .*a.ckpt: the checkpoint holds a '.+'"):
        io.save_checkpoint(
            {"state_dict": {}, "epoch": 0, "global_step": 0, "dm": {"x": value}}, tmp_path / "a.ckpt"
        )
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_checkpoint_names_pass_hydras_override_parser_unquoted(trained: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, tmp_path / "run", f"ckpt_path={trained}")
    assert cfg.ckpt_path == str(trained)
    with pytest.raises(OverrideParseException):  # the old name, iteration-epoch=0000.ckpt, needed quotes
        make_cfg(tmp_path, tmp_path / "run", f"ckpt_path={trained.parent}/iteration-epoch=0000.ckpt")
