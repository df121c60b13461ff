"""The newest body of each custom resource the operator watches, from kopf's watch events and the
operator's own writes.

A MoEService's pass reads its pools (the serving ExpertPool and AttentionPool) on every resync;
kopf already watches them and hands every event's body to the event handlers. :class:`Store`
keeps the newest of those bodies, so the pass reads them from memory: a body not seen yet is read
from the API server (:meth:`~eaas.operator.reconcile.context.Context.current`). A body is replaced
only by one with a higher ``resourceVersion`` (the operator's own writes return the written object
before its watch event arrives; the event then changes nothing). A deleted object is forgotten.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any


def _version(body: Mapping[str, Any]) -> int:
    """The body's resourceVersion as a number (an etcd revision; 0 when absent or not a number)."""
    try:
        return int((body.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class Store:
    """Bodies by (kind, namespace, name), newest kept (one per operator process)."""

    def __init__(self) -> None:
        self._bodies: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def saw(self, kind: str, body: Mapping[str, Any]) -> None:
        """A body of `kind` as a watch event or a write returned it."""
        metadata = body.get("metadata") or {}
        key = (kind, metadata.get("namespace") or "", metadata.get("name") or "")
        copied = copy.deepcopy(dict(body))
        with self._lock:
            known = self._bodies.get(key)
            if known is None or _version(copied) >= _version(known):
                self._bodies[key] = copied

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the newest body seen (None when none was)."""
        with self._lock:
            body = self._bodies.get((kind, namespace, name))
        return copy.deepcopy(body) if body is not None else None

    def forget(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._bodies.pop((kind, namespace, name), None)
