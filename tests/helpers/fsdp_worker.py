"""Run by tests/test_fsdp.py as `python tests/helpers/fsdp_worker.py OUT_DIR STRATEGY [overrides...]`,
STRATEGY `fsdp2` (trainer=fsdp2) or `ddp`: the CLI's own `build()` and `fit` on 2 CPU processes (Lightning
relaunches this script for rank 1). Each rank writes what it saw to OUT_DIR/rank<k>.json (its losses,
iterations and batches); rank 0 also writes the trainable weights before and after, gathered in full, to
OUT_DIR/weights.pt.

`ParityEnv` is a one-turn task whose reward a random tiny model can earn (an answer of even length
wins), so that advantages, and with them the policy's gradients, are not all zero."""

import json
import sys
from pathlib import Path

# Run by path, this folder is sys.path[0]; tests/ makes `helpers` importable, so that the Hydra targets
# `helpers.<worker>.<Class>` resolve here as they do in the test process.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trace_lightning import config
from trace_lightning import trainer as cli
from trace_lightning.envs.base import Transition
from trace_lightning.envs.chain import ChainEnv


class ParityEnv(ChainEnv):
    name = "parity"

    def step(self, task, state, action_text):
        reward = float(len(action_text) % 2 == 0)
        return Transition("", True, reward, "solved" if reward else "lost", (1, 0))


class Record(L.Callback):
    def __init__(self):
        self.rows, self.losses, self.batches = [], [], []

    def on_train_epoch_start(self, trainer, pl_module):
        report = trainer.datamodule.report
        trees = report.result.trees
        self.rows.append(
            {
                "iteration": report.iteration,
                "root_counts": report.result.root_counts.tolist(),
                "trees": sorted(t.task_id for t in trees),
                "rewards": sum(
                    float(t.nodes[x].reward or 0) for t in report.result.trees for x in t.leaves()
                ),
                "sync_seconds": report.sync_seconds,
                "logprob_mismatch": report.logprob_mismatch,
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch is None:  # the already-trained epoch of a resumed run
            return
        self.losses.append([trainer.current_epoch, float(outputs["loss"])])
        self.batches.append(
            [trainer.current_epoch, batch.input_ids.tolist(), float(batch.old_logprobs.double().sum())]
        )


def held_fraction(module) -> float:
    """The share of the policy's weights this process holds: 1 replicated, about 1/2 over 2 shards."""
    params = list(module.policy.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / sum(p.numel() for p in params)


def full_weights(module, sharded: bool) -> dict:
    """Trainable weights under their module names, gathered from the shards (a collective)."""
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    if sharded:
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items() if k in names}


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    chosen = ["trainer=fsdp2"] if strategy == "fsdp2" else ["trainer.strategy=ddp", "trainer.devices=2"]
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["debug=fast", f"output_root={out}", f"run_dir={out}/run", *chosen, *sys.argv[3:]],
        )
    module, data, trainer = cli.build(cfg)
    start = full_weights(module, sharded=False)  # configure_model shards only inside fit
    record = Record()
    trainer.callbacks.append(record)
    io = trainer.strategy.checkpoint_io
    trainer.fit(module, datamodule=data, ckpt_path=getattr(io, "resume_from", None))
    weights = full_weights(module, strategy == "fsdp2")
    rank = trainer.global_rank
    run_id = getattr(trainer.logger, "run_id", None) if rank == 0 else None
    row = {
        **{"rows": record.rows, "losses": record.losses, "batches": record.batches, "run_id": run_id},
        "held_fraction": held_fraction(module),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(row))
    if rank == 0:
        torch.save({"start": start, "end": weights}, out / "weights.pt")


if __name__ == "__main__":
    main()
