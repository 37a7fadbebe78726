"""Run by tests/test_distributed.py as `python tests/ddp_worker.py OUT_DIR [overrides...]`: the CLI's own
`build()` with trainer.strategy=ddp on 2 CPU processes (Lightning relaunches this script for rank 1).
Each rank writes what it saw of every iteration to OUT_DIR/rank<k>.json."""

import json
import sys
from pathlib import Path

import lightning as L
from hydra import compose, initialize_config_dir

from trace_lightning import config
from trace_lightning import trainer as cli


class Record(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_epoch_start(self, trainer, pl_module):
        report = trainer.datamodule.report
        self.rows.append(
            {
                "iteration": report.iteration,
                "processes": report.processes,
                "pool_predicted": report.result.pool_predicted.tolist(),
                "root_counts": report.result.root_counts.tolist(),
                "leaves_used": report.result.ledger.leaves_used,
                "trees": sorted(t.task_id for t in report.result.trees),
                "local_trees": sorted(t.task_id for t in trainer.datamodule.report.local_trees),
                "local_leaves": sum(len(t.leaves()) for t in trainer.datamodule.report.local_trees),
                "batches": len(trainer.train_dataloader),
                "logprob_mismatch": report.logprob_mismatch,
            }
        )


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
    record = Record()
    trainer.callbacks.append(record)
    trainer.fit(module, datamodule=data)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.rows))


if __name__ == "__main__":
    main()
