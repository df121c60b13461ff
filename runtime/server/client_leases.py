"""Freeing the slots of attention clients whose Lease expired.

A slot is held until its client releases it or the transport sees the client gone (its TCP
connection closed, its process no longer holding the shm slot's lock). A client that hangs with
its connection open (a stopped process, a partitioned node) would hold it for ever. In Kubernetes
each attention client therefore renews a Lease named after its pod (:mod:`eaas.runtime.lease`,
component ``attention-client``) and names it at the handshake (``"lease"`` in ``POST
/v1/slots``). Every ``interval_s`` the expert server lists its MoEService's attention Leases and
frees each slot whose client's Lease is expired, counted in
``eaas_expert_server_reaped_slots_total{reason="lease_expired"}``.

Expiry is judged on the server's own clock, as the node lifecycle controller judges node Leases:
a Lease is expired when its ``renewTime`` has not changed for ``leaseDurationSeconds`` since this
server saw it change, so clock skew between nodes does not matter. A Lease never seen (not yet
created, or deleted with its pod) counts from when the slot attached. While the API server cannot
be read nothing is freed, and after such a gap every observation starts again: clients that could
not renew while the API server was away get a full duration to do so once it is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaas.runtime import contract
from eaas.runtime.lease import coordination_api, describe, raw_options, response_json
from eaas.runtime.server.daemon import DaemonLoop

log = logging.getLogger("eaas.server.client_leases")

FORGET_AFTER = 10  # a deleted Lease is forgotten this many durations after its last renewal


@dataclass
class _Seen:
    renew_time: str | None
    changed_at: float  # local monotonic time at which this renewTime was first seen
    duration_s: float


class LeaseClock:
    """Which client Leases are expired, judged from successive listings on the local clock."""

    def __init__(self, default_duration_s: float) -> None:
        self.default_duration_s = default_duration_s
        self._seen: dict[str, _Seen] = {}
        self._valid_since: float | None = None  # the first listing after the last gap (None: in a gap)

    def observe(self, leases: Iterable[Mapping[str, Any]], now: float) -> None:
        """A successful listing of the Leases, made at local time ``now``."""
        restart = self._valid_since is None
        if restart:
            self._valid_since = now
        listed = set()
        for lease in leases:
            name = str((lease.get("metadata") or {}).get("name", ""))
            spec = lease.get("spec") or {}
            renew = spec.get("renewTime")
            duration = float(spec.get("leaseDurationSeconds") or self.default_duration_s)
            listed.add(name)
            seen = self._seen.get(name)
            if seen is None or seen.renew_time != renew or restart:
                self._seen[name] = _Seen(renew, now, duration)
            else:
                seen.duration_s = duration
        for name, seen in list(self._seen.items()):  # a vanished Lease: judged from its last renewal,
            if name not in listed and now - seen.changed_at > FORGET_AFTER * seen.duration_s:
                del self._seen[name]  # then forgotten

    def gap(self) -> None:
        """A listing failed: nothing is judged until the next successful one."""
        self._valid_since = None

    def expired(self, name: str, attached_at: float, now: float) -> bool:
        """Is the Lease ``name``, named by a slot attached at ``attached_at``, expired at ``now``?"""
        if self._valid_since is None:
            return False
        seen = self._seen.get(name)
        if seen is not None:
            return self._expired_seen(seen, now)
        return now - max(attached_at, self._valid_since) > self.default_duration_s

    @staticmethod
    def _expired_seen(seen: _Seen, now: float) -> bool:
        return now - seen.changed_at > seen.duration_s


def attention_selector(service: str) -> str:
    """The label selector of a MoEService's attention clients' Leases."""
    return f"{contract.COMPONENT_LABEL}={contract.ATTENTION_COMPONENT},{contract.SERVICE_LABEL}={service}"


class ClientLeaseWatch(DaemonLoop):
    """Every ``interval_s``: lists the Leases and calls ``reap(expired)`` with the clock's verdict."""

    def __init__(
        self,
        namespace: str,
        service: str,
        interval_s: float,
        duration_s: float,
        reap: Callable[[Callable[[str, float], bool]], object],
        kubeconfig: Path | None = None,
    ) -> None:
        self.namespace, self.service, self.interval_s = namespace, service, interval_s
        self.clock = LeaseClock(duration_s)
        self._reap = reap
        self._kubeconfig = kubeconfig
        self._api: Any = None
        self.failures = 0  # listings failed in a row
        super().__init__("eaas-client-leases")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as error:  # API or network errors: keep serving, judge nothing
                self.clock.gap()
                self.failures += 1
                if self.failures == 1 or self.failures % 10 == 0:
                    log.warning(
                        "client Leases of %s/%s not read (%d time(s) in a row): %s; no slot is freed "
                        "by Lease until they are",
                        self.namespace,
                        self.service,
                        self.failures,
                        describe(error),
                    )

    def check(self) -> None:
        """One listing and one reaping pass (raises on API errors)."""
        if self._api is None:
            self._api = coordination_api(self._kubeconfig)
        timeout = max(1.0, min(self.interval_s, 10.0))
        listing = response_json(
            self._api.list_namespaced_lease(
                self.namespace, label_selector=attention_selector(self.service), **raw_options(timeout)
            )
        )
        self.clock.observe(listing.get("items") or [], time.monotonic())
        self.failures = 0
        self._reap(lambda name, attached_at: self.clock.expired(name, attached_at, time.monotonic()))
