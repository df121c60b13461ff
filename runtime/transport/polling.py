"""Waiting for requests that arrive where nothing can wake a waiter: GPU writes to host memory
(``cuda_ipc``) and NIXL notifications (``nixl``, whose UCX worker offers no descriptor here).

The waiter spins (yielding the core and the GIL: ``pause``) for ``spin_s`` after the last
request, since a decode step's next layer follows soon; then it sleeps between checks, from
``min_sleep_s`` growing by ``factor`` up to ``max_sleep_s``, so an idle server costs little CPU.
While it sleeps it also selects on the wake-up descriptors of the server's other transports
(``watch``), so a request on any of them ends the wait at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable


def pause(seconds: float) -> None:
    """Sleeps ``seconds``; for 0, yields the core and the GIL and returns at once. ``time.sleep(0)``
    is a timed sleep of its own: 34 µs on the 2-core VM (timer slack reduced), against 1.2 µs for
    ``sched_yield``, so a spinning waiter looked at most every ~35 µs (docs/benchmarks.md)."""
    if seconds > 0:
        time.sleep(seconds)
    else:
        os.sched_yield()  # (CPython releases the GIL around it)


class PollingWaiter:
    def __init__(self, spin_s: float, min_sleep_s: float, max_sleep_s: float, factor: float = 2.0) -> None:
        if not 0 < min_sleep_s <= max_sleep_s or factor < 1.0 or spin_s < 0:
            raise ValueError(
                f"need spin_s >= 0, 0 < min_sleep_s <= max_sleep_s and factor >= 1, got "
                f"{spin_s}, {min_sleep_s}, {max_sleep_s}, {factor}"
            )
        self.spin_s = spin_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.factor = factor
        self.watched: list[int] = []
        self._last_activity = 0.0
        self._sleep_s = min_sleep_s

    def watch(self, fd: int) -> None:
        self.watched.append(fd)

    def activity(self) -> None:
        """A request arrived: spin again, and sleep briefly when the spin is over."""
        self._last_activity = time.monotonic()
        self._sleep_s = self.min_sleep_s

    def wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Returns once ``ready()`` is true, a watched descriptor turns readable, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                return
            if now - self._last_activity < self.spin_s:
                step = 0.0
            else:
                step = min(self._sleep_s, deadline - now)
                self._sleep_s = min(self._sleep_s * self.factor, self.max_sleep_s)
            if self.watched:
                if self._watched_ready(step):
                    return
            else:
                pause(step)

    def _watched_ready(self, timeout_s: float) -> bool:
        ready = select.select(self.watched, [], [], timeout_s)[0]
        for fd in ready:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(fd, 4096)
        return bool(ready)
