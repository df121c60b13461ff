"""Prometheus metrics of the operator (low-cardinality: kind and result only).

``eaas_operator_reconcile_total{kind,result}`` counts reconciles by outcome (``success``,
``retry`` for API errors worth retrying, ``error`` otherwise); ``eaas_operator_reconcile_duration_seconds
{kind}`` is their duration. Scale and placement changes are also counted, so an alert can fire on
a pool that keeps re-planning; ``eaas_operator_rebalances_total{result}`` counts load-based
rebalance decisions and ``eaas_operator_stats_scrapes_total{result}`` the servers' stats scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

RESULTS = ("success", "retry", "error")
STAGES = ("proposed", "committed")  # of a published placement
WRITERS = ("moeservice", "autoscaler")  # who the operator writes ExpertPool replicas as (replicas_writer)
REBALANCE_RESULTS = ("rebalanced", "skipped", "unchanged", "baseline", "idle", "incomplete", "stale", "error")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """The operator's metrics, registered in `registry` (a fresh one in tests)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.reconciles = Counter(
            "eaas_operator_reconcile_total",
            "Reconciles of eaas.io objects, by kind and result (success, retry, error).",
            ["kind", "result"],
            registry=registry,
        )
        self.duration = Histogram(
            "eaas_operator_reconcile_duration_seconds",
            "Duration of one reconcile of an eaas.io object.",
            ["kind"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.placement_changes = Counter(
            "eaas_operator_placement_changes_total",
            "Placements published (proposed or committed) for ExpertPools.",
            ["stage"],
            registry=registry,
        )
        self.rebalances = Counter(
            "eaas_operator_rebalances_total",
            "Load-based rebalance decisions for ExpertPools, by result (rebalanced, skipped, unchanged, "
            "baseline, idle, incomplete, stale, error).",
            ["result"],
            registry=registry,
        )
        self.stats_scrapes = Counter(
            "eaas_operator_stats_scrapes_total",
            "Scrapes of expert servers' /v1/stats for rebalancing, by result (success, error).",
            ["result"],
            registry=registry,
        )
        self.scale_writes = Counter(
            "eaas_operator_scale_writes_total",
            "Writes of ExpertPool replicas through /scale by the operator, by writer.",
            ["writer"],
            registry=registry,
        )
        # Every known label value starts at 0, so its series exists (rate() and the dashboard's
        # panels see the first change, not only the second) before anything happened.
        for stage in STAGES:
            self.placement_changes.labels(stage)
        for writer in WRITERS:
            self.scale_writes.labels(writer)
        for result in REBALANCE_RESULTS:
            self.rebalances.labels(result)
        for result in ("success", "error"):
            self.stats_scrapes.labels(result)

    @contextmanager
    def reconcile(self, kind: str) -> Iterator[None]:
        """Time a reconcile of `kind` and count its result (exceptions are re-raised)."""
        from eaas.operator.kube import KubeError

        started = time.perf_counter()
        result = "success"
        try:
            yield
        except KubeError as error:
            result = "retry" if error.retryable else "error"
            raise
        except Exception:
            result = "error"
            raise
        finally:
            self.duration.labels(kind).observe(time.perf_counter() - started)
            self.reconciles.labels(kind, result).inc()

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on `port` (0 = do not serve)."""
        if port:
            disable_created_metrics()  # no *_created series: they double the counters for no use
            start_http_server(port, addr=address, registry=self.registry)


_default: OperatorMetrics | None = None


def default() -> OperatorMetrics:
    """The process-wide metrics in the default registry (created on first use)."""
    global _default
    if _default is None:
        _default = OperatorMetrics()
    return _default
