# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
"""Autoscaling on expert load, end to end: Prometheus scrapes the expert servers, prometheus-adapter
serves their busy fraction as ``custom.metrics.k8s.io`` (:mod:`e2e.metrics`), the controller-manager's
HorizontalPodAutoscaler scales the ExpertPool through ``/scale`` and the operator adds or drains
expert servers one at a time; then the same with the operator's built-in autoscaler.

Load comes from streaming clients through the AttentionPool's Service. Every drill asserts: no
failed request, every answer identical to the reference, never fewer than R Ready replicas of any
expert, committed placements one server apart. The timeline (load, metric, replicas, placement
versions) is printed and saved as JSON (``$EAAS_E2E_RESULTS_DIR`` or pytest's temporary directory).

The target busy fraction is calibrated in the run: on this shared 2-core machine a server's busy
fraction under a given load is not known in advance, so :func:`calibration` measures it at the
pool's minimum size and sets the target where that load needs about two more servers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane
from e2e.metrics import HPA_MANIFEST, MetricsStack
from e2e.operator.harness import OperatorProcess
from e2e.operator.system.conftest import pod_logs
from e2e.operator.system.workload import (
    GROUP,
    NAME,
    POOL,
    REPLICATION,
    VERSION,
    Load,
    ReplicaWatch,
    System,
    deploy,
)
from e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

METRIC = "eaas_expert_server_busy_ratio"
MIN_SERVERS = REPLICATION
MAX_SERVERS = 4
HEAVY_WORKERS = 6  # concurrent streams at the peak
LIGHT_WORKERS = 1
SCALE_DOWN_WINDOW_S = 15


@pytest.fixture(scope="module")
def metrics(process_plane: ControlPlane) -> Iterator[MetricsStack]:
    with MetricsStack(process_plane) as stack:
        yield stack


@pytest.fixture(scope="module")
def system(
    cluster: Cluster,
    process_plane: ControlPlane,
    node_checkpoint: Path,
    system_operator: OperatorProcess,
    metrics: MetricsStack,
) -> Iterator[System]:
    """The tiny MoEService at R servers in external mode (the HPA's to scale)."""

    def external(manifest: dict[str, Any]) -> None:
        manifest["spec"]["expertPool"]["replicas"] = MIN_SERVERS
        manifest["spec"]["autoscaling"] = {"mode": "external"}

    with deploy(
        cluster, process_plane, node_checkpoint, system_operator, "autoscale", external, MIN_SERVERS
    ) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if configured := os.environ.get("EAAS_E2E_RESULTS_DIR"):
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("autoscaling")


class Timeline:
    """Samples, every second: requests in flight, the metric the HPA reads (per pod), the pool's
    replicas (spec, Ready), the committed placement and who last wrote ``spec.replicas``."""

    def __init__(self, system: System, stack: MetricsStack, loads: list[Load]) -> None:
        self.system, self.stack, self.loads = system, stack, loads
        self.started = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.replica_writers: set[str] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Timeline:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self.stopping.wait(1.0):
            with contextlib.suppress(Exception):  # an API hiccup: skip this sample
                self.samples.append(self.sample())

    def sample(self) -> dict[str, Any]:
        pool = self.system.expert_pool()
        for entry in pool["metadata"].get("managedFields") or []:
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                self.replica_writers.add(f"{entry['manager']}/{entry.get('subresource', '')}")
        try:
            metric: dict[str, float] | None = self.stack.pods_metric(self.system.namespace, METRIC)
        except Exception:  # not served (Prometheus away): recorded as such
            metric = None
        placement, pending = self.system.placement()
        in_flight = 0
        for load in self.loads:
            with load.lock:
                in_flight += sum(1 for o in load.outcomes if not o.done)
        return {
            "t": round(time.monotonic() - self.started, 1),
            "in_flight": in_flight,
            "metric": metric,
            "spec_replicas": pool["spec"]["replicas"],
            "ready": (pool.get("status") or {}).get("readyReplicas", 0),
            "utilization_milli": (pool.get("status") or {}).get("utilizationMilli"),
            "placement": [placement.version, list(placement.ordinals), pending],
        }

    def mean_metric(self, since: float) -> float | None:
        """Mean over samples after `since` (s on the timeline) of the per-pod mean metric."""
        values = [
            sum(s["metric"].values()) / len(s["metric"])
            for s in self.samples
            if s["t"] >= since and s["metric"]
        ]
        return sum(values) / len(values) if values else None

    def now(self) -> float:
        return time.monotonic() - self.started

    def save(self, path: Path, **extra: Any) -> None:
        path.write_text(json.dumps({"samples": self.samples, **extra}, indent=1))

    def table(self, every: int = 5) -> str:
        lines = ["    t  flight  replicas ready  placement       busy per pod"]
        for s in self.samples[::every]:
            metric = s["metric"]
            busy = " ".join(f"{v:.2f}" for _, v in sorted(metric.items())) if metric else "(none)"
            version, ordinals, pending = s["placement"]
            placed = f"v{version}{ordinals}{'+' if pending else ''}"
            lines.append(
                f"{s['t']:6.0f}  {s['in_flight']:6d}  {s['spec_replicas']:8d} {s['ready']:5d}  "
                f"{placed:<14}  {busy}"
            )
        return "\n".join(lines)


def hpa_manifest(min_replicas: int, target_milli: int) -> dict[str, Any]:
    """The HPA of manifests/expertpool-hpa.yaml aimed at this drill's pool, with test-speed behaviour."""
    hpa, _ = yaml.safe_load_all(HPA_MANIFEST.read_text())
    hpa["metadata"]["name"] = POOL
    hpa["spec"]["scaleTargetRef"]["name"] = POOL
    hpa["spec"]["minReplicas"] = min_replicas
    hpa["spec"]["maxReplicas"] = MAX_SERVERS
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = f"{target_milli}m"
    hpa["spec"]["behavior"] = {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 5}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 5}],
        },
    }
    return hpa


