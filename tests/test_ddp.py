"""Two-process DDP on CPU (gloo) through the CLI's own build(): one global Stage 1 allocation, made
identically by both processes, each prompt rolled out by exactly one of them, the leaf budget holding
over the two together, and the same number of optimizer steps on each (DDP syncs every backward)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    overrides = ["budget.leaves=12", "data.pool_size=8", "trainer.max_epochs=3"]
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_both_processes_make_the_same_global_allocation(ranks):
    zero, one = ranks
    assert len(zero) == len(one) == 3
    for a, b in zip(zero, one, strict=True):
        assert a["processes"] == b["processes"] == 2
        assert a["pool_predicted"] == b["pool_predicted"]  # gathered scores, identical everywhere
        assert a["root_counts"] == b["root_counts"]
        assert sum(a["root_counts"]) * 3 == 12  # trace, N = 2: M bare rollouts + 2M continuations
    # after the cold-start iteration the gathered predictor scores are used, not the prior
    assert len(set(zero[-1]["pool_predicted"])) > 1


def test_each_prompt_is_rolled_out_once_and_the_budget_holds_globally(ranks):
    for a, b in zip(*ranks, strict=True):
        assert not set(a["local_trees"]) & set(b["local_trees"])
        assert sorted(a["local_trees"] + b["local_trees"]) == a["trees"] == b["trees"]
        assert a["local_leaves"] + b["local_leaves"] == a["leaves_used"] == b["leaves_used"] == 12


def test_processes_run_the_same_number_of_micro_batches(ranks):
    for a, b in zip(*ranks, strict=True):
        assert a["batches"] == b["batches"] >= 1
