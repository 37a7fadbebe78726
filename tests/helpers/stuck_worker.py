"""Run by tests/test_stopping.py as `python tests/helpers/stuck_worker.py OUT_DIR RANK PORT DEADLINE`: one of
two processes of a gloo process group, with `StopOnSignal` installed as a fit would install it. Rank 1 then
hangs outside any collective (a stuck process) and rank 0 waits for it in an all-reduce, forever. Each writes
OUT_DIR/rank<k>.ready with its pid once it is there."""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trace_lightning.stopping import StopOnSignal


def main() -> None:
    out, rank, port, deadline = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(hours=1)
    )
    StopOnSignal(str(out / "checkpoints"), deadline).on_train_start(None, None)  # type: ignore[arg-type]
    (out / f"rank{rank}.ready").write_text(str(os.getpid()))
    if rank == 1:
        while True:
            time.sleep(3600)
    dist.all_reduce(torch.zeros(1))  # never returns: rank 1 never joins


if __name__ == "__main__":
    main()
