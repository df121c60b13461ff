"""What every reconciler shares: the API client, metrics, events and per-object serialisation."""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from eaas.operator import naming
from eaas.operator.autoscaler import Autoscaler
from eaas.operator.builders.common import merge_patch
from eaas.operator.collector import Probe, Rebalancer, ServerUrls, pod_control_urls, probe
from eaas.operator.conditions import Observation, merge
from eaas.operator.kube import Kube, KubeError
from eaas.operator.lease_watch import LeaseWatch
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.refresh import Refresh, digest
from eaas.operator.renewals import RenewalClock
from eaas.operator.store import Store
from eaas.operator.triggers import Triggers

FIELD_PATH = re.compile(r"[a-z][A-Za-z0-9]*(\.[a-z][A-Za-z0-9]*)*")
EventPoster = Callable[[Mapping[str, Any], str, str, str], None]  # (object, type, reason, message)
logger = logging.getLogger("eaas.operator")


MAX_EVENT_MESSAGE = 1024  # the API server refuses longer Event messages
# An unchanged child (a Service, a PodDisruptionBudget, a NetworkPolicy) is applied again this often:
# drift, or a deleted one, is put right within this time (:meth:`Context.apply_seldom`).
APPLY_EVERY_S = 300.0


def event_object(obj: Mapping[str, Any], type_: str, reason: str, message: str, now: float) -> dict[str, Any]:
    """A core/v1 Event about `obj`, named as client-go names them (object name + unique suffix)."""
    metadata = obj["metadata"]
    if len(message) > MAX_EVENT_MESSAGE:
        half = (MAX_EVENT_MESSAGE - 3) // 2
        message = f"{message[:half]}...{message[-half:]}"
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{metadata['name']}.{secrets.token_hex(8)}",
            "namespace": metadata["namespace"],
        },
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": naming.FIELD_MANAGER},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