def apply_hpa(system: System, manifest: dict[str, Any]) -> None:
    system.cluster.apply(json.dumps(manifest), system.namespace)


def delete_hpa(system: System) -> None:
    system.cluster.kubectl("delete", "hpa", POOL, "-n", system.namespace, "--ignore-not-found")


def hpa_status(system: System) -> dict[str, Any]:
    out = system.cluster.kubectl("get", "hpa", POOL, "-n", system.namespace, "-o", "json").stdout
    return json.loads(out).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def events(system: System, reason: str, kind: str | None = None) -> list[dict[str, Any]]:
    out = system.cluster.kubectl("get", "events", "-n", system.namespace, "-o", "json").stdout
    return [
        e
        for e in json.loads(out)["items"]
        if e.get("reason") == reason and (kind is None or e["involvedObject"]["kind"] == kind)
    ]


def set_mode(system: System, autoscaling: dict[str, Any]) -> None:
    system.cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, system.namespace, "moeservices", NAME, {"spec": {"autoscaling": autoscaling}}
    )


def settled(system: System, servers: int) -> bool:
    """`servers` expert servers Ready, every expert on R of them, the placement committed on them."""
    placement, pending = system.placement()
    return system.full_strength(servers) and not pending and len(placement.ordinals) == servers


_calibrated: dict[str, int] = {}


def calibration(system: System, stack: MetricsStack) -> int:
    """The target busy fraction (thousandths) of these drills: the heavy load's mean busy fraction
    on R servers, times R / (R + 1.5): the algorithm's ceil(R x busy / target) then asks for about
    two more servers, within [R, MAX_SERVERS]. Measured once per module."""
    if "target" in _calibrated:
        return _calibrated["target"]
    wait_until(lambda: settled(system, MIN_SERVERS), 240, f"the pool at {MIN_SERVERS} servers")
    with Load(system.url, system.model, workers=HEAVY_WORKERS, limit=2000, max_seconds=120) as load:
        wait_until(lambda: load.completed_since(0) >= HEAVY_WORKERS, 120, "heavy load running")
        time.sleep(12)  # past the adapter's rate window
        readings = []
        for _ in range(8):
            metric = stack.pods_metric(system.namespace, METRIC)
            if len(metric) == MIN_SERVERS:
                readings.append(sum(metric.values()) / len(metric))
            time.sleep(1)
    system.check(load.outcomes)
    assert readings, "custom.metrics.k8s.io served no busy fraction for the expert servers under load"
    busy = sum(readings) / len(readings)
    target = max(1, round(1000 * busy * MIN_SERVERS / (MIN_SERVERS + 1.5)))
    print(f"\ncalibration: heavy load ({HEAVY_WORKERS} streams) keeps {MIN_SERVERS} servers {busy:.3f} busy; "
          f"target {target}m")  # fmt: skip
    _calibrated["target"] = target
    return target


@dataclass
class Ramp:
    steady: int  # servers while the heavy load held steady
    steady_busy: float | None  # mean busy fraction per server then
    timeline: Timeline


