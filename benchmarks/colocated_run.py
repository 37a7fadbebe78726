"""A multi-process training run with colocated vLLM engines, recorded: what benchmarks/gpu_check.sh
runs on a machine with two or more GPUs, and what tests/test_colocated.py checks on 2 CPU processes.

    python benchmarks/colocated_run.py --out benchmarks/results/gpu_fsdp2_vllm.json \\
        trainer=fsdp2 trainer.accelerator=gpu trainer.devices=2 engine=vllm trainer.max_epochs=2
    .venv-vllm/bin/python benchmarks/colocated_run.py --out /tmp/cpu.json trainer=fsdp2 debug=fast engine=vllm

The job is the CLI's (`trainer.build` on `conf/train.yaml` with the overrides given; Lightning starts the
other processes). Every process records each iteration as it saw it: its own prompts, leaves and turns,
its engine's calls and tokens, the sampling and weight-sync seconds, the engine/trainer log-prob gap;
at the end the processes gather their records and process 0 writes them with the wall time and the
devices. The run uses a `--timeout` for torch.distributed, so processes waiting on one another fail
within it instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from trace_lightning import config
from trace_lightning import trainer as cli


class Record(L.Callback):
    """Each iteration as this process saw it, and at the end everyone's records in process 0's file."""

    def __init__(self, out: Path, started: float) -> None:
        self.out, self.started, self.rows = out, started, []  # type: ignore[var-annotated]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = trainer.datamodule.report  # type: ignore[attr-defined]
        mine = report.local_trees or []
        stats = report.engine_stats
        self.rows.append(
            {
                "iteration": report.iteration,
                "prompts": len(mine),
                "leaves": sum(len(t.leaves()) for t in mine),
                "turns": sum(1 for t in mine for n in t.nodes if n.depth >= 1 and n.action_ids),
                "engine_calls": stats.calls if stats else 0,
                "generated_tokens": stats.generated_tokens if stats else 0,
                "sample_seconds": report.sample_seconds,
                "sync_seconds": report.sync_seconds,
                "logprob_mismatch": report.logprob_mismatch,
                "leaves_all_processes": report.result.ledger.leaves_used,
            }
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        everyone: list[Any] = [self.rows]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, self.rows)
        if trainer.is_global_zero:
            devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            result = {
                "overrides": sys.argv[1:],
                "processes": len(everyone),
                "devices": devices or [platform.processor() or "cpu"],
                "wall_seconds": time.perf_counter() - self.started,
                "ranks": everyone,
            }
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(result, indent=2))
            print(f"wrote {self.out}: {len(everyone)} processes, {result['wall_seconds']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=600.0, help="torch.distributed timeout, seconds")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the training job")
    args = p.parse_args()
    started = time.perf_counter()
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["logger=none", *args.overrides])
    module, data, trainer = cli.build(cfg)
    trainer.strategy._timeout = timedelta(seconds=args.timeout)  # read when the process group starts
    trainer.callbacks.append(Record(args.out, started))
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
