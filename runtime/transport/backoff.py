"""Waiting with exponential backoff where nothing can wake the waiter (e.g. for a process to
write its ready file), and timer slack for short sleeps.

A poller that found what it waits for resets; each empty poll sleeps ``factor`` times longer than
the last, from ``min_delay_s`` up to ``max_delay_s``. Linux rounds short sleeps up by the
thread's timer slack (50 µs by default); ``reduce_timer_slack`` lowers it for this thread.
The data path itself does not poll: it blocks on doorbells and sockets (``transport.doorbell``).
"""

from __future__ import annotations

import ctypes
import threading
import time

_PR_SET_TIMERSLACK = 29


def reduce_timer_slack(nanoseconds: int = 1000) -> bool:
    """Sets the calling thread's timer slack (Linux); returns False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_TIMERSLACK, nanoseconds, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


_slack_reduced = threading.local()


def reduce_timer_slack_once() -> None:
    """``reduce_timer_slack`` for the calling thread, the first time each thread calls it."""
    if not getattr(_slack_reduced, "done", False):
        _slack_reduced.done = True
        reduce_timer_slack()


class Backoff:
    def __init__(self, min_delay_s: float = 5e-6, max_delay_s: float = 1e-3, factor: float = 2.0) -> None:
        if not 0 < min_delay_s <= max_delay_s:
            raise ValueError(f"need 0 < min_delay_s <= max_delay_s, got {min_delay_s}, {max_delay_s}")
        if factor <= 1.0:
            raise ValueError(f"factor: must be > 1, got {factor}")
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.factor = factor
        self._delay = min_delay_s

    def reset(self) -> None:
        self._delay = self.min_delay_s

    def next_delay(self) -> float:
        """The delay to wait now; the one after it is ``factor`` times longer (capped)."""
        delay = self._delay
        self._delay = min(self._delay * self.factor, self.max_delay_s)
        return delay

    def sleep(self, limit_s: float | None = None) -> None:
        delay = self.next_delay()
        time.sleep(delay if limit_s is None else max(0.0, min(delay, limit_s)))
