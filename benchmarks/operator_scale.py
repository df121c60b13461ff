"""The operator at scale: API requests, reconciles, CPU and memory per pool while every expert
server's Lease renews, on a real control plane with kwok nodes.

A control plane from the cached binaries (``make k8s-bins``: etcd, kube-apiserver,
controller-manager, scheduler, kwok; fake GPU nodes only, no process nodes) records every request
of a ServiceAccount in the API server's audit log. The chart is installed with no operator
replica (CRDs, RBAC, the ServiceAccount), and ``eaas operator`` runs as a local process with the
ServiceAccount's token and the chart's resync period, as the chart's Deployment starts it. The
simulator (:class:`e2e.lease_simulator.LeaseSimulator`, one asyncio thread, as the admin) keeps one Lease
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
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit, parser, target  # noqa: E402

from e2e.scale import value_at  # noqa: E402
from e2e.scale_run import CHART_RESYNC_SECONDS, ScaleRun  # noqa: E402

CHART_MEMORY_LIMIT_MIB = 512  # charts/eaas/values.yaml resources.limits.memory
AT = 100  # MoEServices the figures are extrapolated to


def service_name(index: int) -> str:
    return f"moe-{index:03d}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'MoEServices':>11} {'servers':>7} {'req/s':>7} {'req/s/pool':>10} {'409':>4} {'429':>4} "
        f"{'unfilt.':>7} {'EP rec/min':>10} {'cpu ms/pool/s':>13} {'RSS MiB':>8} {'peak':>6} "
        f"{'renew/s':>8} {'sim cpu':>7}"
    )
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
    p.add_argument("--sizes", default=None, help="MoEService counts, comma-separated (1,2,4; quick 1,2)")
    p.add_argument("--servers", type=int, default=None, help="expert servers per MoEService (64; quick 8)")
    p.add_argument("--window-seconds", type=float, default=None, help="steady-state window (60; quick 15)")
    p.add_argument("--no-events", action="store_true", help="skip the pod deletion and the scale step")
    p.add_argument("--kimi", action="store_true", help="also a Kimi-K2 pool (60 x 384, R=3) of 320 servers")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs, audit log)")
    args = p.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,2" if args.quick else "1,2,4")).split(",")]
    servers = args.servers or (8 if args.quick else 64)
    window_s = args.window_seconds or (15.0 if args.quick else 60.0)
    resync = CHART_RESYNC_SECONDS
    most = max(sizes) * (servers + 1) + (320 if args.kimi else 0)  # expert servers, the scale step
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    with ScaleRun(nodes=math.ceil(most / 8) + 2, resync_seconds=resync, keep=args.keep) as run:
        print(f"control plane in {run.work}", flush=True)
        made = 0
        for size in sizes:
            new = [service_name(i) for i in range(made, size)]
            took = run.deploy(new, servers)
            made = size
            print(f"{size} MoEService(s) Ready ({len(new)} new in {took:.1f} s); warming up", flush=True)
            time.sleep(2 * resync)
            rows.append({**run.measure(size, window_s), "new_services_ready_s": round(took, 1)})
            print_table(rows[-1:])
        timeout = 120 + 10 * servers
        if not args.no_events:
            extra["pod_deleted_to_ready_s"] = round(run.pod_deleted(service_name(0), servers, timeout), 1)
            extra["scale_step_to_committed_s"] = round(run.scale_step(service_name(0), servers, timeout), 1)
            print(f"events on {service_name(0)} ({servers} servers): {extra}", flush=True)
        if args.kimi:
            kimi = {"replication": 3, "layers": 61, "dense_layers": 1, "experts": 384, "preset": "kimi-k2"}
            extra["kimi_320_ready_s"] = round(run.deploy(["kimi-k2"], 320, timeout=900, **kimi), 1)
            print(f"Kimi-K2 x 320 (R=3) Ready in {extra['kimi_320_ready_s']} s", flush=True)
        assert run.operator is not None
        run.operator.check_alive()

    print()
    print_table(rows)
    per_pool_requests = value_at([(r["services"], r["api_requests_per_s"]) for r in rows], AT) / AT
    total_cpu = [(r["services"], r["operator_cpu_ms_per_pool_per_s"] * r["services"]) for r in rows]
    cpu_ms = value_at(total_cpu, AT) / AT
    rss = value_at([(r["services"], r["operator_peak_rss_mib"]) for r in rows], AT)
    # A window of w seconds holds at most w / resync + 1 resync passes of an object: more is a
    # reconcile the operator triggered itself (or a Lease's news, none in the steady state).
    resync_per_min = (window_s / resync + 1) * 60 / window_s
    most_reconciles = max(max(r["reconciles_per_object_per_min"].values(), default=0.0) for r in rows)
    print(
        f"\nat {AT} MoEServices (a line through {len(rows)} sizes of {servers} servers): "
        f"{per_pool_requests:.3f} requests/s per pool, {cpu_ms:.2f} ms CPU per pool per s, "
        f"peak RSS {rss:.0f} MiB (chart limit {CHART_MEMORY_LIMIT_MIB} MiB); most reconciles of one "
        f"object {most_reconciles:.2f}/min (the resync alone: at most {resync_per_min:.1f}/min in the window)"
    )
    targets = {
        f"api_requests_per_s_per_pool_at_{AT}": target(
            round(per_pool_requests, 3), 0.2, higher_is_better=False
        ),
        f"operator_cpu_ms_per_pool_per_s_at_{AT}": target(round(cpu_ms, 2), 5.0, higher_is_better=False),
        f"operator_rss_mib_at_{AT}": target(round(rss, 1), 256.0, higher_is_better=False),
        "reconciles_per_object_over_resync_passes": target(
            round(most_reconciles / resync_per_min, 2), 1.0, higher_is_better=False
        ),
        "conflicts_and_throttled": target(
            sum(r["conflicts_409"] + r["throttled_429"] for r in rows), 0, higher_is_better=False
        ),
    }
    results = [*rows, {"events": extra, "servers_per_service": servers, "resync_seconds": resync}]
    emit("operator_scale", results, targets, args.json_out)


if __name__ == "__main__":
    main()