def ramp(system: System, stack: MetricsStack, name: str, results: Path, grow_timeout: float = 240) -> Ramp:
    """Light load, then heavy load until the pool has grown and held its size for 20 s, then none
    until it is back at R. Returns the steady size under heavy load and the timeline."""
    light = Load(system.url, system.model, workers=LIGHT_WORKERS, limit=3000, max_seconds=600)
    heavy = Load(system.url, system.model, workers=HEAVY_WORKERS, limit=3000, max_seconds=600)
    with ReplicaWatch(system) as watch, Timeline(system, stack, [light, heavy]) as timeline:
        with light:
            time.sleep(10)
            with heavy:
                peak_started = timeline.now()
                wait_until(
                    lambda: system.expert_pool()["spec"]["replicas"] > MIN_SERVERS,
                    grow_timeout,
                    f"{name}: the pool to grow under heavy load",
                )
                steady_since = {"t": timeline.now(), "n": 0}

                def held() -> bool:
                    n = system.expert_pool()["spec"]["replicas"]
                    if n != steady_since["n"] or not settled(system, n):
                        steady_since.update(t=timeline.now(), n=n)
                    return timeline.now() - steady_since["t"] >= 20

                try:
                    wait_until(held, grow_timeout, f"{name}: the pool steady under heavy load")
                except AssertionError as error:
                    raise AssertionError(f"{error}\n{timeline.table(2)}") from None
                steady = steady_since["n"]
                steady_busy = timeline.mean_metric(steady_since["t"] + 10)
            light.stop_new()
            peak_ended = timeline.now()
        try:
            wait_until(lambda: settled(system, MIN_SERVERS), 240, f"{name}: the pool back at {MIN_SERVERS}")
        except AssertionError as error:
            raise AssertionError(
                f"{error}\n{timeline.table(2)}\n{pod_logs(system.plane, system.namespace)}"
            ) from None
        shrunk = timeline.now()
    outcomes = light.outcomes + heavy.outcomes
    timeline.save(
        results / f"{name}.json",
        peak=[peak_started, peak_ended],
        back_at_min=shrunk,
        steady_replicas=steady,
        steady_busy=steady_busy,
        writers=sorted(timeline.replica_writers),
        commits=watch.commits,
    )
    failed = sum(1 for o in outcomes if o.error)
    print(f"\n{name}: {len(outcomes)} requests, {failed} failed; heavy load from "
          f"{peak_started:.0f} s to {peak_ended:.0f} s; steady at {steady} servers (busy {steady_busy}); "
          f"back at {MIN_SERVERS} at {shrunk:.0f} s; committed "
          + " -> ".join(f"v{v}{list(o)}" for v, o in watch.commits)
          + f"; writers of spec.replicas: {sorted(timeline.replica_writers)}\n{timeline.table()}\n"
          f"timeline saved in {results / f'{name}.json'}")  # fmt: skip
    system.check(outcomes)
    fewest = min(f for _, _, f in watch.fewest)
    assert fewest >= REPLICATION, [s for s in watch.fewest if s[2] < REPLICATION][:5]
    for (v1, before), (v2, now) in itertools.pairwise(watch.commits):
        assert len(set(before) ^ set(now)) <= 1, (
            f"v{v1} {before} -> v{v2} {now}: more than one server at once"
        )
    return Ramp(steady, steady_busy, timeline)


def test_hpa_scales_the_pool_on_expert_load(system: System, metrics: MetricsStack, results_dir: Path) -> None:
    """Drill A1 (external mode): heavy load raises the servers' busy fraction; the HPA, reading it
    through prometheus-adapter, raises ExpertPool.spec.replicas and the operator adds servers one
    at a time; the busy fraction per server falls below the target; without load the pool shrinks
    back to R after the stabilisation window, draining before deleting. The operator never writes
    spec.replicas."""
    target = calibration(system, metrics)
    scaled_before = len(events(system, "ScaledUp", "MoEService")) + len(
        events(system, "ScaledDown", "MoEService")
    )
    apply_hpa(system, hpa_manifest(MIN_SERVERS, target))
    try:
        wait_until(
            lambda: condition(hpa_status(system), "ScalingActive").get("status") == "True",
            90,
            "the HPA reading the metric (ScalingActive)",
        )
        result = ramp(system, metrics, "hpa", results_dir)
    finally:
        delete_hpa(system)
    assert result.steady > MIN_SERVERS
    assert result.steady_busy is not None and result.steady_busy * 1000 <= target * 1.1, (
        f"busy {result.steady_busy} per server at {result.steady} servers is not below the target {target}m"
    )
    writers = {w.split("/")[0] for w in result.timeline.replica_writers}
    assert "eaas-operator" not in writers, result.timeline.replica_writers
    scaled_after = len(events(system, "ScaledUp", "MoEService")) + len(
        events(system, "ScaledDown", "MoEService")
    )
    assert scaled_after == scaled_before, "the operator scaled the pool in external mode"
    _calibrated["hpa_steady"] = result.steady
