"""kopf registration: thin handlers that serialise per object and call the reconcilers.

Every kind gets two triggers of the same level-based reconcile:

* ``@kopf.on.event`` — react at once to a change of the object: creation, spec edits, ``/scale``
  writes, labels and annotations (:mod:`eaas.operator.triggers`). A change of its status alone,
  the operator's own status patches above all, triggers nothing. Event handlers persist nothing
  on the objects.
* ``@kopf.timer`` — resync every ``EAAS_OPERATOR_RESYNC_SECONDS``: pods becoming Ready, Leases
  expiring, drift, and retries after errors (exponential backoff via ``kopf.TemporaryError``).
  The ExpertPool's timer also considers a load-based rebalance (``spec.placement``), at most
  every ``rebalanceIntervalSeconds`` (:mod:`eaas.operator.collector`).

ExpertPools also react to their pods' Leases (:mod:`eaas.operator.lease_watch`): a client's
word on a failed server, a server's newly loaded placement, a server leaving. A reconcile may
ask to be run again after a delay (:attr:`Context.recheck`): a server its clients fail over is
looked at again when its silence would suffice to re-place it.

Import this module to register the handlers (``eaas operator`` does).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from eaas.operator import naming
from eaas.operator.api.kinds import ATTENTIONPOOL, EXPERTPOOL, GROUP, MOESERVICE, VERSION, Kind
from eaas.operator.kube import Kube, KubeError
from eaas.operator.metrics import default as default_metrics
from eaas.operator.reconcile import attentionpool, expertpool, moeservice
from eaas.operator.reconcile.context import Context

logger = logging.getLogger("eaas.operator")

RESYNC_SECONDS = float(os.environ.get("EAAS_OPERATOR_RESYNC_SECONDS", "10"))
MAX_BACKOFF_SECONDS = 60.0
FINALIZER = f"{GROUP}/operator"

_context: Context | None = None


def install(context: Context) -> None:
    """Set the context the handlers use (done by :func:`eaas.operator.main.run` before starting)."""
    global _context
    _context = context


def context() -> Context:
    if _context is None:
        raise RuntimeError("eaas.operator.handlers.install(context) was not called")
    return _context


def backoff(retry: int) -> float:
    """Seconds to wait after `retry` consecutive failures: 1, 2, 4, ... capped at 60."""
    return min(MAX_BACKOFF_SECONDS, 2.0 ** max(retry, 0))


Reconcile = Callable[[Context, Mapping[str, Any]], None]


def run_reconcile(kind: Kind, reconcile: Reconcile, body: Mapping[str, Any], retry: int) -> None:
    """Reconcile one object under its lock; API errors become kopf retries with backoff."""
    metadata = body["metadata"]
    if metadata.get("deletionTimestamp"):
        return  # going away: its children are garbage-collected through ownerReferences
    ctx = context()
    with ctx.lock(kind.kind, metadata["namespace"], metadata["name"]), ctx.metrics.reconcile(kind.kind):
        try:
            reconcile(ctx, body)
        except KubeError as error:
            delay = backoff(retry) if error.retryable else MAX_BACKOFF_SECONDS
            raise kopf.TemporaryError(f"{kind.kind} {metadata['name']}: {error}", delay=delay) from error


def event_handler(kind: Kind, reconcile: Reconcile) -> Callable[..., None]:
    """The ``@kopf.on.event`` handler of `kind`: `reconcile` when the event changes what the
    reconcile reads of the object (:meth:`~eaas.operator.triggers.Triggers.due`), never on a
    change of its status alone."""

    def on_event(body: kopf.Body, type: str | None, retry: int = 0, **_: Any) -> None:
        ctx = context()
        if type == "DELETED":
            ctx.forget(kind.kind, body["metadata"]["namespace"], body["metadata"]["name"])
            return
        ctx.store.saw(kind.kind, body)
        if not ctx.triggers.due(kind.kind, body):
            return  # a status patch (the operator's own, mostly): the resync looks at it anyway
        try:
            run_reconcile(kind, reconcile, body, 0)
        except kopf.TemporaryError as error:
            logger.info("%s (the resync timer retries)", error)

    on_event.__name__ = on_event.__qualname__ = f"{kind.singular}_event"
    return on_event


def _register(kind: Kind, reconcile: Reconcile, resync: Reconcile | None = None) -> None:
    """Event handler → `reconcile`; resync timer → `resync` (default: the same reconcile)."""

    def on_timer(body: kopf.Body, **kwargs: Any) -> None:
        run_reconcile(kind, resync or reconcile, body, int(kwargs.get("retry", 0)))

    on_timer.__name__ = on_timer.__qualname__ = f"{kind.singular}_resync"
    kopf.on.event(GROUP, VERSION, kind.plural)(event_handler(kind, reconcile))
    kopf.timer(GROUP, VERSION, kind.plural, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)(on_timer)


_register(MOESERVICE, moeservice.reconcile)
_register(ATTENTIONPOOL, attentionpool.reconcile)
_register(EXPERTPOOL, expertpool.reconcile, expertpool.resync)


def reconcile_expert_pool(namespace: str, name: str) -> None:
    """Reconciles the ExpertPool as it is now (read afresh), outside kopf's handlers: a Lease's
    change or a recheck asked for it. Errors are logged; the resync timer retries."""
    ctx = context()
    try:
        body = ctx.kube.get(EXPERTPOOL.kind, namespace, name)
        if body is not None:
            run_reconcile(EXPERTPOOL, expertpool.reconcile, body, 0)
    except (kopf.TemporaryError, KubeError) as error:
        logger.info("ExpertPool %s/%s: %s (the resync timer retries)", namespace, name, error)
    except Exception:
        logger.exception("ExpertPool %s/%s: reconcile failed (the resync timer retries)", namespace, name)


class Rechecks:
    """Reconciles scheduled for later, at most one per object (the earliest asked for)."""

    def __init__(self) -> None:
        self._due: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()

    def schedule(self, kind: str, namespace: str, name: str, delay: float) -> None:
        if kind != EXPERTPOOL.kind:
            raise ValueError(f"rechecks are only of ExpertPools, not {kind}")
        key, due = (kind, namespace, name), time.monotonic() + max(0.0, delay)
        with self._lock:
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
        timer = threading.Timer(max(0.0, delay), self._run, args=(key, due))
        timer.daemon = True
        timer.start()

    def _run(self, key: tuple[str, str, str], due: float) -> None:
        with self._lock:
            if self._due.get(key) != due:
                return  # an earlier recheck replaced this one
            del self._due[key]
        reconcile_expert_pool(key[1], key[2])


LEASES = ("coordination.k8s.io", "leases")  # the Lease watch's resource, as kopf's settings name it


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={naming.COMPONENT_LABEL: kopf.PRESENT})
def lease_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A Lease of one of our pods changed: reconcile the ExpertPools it concerns, if any."""
    ctx = context()
    if type == "DELETED":
        ctx.leases.forget(body)
        return
    concern = ctx.leases.seen(body, type, time.time())
    if concern is None:
        return
    if concern.pool is not None:
        names = [concern.pool]
    else:
        assert concern.service is not None
        try:
            pools = ctx.kube.list(EXPERTPOOL.kind, concern.namespace, {naming.SERVICE_LABEL: concern.service})
        except KubeError as error:
            logger.info("ExpertPools of MoEService %s/%s: %s", concern.namespace, concern.service, error)
            return
        names = [p["metadata"]["name"] for p in pools]
    for name in names:
        reconcile_expert_pool(concern.namespace, name)


