"""A run that can be stopped: SIGTERM to one of two processes stops both, with a checkpoint
when they can reach a batch boundary, and within the deadline without one when a collective is stuck.

The first test is the mechanism alone on a bare gloo process group (seconds, default suite); the others
run the CLI's own build under 2-process DDP on CPU (tests/helpers/ddp_worker.py) and are marked slow."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DDP_WORKER

from trace_lightning.checkpoints import newest_valid_checkpoint, validate_checkpoint
from trace_lightning.checkpoints.files import Manifest

STUCK_WORKER = Path(__file__).parent / "helpers" / "stuck_worker.py"

# 2 DDP processes on the tiny model; many iterations, so the run is still going when it is signalled
RUN = ["trainer.max_epochs=50", "budget.leaves=12", "data.pool_size=8", "~callbacks.progress"]
# rank 1 hangs at the start of iteration 1 (tests/helpers/ddp_worker.py StuckAt)
STUCK = ["+callbacks.stuck._target_=helpers.ddp_worker.StuckAt", "+callbacks.stuck.rank=1"]


def start(out: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(DDP_WORKER), str(out), *RUN, *overrides],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def wait_gone(pid: int, timeout: float) -> float:
    """Seconds until process `pid` is gone (fails after `timeout`)."""
    start = time.time()
    while alive(pid):
        assert time.time() - start < timeout, f"process {pid} still alive after {timeout} s"
        time.sleep(0.05)
    return time.time() - start


def pids(out: Path) -> list[int]:
    return [int((out / f"rank{r}.pid").read_text()) for r in range(2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_callback_restores_the_signal_handlers_and_its_watchdog_ends(tmp_path):
    """Installed for a fit (here without a process group) and removed at teardown: the handlers and the
    wakeup descriptor are what they were, and the watchdog thread has ended."""
    import threading

    from trace_lightning.stopping import StopOnSignal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopOnSignal(str(tmp_path), deadline_seconds=5)
    stop.on_train_start(None, None)
    watchdog = next(t for t in threading.enumerate() if t.name == "stop-on-signal")
    assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    stop.teardown(None, None, "fit")
    watchdog.join(timeout=5)
    assert not watchdog.is_alive()
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # nothing was left registered
    with pytest.raises(ValueError, match=r"callbacks.stop.deadline_seconds=0"):
        StopOnSignal(str(tmp_path), deadline_seconds=0)


def test_sigterm_ends_both_processes_of_a_stuck_group_within_the_deadline(tmp_path):
    """Rank 1 hangs outside any collective and rank 0 waits in an all-reduce for it, its main thread inside
    gloo where no Python signal handler can run. SIGTERM to rank 0 alone: rank 0's watchdog forwards it to
    rank 1, and both exit with 143 once the 2 s deadline has passed."""
    port, deadline = str(free_port()), 2.0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(STUCK_WORKER), str(tmp_path), str(r), port, str(deadline)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        for r in range(2):
            wait_for(tmp_path / f"rank{r}.ready", procs[r], timeout=120)
        time.sleep(0.5)  # rank 0 is inside the all-reduce
        sent = time.time()
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=deadline + 30) for p in procs]
        took = time.time() - sent
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [128 + signal.SIGTERM] * 2
    assert deadline <= took < deadline + 10
    assert "did not reach a batch boundary" in procs[1].stderr.read()  # rank 1 got it from rank 0


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_saving_a_checkpoint(tmp_path):
    proc = start(tmp_path, "callbacks.stop.deadline_seconds=120")
    folder = tmp_path / "run" / "checkpoints"
    wait_for(folder / "iteration-0000.ckpt", proc)
    zero, one = pids(tmp_path)
    assert zero == proc.pid
    os.kill(one, signal.SIGTERM)  # rank 1 only: it forwards the signal to rank 0
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stderr.read()[-3000:]
    wait_gone(one, timeout=10)
    saved = folder / "stop.ckpt"
    assert validate_checkpoint(saved)["global_step"] > 0
    assert Manifest.read(folder).files[-1] == "stop.ckpt"
    assert newest_valid_checkpoint(folder) == saved


@pytest.mark.slow
def test_a_stuck_process_cannot_keep_the_run_alive_past_the_deadline(tmp_path):
    """Rank 1 hangs in iteration 1 (outside any collective), so rank 0 waits in DDP's gradient all-reduce:
    neither can reach a batch boundary. SIGTERM to rank 0 only ends both within the deadline, through
    the watchdog, and the last iteration's checkpoint stays the valid resume point."""
    deadline = 3.0
    proc = start(tmp_path, f"callbacks.stop.deadline_seconds={deadline}", *STUCK)
    wait_for(tmp_path / "run" / "stuck", proc)
    time.sleep(1.0)  # rank 0 is inside the all-reduce by now
    one = pids(tmp_path)[1]
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=deadline + 30) == 128 + signal.SIGTERM
    wait_gone(one, timeout=deadline + 30)
    assert time.time() - sent < deadline + 10
    folder = tmp_path / "run" / "checkpoints"
    assert not (folder / "stop.ckpt").exists()
    assert newest_valid_checkpoint(folder) == folder / "iteration-0000.ckpt"
    assert "did not reach a batch boundary" in proc.stderr.read()


@pytest.mark.slow
def test_without_the_callback_the_stuck_run_ignores_sigterm(tmp_path):
    """The control: the same stuck run with Lightning's own SIGTERM handling alone is still alive well past
    the deadline the test above meets (the main thread never leaves the collective to run a handler)."""
    proc = start(tmp_path, "~callbacks.stop", *STUCK)
    try:
        wait_for(tmp_path / "run" / "stuck", proc)
        time.sleep(1.0)
        zero, one = pids(tmp_path)
        proc.send_signal(signal.SIGTERM)
        time.sleep(15)
        assert alive(zero) and alive(one)
    finally:
        for pid in pids(tmp_path) if (tmp_path / "rank1.pid").exists() else [proc.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
