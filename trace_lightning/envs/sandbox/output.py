"""The program's stdout and stderr: pipes the trainer drains while the call runs, keeping a bounded part.

They used to be temp files on the host, where `fallocate` on stdout took 8 GiB of the trainer's disk in
0.02 s, RLIMIT_FSIZE notwithstanding. Now nothing the program writes reaches a host file: the
trainer keeps the head of stdout and the tail of stderr, `keep` bytes each, reads at most `MAX_PIPE_BYTES`
of a pipe and then closes it, so a program that prints on and on gets EPIPE (Python: BrokenPipeError)
rather than the trainer's CPU time.
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass, field

MAX_PIPE_BYTES = 2**20  # what the trainer reads of each pipe (as the old RLIMIT_FSIZE on the output files)
TRUNCATED = "[output truncated]"
_CHUNK = 65536


@dataclass
class Capture:
    """What the trainer keeps of one pipe: its first (or, with `tail`, last) `keep` bytes."""

    fd: int  # the read end; -1 once closed
    keep: int
    tail: bool
    data: bytearray = field(default_factory=bytearray)
    total: int = 0  # bytes read

    def take(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.data += chunk
            del self.data[: max(0, len(self.data) - self.keep)]
        elif len(self.data) < self.keep:
            self.data += chunk[: self.keep - len(self.data)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def text(self, max_chars: int) -> str:
        """At most `max_chars` characters of what was kept; invalid UTF-8 becomes U+FFFD."""
        text = bytes(self.data).decode("utf-8", errors="replace")
        if self.total <= len(self.data) and len(text) <= max_chars:
            return text
        keep = max_chars - len(TRUNCATED) - 1
        return f"{TRUNCATED}\n{text[-keep:]}" if self.tail else f"{text[:keep]}\n{TRUNCATED}"


def drain(process_fd: int, captures: list[Capture], seconds: float) -> bool:
    """Read the pipes until the process (a pidfd) has exited and every pipe is closed, or until `seconds`
    have passed. Returns whether the process exited."""
    poller = select.poll()  # not select.select: a trainer may hold more than 1024 descriptors
    poller.register(process_fd, select.POLLIN)
    readers = {capture.fd: capture for capture in captures if capture.fd >= 0}
    for fd in readers:
        poller.register(fd, select.POLLIN)
    exited, deadline = False, time.monotonic() + seconds
    while readers or not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == process_fd:
                exited = True
                poller.unregister(fd)
                continue
            capture = readers[fd]
            chunk = os.read(fd, _CHUNK)
            capture.take(chunk)
            if not chunk or capture.total >= MAX_PIPE_BYTES:  # end of output, or enough of it
                poller.unregister(fd)
                capture.close()
                del readers[fd]
    return exited


def read_available(fd: int) -> bytes:
    """What the pipe holds now (all writers are gone or dead, so nothing more is coming)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)
