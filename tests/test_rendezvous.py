"""A one-machine run's rendezvous store listens on MASTER_ADDR only, not on every address."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import listening

from trace_lightning.rendezvous import local_store

TIMEOUT = timedelta(seconds=20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")


def test_torch_store_listens_on_every_address():
    """What the strategy works around: the stock server ignores the host it is given."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=TIMEOUT)
    try:
        assert listening(port) & {"0.0.0.0", "::"}, listening(port)
    finally:
        del store


def test_local_store_listens_on_loopback_only_and_serves_clients():
    port = free_port()
    with ThreadPoolExecutor(1) as pool:  # the server waits for its one client before it returns
        serving = pool.submit(local_store, "127.0.0.1", port, 0, 2, TIMEOUT)
        while not listening(port) and not serving.done():
            time.sleep(0.01)
        assert listening(port) == {"127.0.0.1"}
        client = local_store("127.0.0.1", port, 1, 2, TIMEOUT)
        server = serving.result()
    client.set("rank1", "ready")
    assert server.get("rank1") == b"ready"
    server.set("rank0", "go")
    assert client.get("rank0") == b"go"


def test_local_store_refuses_a_port_in_use_with_the_os_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            local_store("127.0.0.1", taken.getsockname()[1], 0, 2, TIMEOUT)
