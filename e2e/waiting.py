"""Polling with a deadline, for things the cluster does asynchronously."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """Raised when a condition did not become true in time (an AssertionError, so tests fail)."""


def wait_until(
    condition: Callable[[], T | None],
    timeout: float,
    description: str,
    interval: float = 0.2,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `condition` until it returns a truthy value and return that value.

    Exceptions of the types in `ignore` count as "not yet". Raises :class:`WaitTimeout` naming
    `description` and the last value or exception seen once `timeout` seconds have passed.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
        except ignore as error:
            value, last = None, error
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {description} (last: {last!r})")
        time.sleep(interval)
