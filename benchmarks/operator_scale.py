"""The operator at scale: API requests, reconciles, CPU and memory per pool while every expert
server's Lease renews, on a real control plane with kwok nodes.

A control plane from the cached binaries (``make k8s-bins``: etcd, kube-apiserver,
controller-manager, scheduler, kwok; fake GPU nodes only, no process nodes) records every request
of a ServiceAccount in the API server's audit log. The chart is installed with no operator
replica (CRDs, RBAC, the ServiceAccount), and ``eaas operator`` runs as a local process with the
ServiceAccount's token and the chart's resync period, as the chart's Deployment starts it. The
simulator (:class:`e2e.scale.LeaseSimulator`, one asyncio thread, as the admin) keeps one Lease
per Ready expert-server pod, renewed every 2 s with changing utilization and token-rate
annotations, and reports a stored placement loaded 1 s after it appears: what the operator needs
of a server to commit. Nothing serves on kwok's pods, so the load-based rebalance is off.

For each size (MoEServices of DeepSeek-V3's shape, 58 MoE layers x 256 experts, R = 2, each with
`--servers` expert servers) the MoEServices are created (the smaller size's stay), the operator
brings each to Ready, and after a warm-up of two resyncs the window is measured:

* the operator's API requests per second (watches apart), per MoEService (its ExpertPool and
  AttentionPool), from the audit log; its 409 and 429 answers; its lists without a selector;
* reconciles per object per minute, from the operator's ``eaas_operator_reconcile_total``;
  more than the resync's 60 / resync per minute would be reconciles the operator triggered
  itself (a status patch answered by a reconcile, and so on);
* the operator's CPU (ms per MoEService per second) and resident memory (now and peak);
* the simulator's own CPU (the benchmark process's, which does nothing else meanwhile).

From the sizes a straight line through (MoEServices, value) gives the figure at 100 MoEServices.
Then on the first MoEService: one expert-server pod deleted (until the pool is Ready again), and a
scale step to one more server (until the placement with it is committed).

Targets (the operator's scale issue): <= 0.2 API requests/s per pool and <= 5 ms CPU per pool
per second at 100 MoEServices, RSS <= 256 MiB at 100 MoEServices (the chart's limit is 512 MiB;
the process runs without it and its peak is compared), no self-triggered reconciles, no 409/429.
The baseline printed beside the operator's requests is the servers' own heartbeat traffic
(renewals per second) in the same window.

Absolute CPU times on a loaded 2-core machine mean little: the control plane, kwok, the
simulator and the operator share the cores.

    python benchmarks/operator_scale.py                 # 1, 2, 4 MoEServices x 64 servers
    python benchmarks/operator_scale.py --quick         # 1, 2 MoEServices x 8 servers
"""

from __future__ import annotations

import math
import resource
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit, parser, target  # noqa: E402

from e2e.cluster import Cluster  # noqa: E402
from e2e.controlplane import ControlPlane, FakeNodeSpec  # noqa: E402
from e2e.operator.harness import CHART, OperatorProcess, service_account_kubeconfig  # noqa: E402
from e2e.scale import (  # noqa: E402
    AuditLog,
    LeaseSimulator,
    ProcessSample,
    RequestSummary,
    admin_ssl_context,
    audit_args,
    scale_manifest,
    value_at,
)
from e2e.waiting import wait_until  # noqa: E402

GROUP, VERSION = "eaas.io", "v1alpha1"
OPERATOR_NAMESPACE, NAMESPACE = "eaas-system", "scale"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:eaas-operator"
CHART_RESYNC_SECONDS = 10.0  # charts/eaas/values.yaml operator.resyncSeconds
CHART_MEMORY_LIMIT = 512 * 2**20  # charts/eaas/values.yaml resources.limits.memory
AT = 100  # MoEServices the figures are extrapolated to
MIB = 2**20


def service_name(index: int) -> str:
    return f"moe-{index:03d}"


def expert_pool(service: str) -> str:
    return f"{service}-experts"  # eaas.operator.naming.expert_pool_name(service, "blue")


def pool_status(cluster: Cluster, service: str) -> dict[str, Any]:
    pool = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, "expertpools", expert_pool(service)
    )
    return dict(pool.get("status") or {})


def settled(cluster: Cluster, service: str, servers: int) -> bool:
    """The pool serves `servers` servers, all Ready, and nothing is in progress."""
    try:
        status = pool_status(cluster, service)
    except Exception:
        return False
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        len(status.get("servers") or []) == servers
        and status.get("readyReplicas") == servers
        and not status.get("downServers")
        and conditions.get("Progressing") == "False"
    )


def reconciles(metrics_port: int) -> dict[str, float]:
    """``eaas_operator_reconcile_total`` by kind (all results)."""
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


