"""Two-process DDP on CPU (gloo) through the CLI's own build(): one global Stage 1 allocation, made
identically by both processes, each prompt rolled out by exactly one of them, the leaf budget holding
over the two together, and the same number of optimizer steps on each (DDP syncs every backward)."""

import pytest
from helpers import run_ddp_worker


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    overrides = ["budget.leaves=12", "data.pool_size=8", "trainer.max_epochs=3"]
    return run_ddp_worker(tmp_path_factory.mktemp("ddp"), *overrides)


def test_both_processes_make_the_same_global_allocation(ranks):
    zero, one = ranks
    assert len(zero) == len(one) == 3
    for a, b in zip(zero, one, strict=True):
        assert a["processes"] == b["processes"] == 2
        assert a["pool_predicted"] == b["pool_predicted"]  # gathered scores, identical everywhere
        assert a["root_counts"] == b["root_counts"]
        # trace, N = 2: M = 4 bare rollouts, then up to 2M continuations, the rest given back as roots
        assert sum(a["root_counts"]) + a["continuations"] == 12
    # after the cold-start iteration the gathered predictor scores are used, not the prior: every rollout
    # of the tiny model fails and the head learned it, while the Beta(1, 1) mean of a prompt seen in at
    # most two groups is at least 1/6 (and 1/2 for one never seen)
    assert zero[0]["pool_predicted"] == [0.5] * 8
    assert max(zero[-1]["pool_predicted"]) < 0.1


def test_each_prompt_is_rolled_out_once_and_the_budget_holds_globally(ranks):
    for a, b in zip(*ranks, strict=True):
        assert not set(a["local_trees"]) & set(b["local_trees"])
        assert sorted(a["local_trees"] + b["local_trees"]) == a["trees"] == b["trees"]
        assert a["local_leaves"] + b["local_leaves"] == a["leaves_used"] == b["leaves_used"] == 12


def test_processes_run_the_same_number_of_micro_batches(ranks):
    for a, b in zip(*ranks, strict=True):
        assert a["batches"] == b["batches"] >= 1


def test_the_rendezvous_store_listens_on_loopback_only(ranks):
    """One machine, MASTER_ADDR unset: Lightning's 127.0.0.1, and not every address as torch's default."""
    zero, _ = ranks
    assert zero[0]["store_listens"] == ["127.0.0.1"]
