"""Run by tests/test_distributed.py as `python tests/helpers/ddp_worker.py OUT_DIR [overrides...]`: the CLI's
own `build()` with trainer.strategy=ddp on 2 CPU processes (Lightning relaunches this script for rank 1). Each
rank writes its pid to OUT_DIR/rank<k>.pid when training starts, and what it saw of every iteration to
OUT_DIR/rank<k>.json at the end.

`StuckAt` (tests/test_stopping.py, `+callbacks.stuck._target_=helpers.ddp_worker.StuckAt`) makes one rank hang
at the start of a chosen iteration's first batch, as a process stuck outside any collective would: the
other rank then waits in the next collective forever."""

import json
import os
import sys
import time
from pathlib import Path

# Run by path, this folder is sys.path[0]; tests/ makes `helpers` importable, so that the Hydra targets
# `helpers.<worker>.<Class>` resolve here as they do in the test process.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
from hydra import compose, initialize_config_dir

from helpers import listening
from trace_lightning import config
from trace_lightning import trainer as cli


class Record(L.Callback):
    def __init__(self, out: Path):
        self.rows, self.out = [], out

    def on_train_start(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))
        self.store_listens = sorted(listening(int(os.environ["MASTER_PORT"])))  # while the store serves

    def on_train_epoch_start(self, trainer, pl_module):
        report = trainer.datamodule.report
        self.rows.append(
            {
                "iteration": report.iteration,
                "processes": report.processes,
                "pool_predicted": report.result.pool_predicted.tolist(),
                "root_counts": report.result.root_counts.tolist(),
                "leaves_used": report.result.ledger.leaves_used,
                "continuations": report.result.ledger.leaves["expand"],
                "trees": sorted(t.task_id for t in report.result.trees),
                "local_trees": sorted(t.task_id for t in trainer.datamodule.report.local_trees),
                "local_leaves": sum(len(t.leaves()) for t in trainer.datamodule.report.local_trees),
                "batches": len(trainer.train_dataloader),
                "logprob_mismatch": report.logprob_mismatch,
                "store_listens": self.store_listens,
            }
        )


class StuckAt(L.Callback):
    """Rank `rank` never returns from the first batch of iteration `epoch` (it writes `marker` first)."""

    def __init__(self, rank: int = 1, epoch: int = 1, marker: str = "stuck") -> None:
        self.rank, self.epoch, self.marker = rank, epoch, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch:
            Path(trainer.default_root_dir, self.marker).write_text(str(os.getpid()))
            while True:  # a signal handler that returns does not end this (PEP 475)
                time.sleep(3600)


def main() -> None:
    out = Path(sys.argv[1])
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "debug=fast",
                f"output_root={out}",
                f"run_dir={out}/run",
                "logger=none",
                "trainer.strategy=ddp",
                "trainer.devices=2",
                *sys.argv[2:],
            ],
        )
    module, data, trainer = cli.build(cfg)
    record = Record(out)
    trainer.callbacks.append(record)
    trainer.fit(module, datamodule=data)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.rows))


if __name__ == "__main__":
    main()
