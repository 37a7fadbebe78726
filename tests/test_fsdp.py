"""FSDP2 (trainer=fsdp2) on 2 CPU processes (gloo) through the CLI's own build()
(tests/helpers/fsdp_worker.py).

- One iteration sharded equals one iteration under DDP from the same seed: the same trees, the same
  per-step losses (1e-5) and the same updated weights (1e-4), for full weights and for LoRA. SGD, not
  AdamW, so that a gradient of the wrong scale (a head gradient not averaged over the processes, a
  clipping norm taken over one process's shards) changes the weights and cannot hide behind Adam's
  normalised first step.
- A sharded run resumed from its checkpoint equals an uninterrupted one: the same next batch, the same
  final weights, and the same MLflow run.
- A damaged shard file fails resume with a CheckpointError naming it.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from trace_lightning import config
from trace_lightning import trainer as cli
from trace_lightning.checkpoints import CheckpointError, newest_valid_checkpoint, validate_checkpoint
from trace_lightning.checkpoints.files import Manifest, digest_path
from trace_lightning.checkpoints.shards import write_digests

WORKER = Path(__file__).parent / "helpers" / "fsdp_worker.py"
# 12 leaves over 8 prompts, 2 leaf sequences per micro-batch (several optimizer steps per iteration)
COMMON = [
    "env._target_=helpers.fsdp_worker.ParityEnv",
    "budget.leaves=12",
    "data.pool_size=8",
    "data.micro_batch_tokens=null",
    "data.micro_batch_size=2",
    "optimizer._target_=torch.optim.SGD",
    "optimizer.lr=0.5",
    "~callbacks.progress",
]


def run_worker(out: Path, strategy: str, *overrides: str) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), strategy, *COMMON, *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    weights = torch.load(out / "weights.pt")
    return {"ranks": ranks, "start": weights["start"], "weights": weights["end"], "out": out}


@pytest.fixture(scope="module", params=["full", "lora"])
def pair(request, tmp_path_factory):
    adapter = ["adapter=none"] if request.param == "full" else ["adapter=lora", "adapter.r=4"]
    one = ["trainer.max_epochs=1", "logger=none", *adapter]
    root = tmp_path_factory.mktemp(f"fsdp_{request.param}")
    return run_worker(root / "ddp", "ddp", *one), run_worker(root / "fsdp2", "fsdp2", *one)


@pytest.mark.slow
def test_one_sharded_iteration_equals_one_unsharded(pair):
    ddp, fsdp = pair
    for a, b in zip(ddp["ranks"], fsdp["ranks"], strict=True):
        assert a["held_fraction"] == 1.0 and 0.4 < b["held_fraction"] < 0.6  # FSDP2 did shard
        assert a["rows"][0]["trees"] == b["rows"][0]["trees"]
        assert a["rows"][0]["root_counts"] == b["rows"][0]["root_counts"]
        assert [x[1] for x in a["batches"]] == [x[1] for x in b["batches"]]  # the same token ids
        assert len(a["losses"]) == len(b["losses"]) >= 2
        for (_, la), (_, lb) in zip(a["losses"], b["losses"], strict=True):
            assert abs(la - lb) < 1e-5
    assert sum(r["rows"][0]["rewards"] for r in ddp["ranks"]) > 0  # some leaves won: real advantages
    assert fsdp["ranks"][0]["rows"][0]["logprob_mismatch"] < 1e-4  # the copy samples the sharded weights
    assert ddp["weights"].keys() == fsdp["weights"].keys()
    assert ddp["start"].keys() == ddp["weights"].keys()
    moved = max((ddp["weights"][k] - v).abs().max().item() for k, v in ddp["start"].items())
    assert moved > 1e-3  # the iteration did change the policy, by more than the tolerance below
    for name, w in ddp["weights"].items():
        assert torch.allclose(w, fsdp["weights"][name], atol=1e-4, rtol=0), name


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_resume")
    straight = run_worker(root / "straight", "fsdp2", "trainer.max_epochs=2", "logger=none")
    first = run_worker(root / "resumed", "fsdp2", "trainer.max_epochs=1")
    again = run_worker(root / "resumed", "fsdp2", "trainer.max_epochs=2", "ckpt_path=last")
    return straight, first, again


@pytest.mark.slow
def test_sharded_resume_equals_an_uninterrupted_run(resumed):
    straight, first, again = resumed
    for s, a in zip(straight["ranks"], again["ranks"], strict=True):
        for key in ("iteration", "root_counts", "trees", "rewards"):
            assert s["rows"][1][key] == a["rows"][-1][key]
        next_batches = [b for b in s["batches"] if b[0] == 1]
        assert [b[1] for b in next_batches] == [b[1] for b in a["batches"]]  # the same next batch
        for b_s, b_a in zip(next_batches, a["batches"], strict=True):
            assert abs(b_s[2] - b_a[2]) < 1e-6  # old log-probs from the restored weights
    for name, w in straight["weights"].items():
        assert torch.allclose(w, again["weights"][name], atol=1e-6, rtol=0), name
    # iteration 1 was sampled after an update: the engine's unsharded copy had been refreshed to it
    assert straight["ranks"][0]["rows"][1]["logprob_mismatch"] < 1e-4
    assert first["ranks"][0]["run_id"] is not None
    assert again["ranks"][0]["run_id"] == first["ranks"][0]["run_id"]  # the same MLflow run


@pytest.mark.slow
def test_a_damaged_shard_is_named(resumed, tmp_path):
    _, first, _ = resumed
    folder = tmp_path / "checkpoints"
    shutil.copytree(first["out"] / "run" / "checkpoints", folder, symlinks=True)
    newest = folder / Manifest.read(folder).files[-1]
    assert validate_checkpoint(newest)["epoch"] == 1
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__1_0.distcp is missing or does not match its SHA-256"):
        validate_checkpoint(newest)
    assert newest_valid_checkpoint(folder) == folder / Manifest.read(folder).files[-2]


@pytest.mark.slow
def test_a_planted_index_is_refused_even_with_matching_digests(resumed, tmp_path):
    _, first, _ = resumed
    folder = tmp_path / "checkpoints"
    shutil.copytree(first["out"] / "run" / "checkpoints", folder, symlinks=True)
    newest = folder / Manifest.read(folder).files[-1]
    (newest / ".metadata").write_bytes(pickle.dumps(Planted()))
    digest_path(newest).write_bytes(write_digests(newest))  # an attacker who also rewrites the digests
    with pytest.raises(CheckpointError, match=r"\.metadata refused .*posix.system"):
        validate_checkpoint(newest)


class Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_fsdp2_needs_a_process_count(tmp_path):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", ["trainer=fsdp2", "trainer.devices=auto", f"run_dir={tmp_path}"])
    with pytest.raises(InstantiationException, match="trainer.devices='auto'"):  # named, with the fix
        instantiate(cfg.trainer.strategy)
    assert cli.config_fingerprint(cfg)  # the group composes with the rest of the config
