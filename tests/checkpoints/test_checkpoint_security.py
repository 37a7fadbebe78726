"""Checkpoints loaded from the bytes that were checked, single files and sharded folders.

Each case is one the red team used on 6395ee8 (or the same class of attack, built here): a crafted zip
whose pickle torch reads differently from Python's zipfile, a file swapped between the check and the
load, manifest entries leading out of the run's folder or naming another run's file, NaN outside the
weights, a sharded index naming a file outside its folder or a link, a sharded folder rewritten
after validation (code ran through `pickle.load` and `torch.load(weights_only=False)` there), and a
sharded folder given to a run with another strategy or process count. Every test here fails on
6395ee8. The sharded ones write a real FSDP2 checkpoint in this process (trainer=fsdp2 with one
process, gloo), so they run in the default suite; tests/test_fsdp.py covers two processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import pickletools
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from trace_lightning import config, trainer
from trace_lightning.checkpoints import AtomicCheckpointIO, CheckpointError, validate_checkpoint
from trace_lightning.checkpoints.convert import to_single_file
from trace_lightning.checkpoints.files import Manifest, digest_path
from trace_lightning.checkpoints.reader import load_full
from trace_lightning.checkpoints.scan import non_finite, refuse_non_finite
from trace_lightning.checkpoints.shards import INDEX_FILE, VERIFIED, VerifiedFolder, write_digests
from trace_lightning.checkpoints.validate import newest_valid_checkpoint
from trace_lightning.sharding import FSDP2Strategy

FAST = ["debug=fast", "~callbacks.progress", "~callbacks.summary", "logger=none"]
FSDP2_ONE = ["trainer=fsdp2", "trainer.devices=1"]


def make_cfg(tmp_path: Path, run_dir: Path, *overrides: str):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose("train", [f"output_root={tmp_path}", f"run_dir={run_dir}", *FAST, *overrides])


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """trainer=fsdp2 in this process starts a (one-process) process group and sets MASTER_PORT and the
    rank variables: leave neither to later tests (DDP workers would inherit the port, still bound)."""
    environ = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    trainer.train(make_cfg(root, root / "run", "trainer.max_epochs=1"))
    return root / "run" / "checkpoints" / "iteration-0000.ckpt"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded (FSDP2, one process) checkpoint folder of one iteration."""
    root = tmp_path_factory.mktemp("sharded")
    with own_process_group():
        trainer.train(make_cfg(root, root / "run", "trainer.max_epochs=1", *FSDP2_ONE))
    folder = root / "run" / "checkpoints" / "iteration-0000.ckpt"
    assert folder.is_dir() and (folder / "__0_0.distcp").is_file()
    return folder


def copy_run(checkpoint: Path, tmp_path: Path, name: str = "run") -> Path:
    """A copy of the checkpoint's run folder; the copied checkpoint's path."""
    shutil.copytree(checkpoint.parents[1], tmp_path / name, symlinks=True)
    return tmp_path / name / "checkpoints" / checkpoint.name


def write_digest(path: Path) -> None:
    """What an attacker who can write the folder can also do: make the digest match."""
    if path.is_dir():
        digest_path(path).write_bytes(write_digests(path))
    else:
        digest_path(path).write_text(hashlib.sha256(path.read_bytes()).hexdigest())


class Planted:
    """Unpickling this calls open(marker, "w"): code running inside the loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# --------------------------------------------------------------------------- one file


def _with_planted_pickle(good: Path, path: Path, evil_pickle: bytes, *, before: bool) -> None:
    """Copy `good` to `path` with `archive/DATA.PKL` (the evil pickle) next to the real data.pkl."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            planted = info.filename.endswith("/data.pkl")
            if planted and before:
                out.writestr(info.filename[: -len("data.pkl")] + "DATA.PKL", evil_pickle)
            out.writestr(info.filename, src.read(info.filename))
            if planted and not before:
                out.writestr(info.filename[: -len("data.pkl")] + "DATA.PKL", evil_pickle)
    write_digest(path)


def test_a_zip_whose_pickle_torch_and_zipfile_read_differently_is_refused(
    trained: Path, tmp_path: Path
) -> None:
    """torch's zip reader finds `data.pkl` case-insensitively: put `archive/DATA.PKL` (importing
    torch.device, which torch's weights_only list allows and ours does not) beside the real one, and
    torch may load it while a zipfile scan reads the real one. Which of the two torch finds depends
    on where a binary search over the sorted names lands (so on how many entries the archive has):
    both placements are built, torch must read the planted one in at least one, and both are refused."""
    ckpt = torch.load(trained, weights_only=True)
    evil = io.BytesIO()
    torch.save({**ckpt, "planted": torch.device("cpu")}, evil)  # same tensors, so the same storages
    evil_pickle = zipfile.ZipFile(evil).read("archive/data.pkl")
    torch_read_planted = []
    for before in (True, False):
        path = tmp_path / ("before" if before else "after") / trained.name
        path.parent.mkdir()
        _with_planted_pickle(trained, path, evil_pickle, before=before)
        torch_read_planted.append("planted" in torch.load(path, weights_only=True))
        with pytest.raises(CheckpointError) as err:
            validate_checkpoint(path)
        assert err.value.reason == "ambiguous_archive" and path.name in str(err.value)
    assert any(torch_read_planted)  # the control: some placement makes torch read the planted one


