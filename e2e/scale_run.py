"""One run of the operator at scale: a kwok control plane that audits ServiceAccounts, the chart
(no operator replica), ``eaas operator`` as its ServiceAccount with the chart's resync, and the
Lease simulator; then MoEServices deployed, brought to Ready and measured in a steady window.

    with ScaleRun(nodes=8) as run:
        run.deploy(["moe-000"], servers=16)
        window = run.measure(services=1, window_s=20)

Only kwok nodes: no pod runs, no kube-proxy, no Service address is routed (another control plane
may run on the same machine).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from e2e.backends import plane_cluster
from e2e.binaries import KWOK_PLANE, Binaries
from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane, FakeNodeSpec
from e2e.lease_simulator import LeaseSimulator, admin_ssl_context
from e2e.operator.harness import CHART, OperatorProcess, service_account_kubeconfig
from e2e.scale import AuditLog, ProcessSample, RequestSummary, audit_args, scale_manifest
from e2e.waiting import wait_until

GROUP, VERSION = "eaas.io", "v1alpha1"
OPERATOR_NAMESPACE, NAMESPACE = "eaas-system", "scale"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:eaas-operator"
CHART_RESYNC_SECONDS = 10.0  # charts/eaas/values.yaml operator.resyncSeconds
MIB = 2**20


def expert_pool(service: str) -> str:
    return f"{service}-experts"  # eaas.operator.naming.expert_pool_name(service, "blue")


def reconciles(metrics_port: int) -> dict[str, float]:
    """``eaas_operator_reconcile_total`` of the operator on `metrics_port`, by kind (all results)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "eaas_operator_reconcile_total":
                kind = sample.labels["kind"]
                counts[kind] = counts.get(kind, 0.0) + sample.value
    return counts