def configure(settings: kopf.OperatorSettings, request_timeout: float) -> None:
    """Timeouts and storage prefixes (applied at startup; see :mod:`eaas.operator.main`).

    Watches are re-established every ~5 minutes by the server, and the client gives up on a silent
    connection after ~6, so a stalled watch cannot go unnoticed (kopf issues #204, #698). The Lease
    watch carries a label selector (:data:`~eaas.runtime.contract.HEARTBEAT_LEASE_SELECTOR`): a
    cluster's other Leases (node heartbeats, leader elections) never reach the operator.
    """
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = request_timeout
    settings.networking.request_timeout = request_timeout
    settings.networking.connect_timeout = request_timeout
    settings.networking.error_backoffs = [1, 2, 4, 8, 16, 32, 60]
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own Events are posted explicitly
    settings.scanning.disabled = True  # no cluster-wide CRD/namespace watching (least privilege)
    # The Lease watch asks only for our pods' heartbeat Leases: the API server filters, not the
    # operator (kopf's `labels=` filter above is applied to what arrives).
    settings.watching.label_selectors[LEASES] = naming.HEARTBEAT_LEASE_SELECTOR
    settings.execution.max_workers = 8


def make_context(
    kube: Kube, runtime_cluster_role: str | None = None, operator_namespace: str | None = None
) -> Context:
    return Context(
        kube=kube,
        metrics=default_metrics(),
        runtime_cluster_role=runtime_cluster_role,
        operator_namespace=operator_namespace,
        recheck=Rechecks().schedule,
    )
