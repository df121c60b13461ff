"""Leases as they change: what the pods say on their heartbeat Leases, acted on when they say it.

The resync timer looks at every ExpertPool every ``EAAS_OPERATOR_RESYNC_SECONDS``; three things a
pod says on its Lease should not wait for it:

* an attention client fails an expert server over (:data:`~eaas.runtime.contract.FAILED_OVER_ANNOTATION`):
  the server may be lost, and re-placing its experts restores R on the survivors;
* an expert server reports a new placement version loaded: the pending placement may be ready to
  commit;
* an expert server announces that it is leaving (SIGTERM): its experts are to be drained now.

The operator watches the Leases of EaaS pods (labelled with their component) and reconciles the
ExpertPool concerned when one of these changes; renewals that change nothing of it only record
when the renewal was seen (:class:`~eaas.operator.renewals.RenewalClock`), so a Lease's age is
measured from its renewal, not from the last reconcile.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eaas.operator import naming
from eaas.operator.renewals import RenewalClock


@dataclass(frozen=True)
class Concern:
    """Which ExpertPools a Lease's change concerns: one by name, or those of a MoEService."""

    namespace: str
    pool: str | None = None  # an expert server's pool
    service: str | None = None  # an attention client's MoEService (its ExpertPools)


@dataclass
class LeaseWatch:
    """What each Lease said last (per operator process); :meth:`seen` tells what a change concerns."""

    renewals: RenewalClock
    _said: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self, lease: Mapping[str, Any], event: str | None, now: float) -> Concern | None:
        """A Lease as the watch delivered it (`event`: ADDED, MODIFIED, or None for the initial
        listing) at `now`: the ExpertPools to reconcile now, or None when nothing that matters
        changed (a plain renewal), or the Lease is not one of ours. Leases of the initial listing
        are remembered, not acted on (the resync looks at every pool anyway), except a client's
        standing word on failed servers."""
        metadata = lease.get("metadata") or {}
        labels = metadata.get("labels") or {}
        annotations = metadata.get("annotations") or {}
        namespace, name = metadata.get("namespace") or "", metadata.get("name") or ""
        component = labels.get(naming.COMPONENT_LABEL)
        if component == naming.EXPERT_COMPONENT and (pool := labels.get(naming.POOL_LABEL)):
            self.renewals.saw(namespace, pool, lease, now)
            said: tuple[str, ...] = tuple(
                annotations.get(key, "")
                for key in (naming.LOADED_VERSION_ANNOTATION, naming.LEAVING_ANNOTATION)
            )
            concern = Concern(namespace, pool=pool)
            standing = False
        elif component == naming.ATTENTION_COMPONENT and (service := labels.get(naming.SERVICE_LABEL)):
            said = (annotations.get(naming.FAILED_OVER_ANNOTATION, ""),)
            concern = Concern(namespace, service=service)
            standing = bool(said[0])
        else:
            return None
        with self._lock:
            before = self._said.get((namespace, name))
            self._said[(namespace, name)] = said
        if before == said:
            return None
        if before is None and event is None and not standing:
            return None
        return concern

    def forget(self, lease: Mapping[str, Any]) -> None:
        """A deleted Lease."""
        metadata = lease.get("metadata") or {}
        with self._lock:
            self._said.pop((metadata.get("namespace") or "", metadata.get("name") or ""), None)