class ScaleRun:
    """Start with ``with``; :attr:`cluster`, :attr:`operator`, :attr:`simulator`, :attr:`audit`."""

    def __init__(
        self,
        nodes: int,
        resync_seconds: float = CHART_RESYNC_SECONDS,
        work_dir: Path | None = None,
        keep: bool = False,
    ) -> None:
        self._own_work = work_dir is None
        self.work = work_dir or Path(tempfile.mkdtemp(prefix="eaas-scale-"))
        self.resync_seconds = resync_seconds
        self.keep = keep
        spec = FakeNodeSpec(count=nodes, gpus=8, cpu="64", memory="512Gi", pods=110)
        self.plane = ControlPlane(
            binaries=Binaries.locate(KWOK_PLANE),
            nodes=spec,
            work_dir=self.work / "plane",
            api_server_args=audit_args(self.work / "audit"),
        )
        self.audit = AuditLog(self.work / "audit" / "audit.log")
        self.operator: OperatorProcess | None = None
        self.simulator: LeaseSimulator | None = None
        self._cluster: Cluster | None = None

    @property
    def cluster(self) -> Cluster:
        assert self._cluster is not None, "the run was not started"
        return self._cluster

    def __enter__(self) -> ScaleRun:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.plane.start()
        cluster = self._cluster = plane_cluster(self.plane)
        cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
        cluster.helm(
            "install", "eaas", str(CHART), "-n", OPERATOR_NAMESPACE, "--set", "replicaCount=0", "--wait"
        )
        for crd in ("moeservices.eaas.io", "attentionpools.eaas.io", "expertpools.eaas.io"):
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
        cluster.kubectl("create", "namespace", NAMESPACE)
        kubeconfig = service_account_kubeconfig(
            cluster, OPERATOR_NAMESPACE, "eaas-operator", self.work / "operator.kubeconfig"
        )
        self.operator = OperatorProcess(
            kubeconfig=kubeconfig,
            log_path=self.work / "operator.log",
            namespace=OPERATOR_NAMESPACE,
            resync_seconds=self.resync_seconds,
        )
        self.operator.start()
        self.operator.wait_started(60)
        pki = self.plane.pki
        context = admin_ssl_context(pki.ca_cert, pki.admin_cert, pki.admin_key)
        self.simulator = LeaseSimulator(self.plane.server, context, NAMESPACE)
        self.simulator.start()

    def stop(self) -> None:
        try:
            if self.simulator is not None:
                self.simulator.stop()
        finally:
            if self.operator is not None:
                self.operator.stop()
            self.plane.stop(remove_work_dir=not self.keep)
            if self._own_work and not self.keep:  # the audit log, the operator's log and kubeconfig
                shutil.rmtree(self.work, ignore_errors=True)

    # -- the workload ----------------------------------------------------------------------------
    def pool_status(self, service: str) -> dict[str, Any]:
        pool: dict[str, Any] = self.cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "expertpools", expert_pool(service)
        )  # type: ignore[assignment]
        return dict(pool.get("status") or {})

    def settled(self, service: str, servers: int) -> bool:
        """`service`'s pool serves `servers` servers, all Ready, and nothing is in progress."""
        try:
            status = self.pool_status(service)
        except Exception:
            return False
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return (
            len(status.get("servers") or []) == servers
            and status.get("readyReplicas") == servers
            and not status.get("downServers")
            and conditions.get("Progressing") == "False"
        )

    def deploy(self, services: list[str], servers: int, timeout: float | None = None, **shape: Any) -> float:
        """Create MoEServices `services` (:func:`scale_manifest` with `servers` and `shape`), give
        their pools' servers heartbeats and wait until every one is settled; returns the seconds."""
        assert self.simulator is not None
        started = time.monotonic()
        for name in services:
            self.cluster.apply(yaml.safe_dump(scale_manifest(name, servers, **shape)), NAMESPACE)
        self.simulator.add_pools({expert_pool(name): name for name in services})
        for name in services:
            wait_until(
                lambda name=name: self.settled(name, servers),  # type: ignore[misc]
                timeout or 120 + 10 * servers,
                f"{name} Ready with {servers} servers",
                interval=0.5,
            )
        return time.monotonic() - started

    # -- measuring -------------------------------------------------------------------------------
    def measure(self, services: int, window_s: float) -> dict[str, Any]:
        """One steady-state window with `services` MoEServices deployed (see benchmarks/operator_scale.py)."""
        assert self.operator is not None and self.operator.process is not None and self.simulator is not None
        import resource

        self.operator.check_alive()
        pid, port = self.operator.process.pid, self.operator.metrics_port
        before, counted = ProcessSample.of(pid), reconciles(port)
        renewals, own = self.simulator.counts["renewals"], resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(window_s)
        after, counted_after = ProcessSample.of(pid), reconciles(port)
        own_after = resource.getrusage(resource.RUSAGE_SELF)
        seconds = after.at - before.at
        time.sleep(2)  # requests received in the window and completed after it reach the log
        summary = RequestSummary.of(self.audit.between(before.at, after.at, OPERATOR_USER), seconds)
        per_minute = {
            kind: (counted_after.get(kind, 0) - counted.get(kind, 0)) / services / seconds * 60
            for kind in sorted(counted_after)
        }
        simulator_cpu = (own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime) / seconds
        return {
            "services": services,
            "servers": self.simulator.servers(),
            "window_s": round(seconds, 1),
            "api_requests_per_s": round(summary.per_second, 3),
            "api_requests_per_s_per_pool": round(summary.per_second / services, 3),
            "requests_by_kind": summary.by_kind,
            "watches_ended": summary.watches,
            "conflicts_409": summary.conflicts,
            "throttled_429": summary.throttled,
            "other_errors": summary.errors,
            "unfiltered_lists": summary.unfiltered_lists,
            "reconciles_per_object_per_min": {k: round(v, 2) for k, v in per_minute.items()},
            "operator_cpu_ms_per_pool_per_s": round(
                1000 * (after.cpu_s - before.cpu_s) / seconds / services, 2
            ),
            "operator_rss_mib": round(after.rss_bytes / MIB, 1),
            "operator_peak_rss_mib": round(after.peak_rss_bytes / MIB, 1),
            "lease_renewals_per_s": round((self.simulator.counts["renewals"] - renewals) / seconds, 1),
            "simulator_cpu_fraction_of_a_core": round(simulator_cpu, 3),
        }

    def pod_deleted(self, service: str, servers: int, timeout: float) -> float:
        """Deletes one expert-server pod of `service`; seconds until a new pod of that name is Ready
        and the pool settled again."""
        name = f"{expert_pool(service)}-{servers // 2}"
        uid = self._pod(name)[0]
        started = time.monotonic()
        self.cluster.core.delete_namespaced_pod(name, NAMESPACE)

        def replaced() -> bool:
            try:
                now_uid, ready = self._pod(name)
            except Exception:
                return False
            return now_uid != uid and ready and self.settled(service, servers)

        wait_until(replaced, timeout, f"{name} replaced and its pool Ready", interval=0.5)
        return time.monotonic() - started

    def _pod(self, name: str) -> tuple[str, bool]:
        """(uid, Ready) of pod `name`."""
        pod = self.cluster.core.read_namespaced_pod(name, NAMESPACE).to_dict()
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        return str(pod["metadata"]["uid"]), ready

    def scale_step(self, service: str, servers: int, timeout: float) -> float:
        """`service` from `servers` to one more expert server; seconds until the placement with it
        is committed and the pool settled."""
        started = time.monotonic()
        patch = {"spec": {"expertPool": {"replicas": servers + 1}}}
        self.cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "moeservices", service, patch
        )
        wait_until(
            lambda: self.settled(service, servers + 1),
            timeout,
            f"{service} at {servers + 1} servers",
            interval=0.5,
        )
        return time.monotonic() - started
