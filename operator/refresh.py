"""What a reconcile makes sure of less often than on every pass.

A MoEService's pass creates its pods' ServiceAccount, RoleBinding and data-token Secret if they
are missing (create-only: the API server answers 409 AlreadyExists when they are there). Made on
every resync, that is three requests per MoEService every resync period, each a 409, for objects
that exist once made. :class:`Refresh` remembers when each such thing was last made sure of, so a
pass does it again only after ``every_s``: a deleted Secret still comes back, within that time
rather than within one resync. The memory is the operator process's own (a restarted operator
makes sure of everything on its first pass).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class Refresh:
    """When each key was last made sure of (one per operator process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._done: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def due(self, key: Hashable, every_s: float) -> bool:
        """Whether `key` was not made sure of within the last `every_s` seconds."""
        with self._lock:
            done = self._done.get(key)
        return done is None or self._clock() - done >= every_s

    def done(self, key: Hashable) -> None:
        """`key` was made sure of now."""
        with self._lock:
            self._done[key] = self._clock()

    def forget(self, key: Hashable) -> None:
        """A deleted object: its next pass makes sure of everything at once."""
        with self._lock:
            self._done.pop(key, None)
