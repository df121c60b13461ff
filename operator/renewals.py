"""When the operator saw each heartbeat Lease renewed, on its own clock."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any


class RenewalClock:
    """When this operator saw each server's Lease renewed, on its own clock, as the node lifecycle
    controller keeps node health: a Lease is expired when no renewal has been seen for its
    duration. A read that lags (a restarted API server's cache can answer with an older
    ``renewTime`` than it already gave) or a node clock that differs from the operator's cannot
    make a live server look dead; a Lease first seen (at the operator's start) gets a full
    duration. One per operator process (:class:`~eaas.operator.reconcile.context.Context`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (namespace, pool) -> Lease name -> (newest renewTime seen, when it was first seen)
        self._seen: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}

    def ages(
        self, namespace: str, pool: str, leases: Sequence[Mapping[str, Any]], now: float
    ) -> dict[str, float]:
        """Seconds since each Lease's newest renewal was first seen (0 for a renewal seen now)."""
        with self._lock:
            before = self._seen.get((namespace, pool), {})
            after: dict[str, tuple[float, float]] = {}
            for lease in leases:
                name = lease["metadata"]["name"]
                spec = lease.get("spec") or {}
                renewed = timestamp(spec.get("renewTime") or spec.get("acquireTime")) or 0.0
                seen = before.get(name)
                after[name] = seen if seen is not None and seen[0] >= renewed else (renewed, now)
            self._seen[(namespace, pool)] = after  # Leases gone are forgotten
        return {name: now - seen for name, (_, seen) in after.items()}

    def saw(self, namespace: str, pool: str, lease: Mapping[str, Any], now: float) -> None:
        """A Lease as a watch delivered it at `now`: a newer renewal is seen from now on (the
        listing of the next reconcile then measures its age from when it happened, not from when
        that reconcile ran)."""
        name = lease["metadata"]["name"]
        spec = lease.get("spec") or {}
        renewed = timestamp(spec.get("renewTime") or spec.get("acquireTime")) or 0.0
        with self._lock:
            seen = self._seen.setdefault((namespace, pool), {})
            before = seen.get(name)
            if before is None or before[0] < renewed:
                seen[name] = (renewed, now)


def timestamp(value: str | None) -> float | None:
    """RFC 3339 (a Kubernetes Time or MicroTime) as Unix seconds; None when absent or garbled."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
