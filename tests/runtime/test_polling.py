"""``polling.pause``: a spinning waiter yields the core and the GIL between its looks."""

from __future__ import annotations

import statistics
import sys
import threading
import time

from eaas.runtime.transport.polling import pause


def test_another_thread_gets_the_gil_at_once_while_a_waiter_spins() -> None:
    """A thread that wakes every millisecond (a server's HTTP handler, a prober) takes the GIL
    from a waiter spinning with ``pause(0)`` within its wake-up, not after the interpreter's
    switch interval (5 ms), which is what a spin that never let go of the GIL would cost it."""
    late: list[float] = []
    stop = threading.Event()

    def wakes() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            time.sleep(1e-3)
            late.append(time.perf_counter() - start - 1e-3)

    thread = threading.Thread(target=wakes)
    thread.start()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pause(0)
    stop.set()
    thread.join()
    assert len(late) >= 20
    assert statistics.median(late) < sys.getswitchinterval() / 2, statistics.median(late)


def test_a_positive_pause_sleeps() -> None:
    start = time.monotonic()
    pause(0.02)
    assert time.monotonic() - start >= 0.02