def install_chart(cluster: Cluster) -> None:
    """The chart with no operator replica: CRDs, RBAC and the operator's ServiceAccount."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    cluster.helm("install", "eaas", str(CHART), "-n", OPERATOR_NAMESPACE, "--set", "replicaCount=0", "--wait")
    for crd in ("moeservices.eaas.io", "attentionpools.eaas.io", "expertpools.eaas.io"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    cluster.kubectl("create", "namespace", NAMESPACE)


def timed(condition: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    wait_until(condition, timeout, what, interval=0.5)
    return time.monotonic() - started


def measure(
    cluster: Cluster,
    operator: OperatorProcess,
    simulator: LeaseSimulator,
    audit: AuditLog,
    services: int,
    window_s: float,
) -> dict[str, Any]:
    """One steady-state window at `services` MoEServices."""
    assert operator.process is not None
    pid = operator.process.pid
    before, counted = ProcessSample.of(pid), reconciles(operator.metrics_port)
    renewals, own = simulator.counts["renewals"], resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(window_s)
    after, counted_after = ProcessSample.of(pid), reconciles(operator.metrics_port)
    own_after = resource.getrusage(resource.RUSAGE_SELF)
    seconds = after.at - before.at
    time.sleep(2)  # requests received in the window and completed after it reach the log
    summary = RequestSummary.of(audit.between(before.at, after.at, OPERATOR_USER), seconds)
    per_minute = {
        kind: (counted_after.get(kind, 0) - counted.get(kind, 0)) / services / seconds * 60
        for kind in sorted(counted_after)
    }
    sim_cpu = (own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime) / seconds
    return {
        "services": services,
        "servers": simulator.servers(),
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
        "operator_cpu_ms_per_pool_per_s": round(1000 * (after.cpu_s - before.cpu_s) / seconds / services, 2),
        "operator_rss_mib": round(after.rss_bytes / MIB, 1),
        "operator_peak_rss_mib": round(after.peak_rss_bytes / MIB, 1),
        "lease_renewals_per_s": round((simulator.counts["renewals"] - renewals) / seconds, 1),
        "simulator_cpu_fraction_of_a_core": round(sim_cpu, 3),
    }


def events(cluster: Cluster, service: str, servers: int, timeout: float) -> dict[str, float]:
    """A pod deleted (until a new pod of that name is Ready and the pool settled again), then a
    scale step of one server (until the placement with it is committed), on `service`'s pool:
    seconds each."""
    pool = expert_pool(service)
    name = f"{pool}-{servers // 2}"
    uid = cluster.core.read_namespaced_pod(name, NAMESPACE).metadata.uid
    started = time.monotonic()
    cluster.core.delete_namespaced_pod(name, NAMESPACE)

    def replaced() -> bool:
        try:
            pod = cluster.core.read_namespaced_pod(name, NAMESPACE)
        except Exception:
            return False
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return pod.metadata.uid != uid and ready and settled(cluster, service, servers)

    wait_until(replaced, timeout, f"{name} replaced and {pool} Ready", interval=0.5)
    deleted = time.monotonic() - started
    patch = {"spec": {"expertPool": {"replicas": servers + 1}}}
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "moeservices", service, patch)
    scaled = timed(
        lambda: settled(cluster, service, servers + 1), timeout, f"{pool} at {servers + 1} servers"
    )
    return {"pod_deleted_to_ready_s": round(deleted, 1), "scale_step_to_committed_s": round(scaled, 1)}


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'MoEServices':>11} {'servers':>7} {'req/s':>7} {'req/s/pool':>10} {'409':>4} {'429':>4} "
        f"{'unfilt.':>7} {'EP rec/min':>10} {'cpu ms/pool/s':>13} {'RSS MiB':>8} {'peak':>6} "
        f"{'renew/s':>8} {'sim cpu':>7}"
    )
    print(header)
    for r in rows:
        per_minute = r["reconciles_per_object_per_min"].get("ExpertPool", 0.0)
        print(
            f"{r['services']:>11} {r['servers']:>7} {r['api_requests_per_s']:>7.2f} "
            f"{r['api_requests_per_s_per_pool']:>10.3f} {r['conflicts_409']:>4} {r['throttled_429']:>4} "
            f"{r['unfiltered_lists']:>7} {per_minute:>10.2f} {r['operator_cpu_ms_per_pool_per_s']:>13.2f} "
            f"{r['operator_rss_mib']:>8.1f} {r['operator_peak_rss_mib']:>6.1f} "
            f"{r['lease_renewals_per_s']:>8.1f} {r['simulator_cpu_fraction_of_a_core']:>7.3f}"
        )
    for r in rows:
        print(f"  {r['services']} MoEService(s), requests by kind: {r['requests_by_kind']}")


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default=None, help="MoEService counts, comma-separated (default 1,2,4; quick 1,2)"
    )
    p.add_argument("--servers", type=int, default=None, help="expert servers per MoEService (64; quick 8)")
    p.add_argument("--window-seconds", type=float, default=None, help="steady-state window (60; quick 20)")
    p.add_argument("--no-events", action="store_true", help="skip the pod deletion and the scale step")
    p.add_argument("--keep", action="store_true", help="keep the control plane's directory (logs)")
    args = p.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,2" if args.quick else "1,2,4")).split(",")]
    servers = args.servers or (8 if args.quick else 64)
    window_s = args.window_seconds or (20.0 if args.quick else 60.0)
    resync = CHART_RESYNC_SECONDS
    most = max(sizes) * servers + 8 + max(sizes)  # expert servers + the scale step + attention pods
    nodes = FakeNodeSpec(count=math.ceil(most / 8) + 1, gpus=8, cpu="64", memory="512Gi", pods=110)
    work = Path(tempfile.mkdtemp(prefix="eaas-scale-"))
    plane = ControlPlane(nodes=nodes, work_dir=work / "plane", api_server_args=audit_args(work / "audit"))
    print(f"control plane in {work} ({nodes.count} kwok nodes x 8 GPUs)", flush=True)
    rows: list[dict[str, Any]] = []
    ready_s: dict[int, float] = {}
    extra: dict[str, float] = {}
    simulator: LeaseSimulator | None = None
    operator: OperatorProcess | None = None
    try:
        plane.start()
        cluster = Cluster.from_kubeconfig(plane.kubeconfig, "local", work_dir=plane.work_dir)
        install_chart(cluster)
        kubeconfig = service_account_kubeconfig(
            cluster, OPERATOR_NAMESPACE, "eaas-operator", work / "op.kubeconfig"
        )
        operator = OperatorProcess(
            kubeconfig=kubeconfig,
            log_path=work / "operator.log",
            namespace=OPERATOR_NAMESPACE,
            resync_seconds=resync,
        )
        operator.start()
        operator.wait_started(60)
        context = admin_ssl_context(plane.pki.ca_cert, plane.pki.admin_cert, plane.pki.admin_key)
        simulator = LeaseSimulator(plane.server, context, NAMESPACE)
        simulator.start()
        audit = AuditLog(work / "audit" / "audit.log")
        made = 0
        for size in sizes:
            started = time.monotonic()
            new = [service_name(i) for i in range(made, size)]
            for name in new:
                cluster.apply(yaml.safe_dump(scale_manifest(name, servers)), NAMESPACE)
            simulator.add_pools({expert_pool(name): name for name in new})
            made = size
            for name in new:
                wait_until(lambda n=name: settled(cluster, n, servers), 120 + 10 * servers, f"{name} Ready")
            ready_s[size] = round(time.monotonic() - started, 1)
            print(f"{size} MoEService(s) Ready ({len(new)} new in {ready_s[size]} s); warming up", flush=True)
            time.sleep(2 * resync)
            operator.check_alive()
            rows.append(measure(cluster, operator, simulator, audit, size, window_s))
            rows[-1]["new_services_ready_s"] = ready_s[size]
            print_table(rows[-1:])
        if not args.no_events:
            extra = events(cluster, service_name(0), servers, 120 + 10 * servers)
            print(f"events on {service_name(0)}: {extra}", flush=True)
        operator.check_alive()
    finally:
        if simulator is not None:
            simulator.stop()
        if operator is not None:
            operator.stop()
        plane.stop(remove_work_dir=not args.keep)
        if args.keep:
            print(f"kept {work}")

    print()
    print_table(rows)
    per_pool_requests = value_at([(r["services"], r["api_requests_per_s"]) for r in rows], AT) / AT
    cpu_ms = (
        value_at([(r["services"], r["operator_cpu_ms_per_pool_per_s"] * r["services"]) for r in rows], AT)
        / AT
    )
    rss = value_at([(r["services"], r["operator_peak_rss_mib"]) for r in rows], AT)
    resync_per_min = 60 / resync
    worst_loop = max(max(r["reconciles_per_object_per_min"].values(), default=0.0) for r in rows)
    print(
        f"\nat {AT} MoEServices (a line through {len(rows)} sizes of {servers} servers): "
        f"{per_pool_requests:.3f} requests/s per pool, {cpu_ms:.2f} ms CPU per pool per s, "
        f"peak RSS {rss:.0f} MiB (chart limit {CHART_MEMORY_LIMIT // MIB} MiB); "
        f"most reconciles of one object {worst_loop:.2f}/min (resync alone: {resync_per_min:.0f}/min)"
    )
    targets = {
        f"api_requests_per_s_per_pool_at_{AT}": target(
            round(per_pool_requests, 3), 0.2, higher_is_better=False
        ),
        f"operator_cpu_ms_per_pool_per_s_at_{AT}": target(round(cpu_ms, 2), 5.0, higher_is_better=False),
        f"operator_rss_mib_at_{AT}": target(round(rss, 1), 256.0, higher_is_better=False),
        "reconciles_per_object_per_min_over_resync": target(
            round(worst_loop / resync_per_min, 2), 1.25, higher_is_better=False
        ),
        "conflicts_and_throttled": target(
            sum(r["conflicts_409"] + r["throttled_429"] for r in rows), 0, higher_is_better=False
        ),
    }
    results = [*rows, {"events": extra, "servers_per_service": servers, "resync_seconds": resync}]
    emit("operator_scale", results, targets, args.json_out)


if __name__ == "__main__":
    main()
