"""Which watch events of the custom resources call for a reconcile.

kopf's ``@kopf.on.event`` handlers get every event of a watched object, the object's own
``/status`` patches included. The reconcilers patch the status on most passes (an ExpertPool's
carries the means of its servers' Lease annotations, which change with every renewal), so
reconciling on every event reconciles a pool back to back on its own writes instead of on its
resync. A reconcile is due when what the reconcilers read from the object itself changed: its
generation (the spec: edits, ``/scale`` writes, the MoEService's writes to its pools), its labels
or annotations, its deletion; or when the object is first seen (created, or listed at start).
What changes outside the object (pods turning Ready, Leases going stale, servers reporting a
loaded placement version) reaches the reconcile through the resync timer and the Lease watch
(:mod:`eaas.operator.lease_watch`), never through the object's status.

kopf's own filter for this, ``@kopf.on.update`` with its diff base, compares the same essence (the
object without ``status``) but stores the last handled one in an annotation of every object: one
more write per change. Event handlers persist nothing on the objects, so the last essence seen is
kept here, in the operator's memory (a restarted operator sees every object anew).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any


def essence(body: Mapping[str, Any]) -> str:
    """What a reconcile reads from the object itself, as comparable text (status left out)."""
    metadata = body.get("metadata") or {}
    return json.dumps(
        [
            metadata.get("uid"),
            metadata.get("generation"),
            metadata.get("labels") or {},
            metadata.get("annotations") or {},
            metadata.get("deletionTimestamp"),
        ],
        sort_keys=True,
    )


class Triggers:
    """The essence each object had when its event handler last reconciled it (one per process)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()

    def due(self, kind: str, body: Mapping[str, Any]) -> bool:
        """Whether this event of `body` calls for a reconcile (remembered as handled if so): the
        first event of an object, or one whose essence changed. Status-only changes are not."""
        metadata = body.get("metadata") or {}
        key = (kind, metadata.get("namespace") or "", metadata.get("name") or "")
        now = essence(body)
        with self._lock:
            if self._seen.get(key) == now:
                return False
            self._seen[key] = now
        return True

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """A deleted object (one created again under that name is due at once)."""
        with self._lock:
            self._seen.pop((kind, namespace, name), None)
