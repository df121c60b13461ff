"""What a reconcile makes sure of less often than on every pass.

Two kinds of request made on every resync ask the API server for what is already there:

* A MoEService's pass creates its pods' ServiceAccount, RoleBinding and data-token Secret if they
  are missing (create-only: the API server answers 409 AlreadyExists when they are there).
* The pools' Services and PodDisruptionBudgets, the MoEService's API Service and NetworkPolicies
  are server-side applied: a no-op for the object when unchanged, but a request all the same.

:class:`Refresh` remembers when each such thing was last made sure of, and as what (a digest of
the desired object), so a pass does it again only when the desired object changed or ``every_s``
has passed: a deleted child still comes back, within that time rather than within one resync. The
memory is the operator process's own (a restarted operator makes sure of everything on its first
pass).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


def digest(obj: Any) -> str:
    """A short fingerprint of a JSON-able object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


class Refresh:
    """When each key was last made sure of, and as which version (one per operator process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._done: dict[Hashable, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def due(self, key: Hashable, every_s: float, version: str = "") -> bool:
        """Whether `key` was not made sure of as `version` within the last `every_s` seconds."""
        with self._lock:
            done = self._done.get(key)
        return done is None or done[1] != version or self._clock() - done[0] >= every_s

    def done(self, key: Hashable, version: str = "") -> None:
        """`key` was made sure of, as `version`, now."""
        with self._lock:
            self._done[key] = (self._clock(), version)

    def forget(self, key: Hashable) -> None:
        """A deleted object: its next pass makes sure of everything at once."""
        with self._lock:
            self._done.pop(key, None)