def test_a_file_swapped_after_its_check_is_not_what_loads(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader reads the file once: a swap between the digest/scan and torch.load changes nothing."""
    path = copy_run(trained, tmp_path)
    swapped = tmp_path / "swapped.ckpt"
    ckpt = torch.load(trained, weights_only=True)
    AtomicCheckpointIO(run="x").save_checkpoint({**ckpt, "global_step": 999}, swapped)
    real_genops = pickletools.genops

    def swap_then_scan(data: Any) -> Any:  # the scan runs after the digest check, before the load
        if path.read_bytes() != swapped.read_bytes():
            shutil.copy(swapped, path)
            write_digest(path)
        return real_genops(data)

    monkeypatch.setattr(pickletools, "genops", swap_then_scan)
    assert validate_checkpoint(path)["global_step"] == ckpt["global_step"] != 999
    assert path.read_bytes() == swapped.read_bytes()  # the swap did happen


def _other_run(trained: Path, tmp_path: Path, step: int = 5) -> Path:
    """A valid checkpoint of another run with the same config (so it would resume), newer."""
    ckpt = torch.load(trained, weights_only=True)
    other = tmp_path / "other" / "checkpoints" / "iteration-0005.ckpt"
    fingerprint = ckpt["trace_run"]["fingerprint"]
    AtomicCheckpointIO(run="another-run", fingerprint=fingerprint).save_checkpoint(
        {**ckpt, "global_step": step}, other
    )
    return other


def _list_newest(folder: Path, entry: str) -> None:
    manifest = Manifest(Manifest.read(folder).run, [*Manifest.read(folder).files, entry])
    manifest.write(folder)


@pytest.mark.parametrize("how", ["dot_dot", "absolute", "symlink"])
def test_last_never_follows_a_manifest_entry_out_of_the_folder(
    trained: Path, tmp_path: Path, how: str
) -> None:
    own = copy_run(trained, tmp_path)
    other = _other_run(trained, tmp_path)
    entry = {"dot_dot": f"../../other/checkpoints/{other.name}", "absolute": str(other)}.get(how, other.name)
    if how == "symlink":
        (own.parent / other.name).symlink_to(other)
    _list_newest(own.parent, entry)
    with pytest.raises(CheckpointError) as err:
        newest_valid_checkpoint(own.parent)
    assert err.value.reason == "unsafe_entry" and entry in str(err.value)
    with pytest.raises(CheckpointError, match="not a plain file"):  # and so a resume stops, naming it
        trainer.build(make_cfg(tmp_path, own.parents[1], "ckpt_path=last"))


def test_last_skips_a_listed_checkpoint_of_another_run(trained: Path, tmp_path: Path) -> None:
    """The manifest names its run; a listed file whose own run id differs is not resumed."""
    own = copy_run(trained, tmp_path)
    other = _other_run(trained, tmp_path)
    shutil.copy(other, own.parent / other.name)
    shutil.copy(digest_path(other), digest_path(own.parent / other.name))
    _list_newest(own.parent, other.name)
    assert validate_checkpoint(own.parent / other.name)["global_step"] == 5  # a sound file in itself
    assert newest_valid_checkpoint(own.parent) == own


def _first_float_tensor(state: Any) -> torch.Tensor:
    if isinstance(state, torch.Tensor) and state.is_floating_point():
        return state
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else []
    return next(t for v in values if (t := _first_float_tensor_or_none(v)) is not None)


def _first_float_tensor_or_none(state: Any) -> torch.Tensor | None:
    try:
        return _first_float_tensor(state)
    except StopIteration:
        return None


def _nan_in_prior(dm: dict) -> None:
    next(iter(dm["prior"]["counts"].values()))[0] = float("nan")


def _nan_in_replay(dm: dict) -> None:
    _first_float_tensor(dm["predictor_fit"]["replay"]).view(-1)[0] = float("nan")


def _nan_in_refit_optimizer(dm: dict) -> None:
    _first_float_tensor(dm["predictor_fit"]["optimizer"]["state"]).view(-1)[0] = float("inf")


def _nan_in_selection(dm: dict) -> None:
    dm["selection"]["history"] = [[0, float("nan"), 1.0, 2.0]]  # a row of the gate's evidence


NON_FINITE = [_nan_in_prior, _nan_in_replay, _nan_in_refit_optimizer, _nan_in_selection]


@pytest.mark.parametrize("poison", NON_FINITE, ids=[f.__name__[1:] for f in NON_FINITE])
def test_nan_in_the_datamodule_state_is_refused(trained: Path, tmp_path: Path, poison: Callable) -> None:
    ckpt = torch.load(trained, weights_only=True)
    poison(ckpt["RolloutDataModule"])
    path = tmp_path / "poisoned.ckpt"
    AtomicCheckpointIO(run=ckpt["trace_run"]["run"]).save_checkpoint(ckpt, path)
    with pytest.raises(CheckpointError, match=r"NaN or inf in \['RolloutDataModule'\]") as err:
        validate_checkpoint(path)
    assert err.value.reason == "non_finite"


def test_the_finite_check_reaches_floats_and_spares_only_modelcheckpoints_sentinels() -> None:
    assert non_finite({"a": [1.0, {"b": (2, float("nan"))}]}) == "['a'][1]['b'][1]"
    assert non_finite({"w": torch.tensor([1.0, float("inf")]), "n": torch.tensor([1, 2])}) == "['w']"
    lightning_state = {
        "callbacks": {"ModelCheckpoint{...}": {"kth_value": float("inf"), "best_model_score": None}}
    }
    refuse_non_finite("x", lightning_state)  # "no score yet": Lightning's own sentinel, not training state
    with pytest.raises(CheckpointError):
        refuse_non_finite("x", {"RolloutDataModule": {"kth_value": float("inf")}})


# --------------------------------------------------------------------------- sharded folders


def _index(folder: Path) -> Any:
    return VerifiedFolder(folder, None).index()


def test_a_sharded_index_naming_a_file_outside_its_folder_is_refused(sharded: Path, tmp_path: Path) -> None:
    folder = copy_run(sharded, tmp_path)
    outside = folder.parent / "outside.distcp"  # not in the folder, so no digest covers it
    shutil.copy(folder / "__0_0.distcp", outside)
    index = _index(folder)
    key = next(iter(index.storage_data))
    index.storage_data[key].relative_path = f"../{outside.name}"
    (folder / INDEX_FILE).write_bytes(pickle.dumps(index))
    write_digest(folder)
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint(folder)
    assert err.value.reason == "unsafe_entry" and "../outside.distcp" in str(err.value)


def test_a_link_inside_a_sharded_folder_is_refused(sharded: Path, tmp_path: Path) -> None:
    folder = copy_run(sharded, tmp_path)
    elsewhere = tmp_path / "meta-elsewhere.pt"
    shutil.move(folder / "meta.pt", elsewhere)
    (folder / "meta.pt").symlink_to(elsewhere)  # the same bytes, so the digest list still matches
    with pytest.raises(CheckpointError, match="symbolic link"):
        validate_checkpoint(folder)


def _plant_index(folder: Path, marker: Path) -> None:
    (folder / INDEX_FILE).write_bytes(pickle.dumps(Planted(marker)))


def _plant_item(folder: Path, marker: Path) -> None:
    """A non-tensor item (an optimizer hyperparameter) pointed at a planted torch.save pickle."""
    planted = io.BytesIO()
    torch.save(Planted(marker), planted)
    shard = folder / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(planted.getvalue())
    index = _index(folder)
    key = next(k for k in index.storage_data if k.fqn.endswith("param_groups.0.lr"))
    index.storage_data[key].offset, index.storage_data[key].length = offset, len(planted.getvalue())
    (folder / INDEX_FILE).write_bytes(pickle.dumps(index))


@pytest.mark.parametrize("plant", [_plant_index, _plant_item], ids=["index", "item"])
def test_a_sharded_folder_rewritten_after_validation_runs_no_code(
    sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: Callable
) -> None:
    """The red team's race, made deterministic: the folder is rewritten (digests too) right after the
    trainer validated it, before Lightning loads it. On 6395ee8 DCP then unpickled the planted file."""
    folder, marker = copy_run(sharded, tmp_path), tmp_path / "code-ran"
    validated = trainer._resume_point

    def then_tamper(cfg: Any) -> Any:
        point = validated(cfg)
        plant(folder, marker)
        write_digest(folder)
        return point

    monkeypatch.setattr(trainer, "_resume_point", then_tamper)
    cfg = make_cfg(tmp_path, folder.parents[1], "ckpt_path=last", "trainer.max_epochs=2", *FSDP2_ONE)
    with own_process_group(), pytest.raises(CheckpointError) as err:
        trainer.train(cfg)
    assert err.value.reason == "digest_mismatch"  # the digests checked at validation, not the new ones
    assert not marker.exists()


def _fit_seeing_weights(cfg: Any) -> dict[str, torch.Tensor]:
    """Fit, and return the policy's weights as training starts (after Lightning restored them)."""
    seen: dict[str, torch.Tensor] = {}

    class See(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            for key, value in pl_module.state_dict().items():
                if key.startswith("policy."):
                    full = value.full_tensor() if hasattr(value, "full_tensor") else value
                    seen[key] = full.detach().cpu().clone()

    with own_process_group():
        module, data, fit = trainer.build(cfg)
        fit.callbacks.append(See())
        fit.fit(module, datamodule=data, ckpt_path=fit.strategy.checkpoint_io.resume_from)
    return seen


@pytest.mark.parametrize(
    "overrides", [[], ["trainer=fsdp2", "trainer.devices=2"]], ids=["no_fsdp2", "other_process_count"]
)
def test_a_sharded_folder_in_another_strategy_is_named_with_how_to_convert(
    sharded: Path, tmp_path: Path, overrides: list[str]
) -> None:
    """On 6395ee8 a one-process run passed every check, then failed with 'Cannot copy out of meta tensor'."""
    folder = copy_run(sharded, tmp_path)
    with pytest.raises(CheckpointError, match="written by trainer=fsdp2 with 1 process, and this run") as err:
        trainer.build(make_cfg(tmp_path, folder.parents[1], f"ckpt_path={folder}", *overrides))
    assert err.value.reason == "strategy_mismatch"
    assert f"python -m trace_lightning.checkpoints.convert {folder}" in str(err.value)


def test_a_single_file_in_an_fsdp2_run_is_named(trained: Path, tmp_path: Path) -> None:
    path = copy_run(trained, tmp_path)
    with pytest.raises(CheckpointError, match="single file, written without trainer=fsdp2") as err:
        trainer.build(make_cfg(tmp_path, path.parents[1], f"ckpt_path={path}", *FSDP2_ONE))
    assert err.value.reason == "strategy_mismatch"


def test_a_converted_sharded_folder_resumes_without_fsdp2(sharded: Path, tmp_path: Path) -> None:
    folder = copy_run(sharded, tmp_path)
    saved = load_full(validate_checkpoint(folder)[VERIFIED])
    single = to_single_file(folder)
    assert single == folder.with_name("iteration-0000-single.ckpt")
    assert Manifest.read(folder.parent).files[-1] == single.name  # `last` now takes it
    ckpt = validate_checkpoint(single)
    assert ckpt["trace_run"]["run"] == Manifest.read(folder.parent).run
    moments = ckpt["optimizer_states"][0]["state"]  # keyed by position, as torch.optim keeps them
    assert sorted(moments) == list(range(len(moments))) and moments
    seen = _fit_seeing_weights(
        make_cfg(tmp_path, folder.parents[1], "ckpt_path=last", "trainer.max_epochs=2")
    )
    for key, weight in seen.items():
        assert torch.equal(weight, saved["state_dict"][key]), key
    assert Manifest.read(folder.parent).files[-1] == "iteration-0001.ckpt"


def test_no_unpickling_outside_the_allow_lists_on_the_sharded_load(
    sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded resume's load, watched: no `pickle.load`/`pickle.loads` and no torch.load that is not
    weights_only while FSDP2Strategy.load_checkpoint runs (DCP's own reader calls both); and what it
    loads is the saved weights."""
    folder = copy_run(sharded, tmp_path)
    calls: list[str] = []
    loading = [False]

    def watched(name: str, real: Callable, unsafe: Callable[[dict], bool]) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if loading[0] and unsafe(kwargs):
                calls.append(name)
            return real(*args, **kwargs)

        return call

    def watched_load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        loading[0] = True
        try:
            return real_load_checkpoint(self, *args, **kwargs)
        finally:
            loading[0] = False

    real_load_checkpoint = FSDP2Strategy.load_checkpoint
    monkeypatch.setattr(FSDP2Strategy, "load_checkpoint", watched_load_checkpoint)
    monkeypatch.setattr(
        torch, "load", watched("torch.load", torch.load, lambda kw: not kw.get("weights_only"))
    )
    monkeypatch.setattr(pickle, "load", watched("pickle.load", pickle.load, lambda kw: True))
    monkeypatch.setattr(pickle, "loads", watched("pickle.loads", pickle.loads, lambda kw: True))
    saved = load_full(validate_checkpoint(folder)[VERIFIED])["state_dict"]
    cfg = make_cfg(tmp_path, folder.parents[1], "ckpt_path=last", "trainer.max_epochs=2", *FSDP2_ONE)
    seen = _fit_seeing_weights(cfg)
    assert calls == []
    assert any(k.startswith("policy.") for k in seen)
    for key, weight in seen.items():  # and it did load the saved weights
        assert torch.equal(weight, saved[key]), key
    assert os.path.isdir(folder.with_name("iteration-0001.ckpt"))  # resumed, and saved the next
