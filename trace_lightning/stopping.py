"""A run that can be stopped: SIGTERM or SIGINT ends every process within a deadline.

What happens when a process receives SIGTERM or SIGINT while fitting:

1. The signal is noted, and forwarded once to this run's other processes on the same host (Lightning
   starts ranks above 0 as children of rank 0; a scheduler or a user may signal only one of them).
2. At the next batch boundary every process learns whether any process was asked to stop (one
   all-reduce per micro-batch, which every process runs the same number of times), and then all of
   them save `<dirpath>/stop.ckpt` together (a collective under DDP and FSDP2) and exit with the
   shell's code for the signal (128 + signum: 143 for SIGTERM, 130 for SIGINT).
3. A watchdog thread gives that `deadline_seconds` from the signal. A process still running then (a
   collective that never returns because a peer is stuck or gone, a sampling phase longer than the
   deadline, a save that takes too long) exits anyway, through `os._exit`. The checkpoints written
   before stay valid (writes are atomic), and `ckpt_path=last` resumes from the newest of them.

Why a thread and a wakeup descriptor: Python runs signal handlers in the main thread only, between
bytecodes, so a main thread blocked inside a C collective (gloo, NCCL) never runs one. Lightning's own
SIGTERM handler has a second problem: it calls `torch.distributed.broadcast` from inside the handler,
a collective that can pair with whatever collective a peer is in. CPython's C-level handler, however,
writes the signal number to the `signal.set_wakeup_fd` descriptor at once, whatever the main thread is
doing; the watchdog thread reads it there. The Python-level handler installed here does nothing
except keep the default actions (termination, KeyboardInterrupt) from running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_NAME = "stop.ckpt"


class RunStopped(SystemExit):
    """Raised on every process at the batch boundary where the run stops; its code is 128 + signum."""


class StopOnSignal(L.Callback):
    """SIGTERM or SIGINT: save `stop.ckpt` at the next batch boundary on every process and exit, or exit
    without it when that has not happened `deadline_seconds` after the signal.

    Example: `kill -TERM <pid of any rank>` during a 2-process DDP fit -> both processes stop after the
    same micro-batch, `checkpoints/stop.ckpt` is written, both exit with code 143. If one of them is
    stuck in a collective instead, both exit with code 143 after `deadline_seconds`, with no new file.
    """

    def __init__(self, dirpath: str, deadline_seconds: float = 30.0) -> None:
        if not deadline_seconds > 0:
            raise ValueError(
                f"callbacks.stop.deadline_seconds={deadline_seconds} must be > 0: the seconds a stopping "
                "run may take to save its checkpoint before it exits without one"
            )
        self.dirpath, self.deadline_seconds = Path(dirpath), float(deadline_seconds)
        self.signum = 0  # the first stop signal received (0: none)
        self._peers: list[int] = []  # pids of this run's other processes on this host
        self._sockets: tuple[socket.socket, socket.socket] | None = None  # the watchdog's end, the handler's
        self._previous: tuple[int, dict[int, Any]] | None = None  # wakeup fd and handlers to restore

    # ------------------------------------------------------------------ Lightning hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After Lightning registered its SIGTERM handler (so this one replaces it while fitting)."""
        self._peers = _same_host_peers()
        if threading.current_thread() is threading.main_thread():
            self._install()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = _max_over_processes(self.signum, trainer.strategy.root_device)
        if signum:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.dirpath / CHECKPOINT_NAME)
            log.warning(f"stopped by {signal.Signals(signum).name}: saved {self.dirpath / CHECKPOINT_NAME}")
            raise RunStopped(128 + signum)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._uninstall()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._uninstall()

    # ------------------------------------------------------------------ signals

    def _install(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it: a full buffer must never block a handler
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        handlers = {s: signal.signal(s, _note) for s in STOP_SIGNALS}
        self._sockets, self._previous = (reader, writer), (previous_fd, handlers)
        threading.Thread(target=self._watch, args=(reader,), name="stop-on-signal", daemon=True).start()

    def _uninstall(self) -> None:
        if self._previous is None or threading.current_thread() is not threading.main_thread():
            return
        previous_fd, handlers = self._previous
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in handlers.items():  # unless Lightning has restored its own originals already
            if signal.getsignal(signum) is _note:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if self._sockets is not None:
            self._sockets[1].close()  # the watchdog reads end-of-file and ends
        self._previous, self._sockets = None, None

    def _watch(self, reader: socket.socket) -> None:
        """The watchdog thread: wakes on every signal byte; the first stop signal starts the deadline.
        It ends when the handler's end is closed (`_uninstall`)."""
        with reader:
            while data := reader.recv(64):
                for signum in data:
                    if signum in STOP_SIGNALS and not self.signum:
                        self._requested(signum)

    def _requested(self, signum: int) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        log.warning(
            f"{name}: stopping at the next batch boundary (saving {CHECKPOINT_NAME}), or in "
            f"{self.deadline_seconds:g} s without it (callbacks.stop.deadline_seconds)"
        )
        for pid in self._peers:
            with contextlib.suppress(ProcessLookupError):  # a peer that has exited already
                os.kill(pid, signum)
        timer = threading.Timer(self.deadline_seconds, _exit_now, args=(signum, self.deadline_seconds))
        timer.daemon = True
        timer.start()


def _note(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing to do here, the watchdog thread has the signal already. It
    exists so that the C-level handler (which feeds the wakeup descriptor) stays installed."""


def _exit_now(signum: int, deadline: float) -> None:
    """The deadline passed: exit this process whatever its main thread is doing."""
    message = (
        f"{signal.Signals(signum).name}: the run did not reach a batch boundary to save {CHECKPOINT_NAME} "
        f"within {deadline:g} s (a collective that does not return, or a long sampling phase); exiting "
        "without it. Resume from the last checkpoint with ckpt_path=last."
    )
    log.error(message)
    print(message, file=sys.stderr, flush=True)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(128 + signum)


def _same_host_peers() -> list[int]:
    """The pids of the other processes of this run on this host (a collective: all ranks call it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
    return [pid for host, pid in everyone if host == socket.gethostname() and pid != os.getpid()]


def _max_over_processes(value: int, device: torch.device) -> int:
    """The largest `value` of all processes (a collective: every process calls it at each batch end)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([value], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
