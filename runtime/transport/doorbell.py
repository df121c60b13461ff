"""Doorbells: named FIFOs next to a shared-memory segment that wake a waiter when a flag changes.

The slot flags stay the truth; a doorbell only says "look at the flags again". Whoever flips a
flag writes one byte to the other side's doorbell; whoever waits checks the flags, then blocks
in the kernel on its doorbell. A ring between the check and the block stays in the FIFO, so no
wake-up is lost, and nobody sleeps in a polling loop: a waiting process costs no CPU and wakes
as soon as the kernel schedules it (like a socket reader). The ``write``/``poll`` system calls
also order the flag store before the other side's flag load.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
from pathlib import Path


class Doorbell:
    def __init__(self, path: Path, fd: int, owner: bool) -> None:
        self.path = path
        self.fd = fd
        self.owner = owner

    @classmethod
    def create(cls, path: Path) -> Doorbell:
        """Makes the FIFO (the owner unlinks it on ``close``)."""
        os.mkfifo(path, 0o600)
        return cls(path, cls._open_fd(path), owner=True)

    @classmethod
    def open(cls, path: Path) -> Doorbell:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            raise OSError(f"{path} is not a doorbell (FIFO)")
        return cls(path, cls._open_fd(path), owner=False)

    @staticmethod
    def _open_fd(path: Path) -> int:
        # O_RDWR on a FIFO (Linux) never blocks and never sees EOF: reader and writer at once.
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def fileno(self) -> int:
        return self.fd

    def ring(self) -> None:
        """Wakes the waiter; a full FIFO already holds a pending wake-up."""
        with contextlib.suppress(BlockingIOError):
            os.write(self.fd, b"\x01")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self.fd, 4096)) == 4096:
                pass

    def wait(self, timeout_s: float) -> bool:
        """Blocks until rung or ``timeout_s`` passes; returns whether it was rung (and drains it)."""
        if self.fd < 1024:  # select() has microsecond timeouts
            ready = bool(select.select([self.fd], [], [], max(0.0, timeout_s))[0])
        else:  # poll() only has milliseconds, but no limit on descriptor numbers
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            ready = bool(poller.poll(max(0, int(timeout_s * 1000 + 0.999))))
        if ready:
            self.drain()
        return ready

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self.owner:
            self.path.unlink(missing_ok=True)
