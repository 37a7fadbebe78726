"""The process group of a one-machine run, with its rendezvous store bound to MASTER_ADDR.

torch's TCP store server listens on every address of the machine (`[::]:MASTER_PORT`) whatever
MASTER_ADDR says, and whoever can reach that port can read and write the keys the processes use to
find each other. A run whose processes all live on this machine (Lightning launches them,
`trainer.num_nodes=1`) needs it only on MASTER_ADDR, which Lightning sets to 127.0.0.1 unless the user
sets it. So rank 0 binds the listening socket itself, on that address, and hands it to the store
(`TCPStore(master_listen_fd=...)`); the other ranks connect to it as before. Runs over several nodes,
and runs whose launcher made the store already (torchrun, SLURM), keep Lightning's own set-up.

The gloo and NCCL transports open their own connections, chosen by `GLOO_SOCKET_IFNAME` and
`NCCL_SOCKET_IFNAME`: set those to `lo` to keep them on loopback too (docs/security.md).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy


def local_store(address: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0: a store server listening on `address:port` only. Other ranks: a client of it."""
    if rank != 0:
        return dist.TCPStore(address, port, world, False, timeout=timeout)
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(where)
        listener.listen(world * 4)
    except BaseException:
        listener.close()
        raise
    # The store owns the descriptor from here on (it closes it with the server), so Python must not.
    return dist.TCPStore(address, port, world, True, timeout=timeout, master_listen_fd=listener.detach())


def open_local_group(strategy: Any, **kwargs: Any) -> None:
    """Initialise `strategy`'s process group on a store bound to MASTER_ADDR, when every process is
    on this machine and Lightning launched them; otherwise leave it to Lightning. Call it where the
    strategy would initialise its group: Lightning's `_init_dist_connection` then finds it made."""
    env = strategy.cluster_environment
    if dist.is_initialized() or strategy.num_nodes != 1 or type(env) is not LightningEnvironment:
        return
    timeout = kwargs.pop("timeout", None) or timedelta(minutes=30)
    rank, world = env.global_rank(), env.world_size()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
    store = local_store(env.main_address, env.main_port, rank, world, timeout)
    backend = strategy._get_process_group_backend()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)


class LocalDDPStrategy(DDPStrategy):
    """Lightning's DDP with the one-machine rendezvous above (what `trainer.strategy=ddp` builds)."""

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        device = {"device_id": self.root_device} if self.root_device.type != "cpu" else {}
        open_local_group(self, timeout=self._timeout, **device)
        super().setup_distributed()
