"""Run by tests/test_colocated.py as `python tests/helpers/colocated_worker.py OUT_DIR STRATEGY
[overrides...]`, STRATEGY `ddp` or `fsdp2`: the CLI's own `build()` and `fit` on 2 CPU processes (Lightning
relaunches this script for rank 1) with the vLLM engine, under a short torch.distributed timeout, so that a
process waiting on another fails within it instead of hanging. Each rank writes the trees it rolled out itself
in every iteration, and its engine's call count, to OUT_DIR/rank<k>.json.

`TurnsEnv` plays episodes of an exact number of turns, which may differ by rank (`turns_by_rank=[3, 1]`:
rank 0 plays 3-turn episodes, rank 1 one-turn ones), so that the processes have unequal work on purpose."""

import json
import sys
from datetime import timedelta
from pathlib import Path

# Run by path, this folder is sys.path[0]; tests/ makes `helpers` importable, so that the Hydra targets
# `helpers.<worker>.<Class>` resolve here as they do in the test process.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from trace_lightning import config
from trace_lightning import trainer as cli
from trace_lightning.envs.base import Transition
from trace_lightning.envs.chain import ChainEnv

TIMEOUT = timedelta(seconds=120)  # every collective of the run, vLLM's start-up included


class TurnsEnv(ChainEnv):
    """Every episode lasts exactly `turns_by_rank[rank]` turns (any action text is accepted); the last turn
    wins when its text has an even length, so rewards are mixed and continuations have prefixes to
    start from. `rank` is the process's in the run's process group (0 without one) unless given."""

    name = "turns"

    def __init__(self, turns_by_rank: list[int], rank: int | None = None, **chain) -> None:
        super().__init__(**chain)
        self.turns_by_rank, self.rank = list(turns_by_rank), rank

    def step(self, task, state, action_text):
        turn = state[0] + 1
        rank = self.rank
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if turn < self.turns_by_rank[rank]:
            return Transition("<observation>next</observation>", False, 0.0, None, (turn, 0))
        reward = float(len(action_text) % 2 == 0)
        return Transition("", True, reward, "solved" if reward else "lost", (turn, 0))


def tree_record(tree) -> dict:
    """A tree as plain data: every node's parent, stage, generated tokens and reward."""
    return {
        "task_id": tree.task_id,
        "nodes": [[n.parent, n.stage, list(n.action_ids), n.reward] for n in tree.nodes],
    }


class Record(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_epoch_start(self, trainer, pl_module):
        report = trainer.datamodule.report
        self.rows.append(
            {
                "iteration": report.iteration,
                "root_counts": report.result.root_counts.tolist(),
                "local_trees": [tree_record(t) for t in report.local_trees],
                "engine_calls": report.engine_stats.calls,
                "leaves_used": report.result.ledger.leaves_used,
                "logprob_mismatch": report.logprob_mismatch,
            }
        )


def compose_config(out: Path, *overrides: str):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=["debug=fast", f"output_root={out}", f"run_dir={out}/run", "logger=none", *overrides],
        )


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    chosen = ["trainer=fsdp2"] if strategy == "fsdp2" else ["trainer.strategy=ddp", "trainer.devices=2"]
    module, data, trainer = cli.build(compose_config(out, *chosen, *sys.argv[3:]))
    trainer.strategy._timeout = TIMEOUT  # DDPStrategy and ModelParallelStrategy both read it at set-up
    record = Record()
    trainer.callbacks.append(record)
    trainer.fit(module, datamodule=data)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.rows))


if __name__ == "__main__":
    main()