@dataclass
class Context:
    """Shared by all reconciles of one operator process."""

    kube: Kube
    metrics: OperatorMetrics
    # Where Events go; None: the API server, at once (:meth:`event`). Tests pass a recorder.
    post_event: EventPoster | None = None
    autoscalers: dict[tuple[str, str], Autoscaler] = field(default_factory=dict)
    # ExpertPools whose replicas an HPA also targets while the operator owns them (reported once).
    rival_writers: set[tuple[str, str]] = field(default_factory=set)
    rebalancer: Rebalancer | None = None  # created from `metrics` when not given
    server_urls: ServerUrls = pod_control_urls  # where the expert servers' control ports are
    # asks a control URL's /healthz: a second opinion on a lapsed heartbeat or a client's failover
    probe: Callable[[str], Probe] = probe
    runtime_cluster_role: str | None = None  # bound to each MoEService's runtime ServiceAccount
    operator_namespace: str | None = None  # where the operator's pod runs (NetworkPolicies admit it)
    renewals: RenewalClock = field(default_factory=RenewalClock)  # when servers' Leases were seen renewed
    leases: LeaseWatch = field(init=False)  # what each Lease said last (the Lease watch)
    triggers: Triggers = field(default_factory=Triggers)  # which objects' events call for a reconcile
    refresh: Refresh = field(default_factory=Refresh)  # what passes make sure of less often than each time
    store: Store = field(default_factory=Store)  # the custom resources' newest bodies (watch events, writes)
    # Placement ConfigMaps as decoded: (namespace, name) -> (resourceVersion, (committed, pending, error))
    placements: dict[tuple[str, str], tuple[str, Any]] = field(default_factory=dict)
    # Reconcile (kind, namespace, name) again in `delay` seconds (set by the handlers; a no-op
    # where nothing schedules, as in tests that call the reconcilers directly).
    recheck: Callable[[str, str, str, float], None] = lambda kind, namespace, name, delay: None
    _probed: dict[str, tuple[float, Probe]] = field(default_factory=dict)  # url -> (when, answer)
    _locks: dict[tuple[str, str, str], threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.leases = LeaseWatch(self.renewals)
        if self.rebalancer is None:
            self.rebalancer = Rebalancer(self.metrics)
        if self.rebalancer.jobs.on_done is None:  # a finished plan is picked up by a reconcile soon
            self.rebalancer.jobs.on_done = lambda key: self.recheck("ExpertPool", *key, 0.0)

    def event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Post an Event about `obj` before returning (an operator stopped right after the change
        it tells of, as by a drain of its own node, must not lose the Event with kopf's queue).
        Events are auxiliary: a failure to post one is logged, never raised."""
        if self.post_event is not None:
            self.post_event(obj, type_, reason, message)
            return
        try:
            self.kube.create(event_object(obj, type_, reason, message, time.time()))
        except KubeError as error:
            name = obj["metadata"]["name"]
            logger.warning("could not post Event %s (%s) about %s: %s", reason, message, name, error)

    def current(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A custom resource as last seen (:attr:`store`), else as the API server has it now (None
        when it does not exist)."""
        body = self.store.get(kind, namespace, name)
        if body is None:
            body = self.kube.get(kind, namespace, name)
            if body is not None:
                self.store.saw(kind, body)
        return body

    def apply_seldom(self, obj: dict[str, Any], first: Callable[[], None] | None = None) -> bool:
        """Server-side apply `obj` (a child the operator alone owns) unless this same desired object
        was applied within :data:`APPLY_EVERY_S`; True when it was applied now. `first` runs
        before an apply (a check that may raise, e.g. who owns the object there)."""
        metadata = obj["metadata"]
        key, version = ("apply", obj["kind"], metadata["namespace"], metadata["name"]), digest(obj)
        if not self.refresh.due(key, APPLY_EVERY_S, version):
            return False
        if first is not None:
            first()
        self.kube.apply(obj)
        self.refresh.done(key, version)
        return True

    def delete_seldom(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child the operator made and no longer wants (once, then every
        :data:`APPLY_EVERY_S`, in case something made it again)."""
        key = ("apply", kind, namespace, name)
        if self.refresh.due(key, APPLY_EVERY_S, "deleted"):
            self.kube.delete(kind, namespace, name)
            self.refresh.done(key, "deleted")

    def lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        """One lock per object: a timer and an event handler never reconcile it at the same time."""
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    def ask(self, url: str, max_age_s: float) -> Probe:
        """What the control port at `url` answers (:attr:`probe`), or answered at most
        `max_age_s` ago: a server looked at again when its silence has lasted long enough is
        judged at once on the answer it gave (or did not give) a moment before."""
        now = time.monotonic()
        with self._locks_guard:
            for stale in [u for u, (when, _) in self._probed.items() if now - when > max(max_age_s, 60.0)]:
                del self._probed[stale]
            recent = self._probed.get(url)
        if recent is not None and now - recent[0] <= max_age_s:
            return recent[1]
        answer = self.probe(url)
        with self._locks_guard:
            self._probed[url] = (time.monotonic(), answer)
        return answer

    def forget(self, kind: str, namespace: str, name: str) -> None:
        with self._locks_guard:
            self._locks.pop((kind, namespace, name), None)
        self.triggers.forget(kind, namespace, name)
        self.refresh.forget((kind, namespace, name))
        self.store.forget(kind, namespace, name)
        if kind == "ExpertPool":
            self.placements.pop((namespace, naming.placement_config_map_name(name)), None)
        self.autoscalers.pop((namespace, name), None)
        self.rival_writers.discard((namespace, name))
        if self.rebalancer is not None and kind == "ExpertPool":
            self.rebalancer.forget(namespace, name)

    def write_status(
        self,
        kind: str,
        body: Mapping[str, Any],
        status: dict[str, Any],
        observations: list[Observation],
    ) -> dict[str, Any]:
        """Patch ``/status`` to `status` + merged conditions, only when something changed."""
        old = dict(body.get("status") or {})
        metadata = body["metadata"]
        status = {
            **{key: value for key, value in status.items() if value is not None},
            "observedGeneration": metadata.get("generation", 0),
            "conditions": merge(old.get("conditions"), observations, metadata.get("generation", 0)),
        }
        patch = merge_patch(old, status)
        if patch:
            self.kube.merge_patch(kind, metadata["namespace"], metadata["name"], {"status": patch}, "status")
        return status


def describe_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    """A pydantic error as ``spec.field.path: message; ...`` (camelCase paths, as users wrote them)."""
    parts = []
    for item in error.errors():
        location = ".".join(str(part) for part in (prefix, *item["loc"]))
        message = str(item["msg"]).removeprefix("Value error, ")
        field, separator, rest = message.partition(": ")
        if separator and FIELD_PATH.fullmatch(field):  # "topK: must be ..." from a model rule
            location, message = f"{location}.{field}", rest
        parts.append(f"{location}: {message}")
    return "; ".join(parts)
