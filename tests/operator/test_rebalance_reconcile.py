"""The ExpertPool reconcile wired to the rebalancer: only the resync timer scrapes; a rebalance is
published as pending.json with an Event and a metric. The API server is an in-memory stand-in
(the real one, with kwok pods that cannot answer /v1/stats, is in e2e/operator)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from inline_jobs import inline_jobs
from memory_kube import MemoryKube
from prometheus_client import CollectorRegistry
from test_rebalance import FakeServers, counts

from eaas.operator import naming
from eaas.operator.api import ExpertPoolSpec
from eaas.operator.builders import expertpool as build
from eaas.operator.collector import Probe, Rebalancer
from eaas.operator.kube import KubeError
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile import expertpool
from eaas.operator.reconcile.context import Context
from eaas.runtime.lease import LeaseSettings, lease_body
from eaas.runtime.placement import Placement, stored


@pytest.fixture
def pool(pool_body: dict[str, Any]) -> dict[str, Any]:
    """The tiny pool with room for extra replicas (3 servers x 20 slots for R·L·E = 48 pairs)."""
    pool_body["spec"]["expertSlotsPerServer"] = 20
    pool_body["spec"]["placement"] = {"policy": "cost_aware", "rebalanceIntervalSeconds": 60}
    return pool_body


def serving(kube: MemoryKube, body: dict[str, Any]) -> Placement:
    """A pool that serves placement v1 on three Ready pods (what a finished create leaves)."""
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()), post_event=lambda *a: None)
    expertpool.reconcile(context, body)  # publishes the initial placement, creates the pods
    spec = ExpertPoolSpec.from_k8s(body["spec"])
    for ordinal in range(3):
        pod = kube.objects[("Pod", naming.pod_name("tiny-experts", ordinal))]
        pod["status"] = {"podIP": f"10.0.0.{ordinal}", "conditions": [{"type": "Ready", "status": "True"}]}
    config_map = kube.objects[("ConfigMap", naming.placement_config_map_name("tiny-experts"))]
    _, pending = stored.read_config_map(config_map)
    assert pending is not None
    kube.apply(build.placement_config_map(body, pending, None))  # committed
    assert spec.replicas == 3 and pending.num_servers == 3
    return pending


def stats(placement: Placement, ordinal: int, load: np.ndarray) -> dict[str, Any]:
    shares = placement.replica_shares()[:, :, placement.server_index(ordinal)]  # [L, E]
    return {
        "instance": "a",
        "since_unix_s": 0.0,
        "layers": list(placement.layers),
        "num_experts": placement.num_experts,
        "tokens": np.rint(load * shares).astype(int).tolist(),
    }


def test_the_resync_timer_publishes_a_rebalance_for_a_hot_expert(pool: dict[str, Any]) -> None:
    kube = MemoryKube()
    committed = serving(kube, pool)
    fake = FakeServers()
    events: list[tuple[str, str, str]] = []
    metrics = OperatorMetrics(CollectorRegistry())
    context = Context(
        kube=kube,
        metrics=metrics,
        post_event=lambda obj, type_, reason, message: events.append((type_, reason, message)),
        rebalancer=Rebalancer(metrics, fetch=fake.fetch, clock=lambda: fake.now, jobs=inline_jobs()),
        server_urls=lambda pool_name, pods, port: {o: f"http://server-{o}:{port}" for o in range(3)},
    )
    for o in range(3):
        fake.answers[f"http://server-{o}:9100/v1/stats"] = stats(committed, o, np.zeros((3, 8)))

    expertpool.reconcile(context, pool)  # an event-triggered reconcile never scrapes
    assert counts(metrics, "eaas_operator_stats_scrapes") == {}
    expertpool.resync(context, pool)  # the first tick: baseline
    assert counts(metrics, "eaas_operator_rebalances") == {"baseline": 1.0}

    load = np.full((3, 8), 1e4)
    load[0, 5] = 2e6  # one hot expert in the first MoE layer
    for o in range(3):
        fake.answers[f"http://server-{o}:9100/v1/stats"] = stats(committed, o, load)
    fake.now += 61
    expertpool.resync(context, pool)

    config_map = kube.objects[("ConfigMap", naming.placement_config_map_name("tiny-experts"))]
    routed_by, pending = stored.read_config_map(config_map)
    assert routed_by == committed  # still routed by
    assert pending is not None
    assert pending.version == committed.version + 1
    assert len(pending.servers_of(0, 5)) == 3 and int(pending.replica_counts().min()) >= 2
    assert [(t, r) for t, r, _ in events] == [("Normal", "Rebalanced")]
    assert "expert loads" in events[0][2] and "gain" in events[0][2]
    assert counts(metrics, "eaas_operator_rebalances") == {"baseline": 1.0, "rebalanced": 1.0}
    progressing = [c for c in kube.status_patches[-1]["status"]["conditions"] if c["type"] == "Progressing"]
    assert progressing[0]["reason"] == "Rebalancing"


@pytest.mark.parametrize(("percent", "factor"), [(None, 1.3), (0, 0.0), (250, 2.5)])
def test_the_pools_failover_bound_reaches_the_rebalancer(
    pool: dict[str, Any], percent: int | None, factor: float
) -> None:
    """``spec.placement.failoverFactorPercent`` (default 130) is the failover factor the pool's
    rebalance plans with."""
    if percent is not None:
        pool["spec"]["placement"]["failoverFactorPercent"] = percent
    kube = MemoryKube()
    serving(kube, pool)
    told: list[float | None] = []

    class Spy(Rebalancer):
        def tick(self, *args: Any, **kwargs: Any) -> None:
            told.append(kwargs.get("failover_factor"))

    metrics = OperatorMetrics(CollectorRegistry())
    context = Context(
        kube=kube,
        metrics=metrics,
        post_event=lambda *a: None,
        rebalancer=Spy(metrics),
        server_urls=lambda pool_name, pods, port: {o: f"http://server-{o}:{port}" for o in range(3)},
    )
    expertpool.resync(context, pool)
    assert told == [pytest.approx(factor)]


def test_interval_zero_turns_rebalancing_off(pool: dict[str, Any]) -> None:
    pool["spec"]["placement"]["rebalanceIntervalSeconds"] = 0
    kube = MemoryKube()
    serving(kube, pool)
    fake = FakeServers()
    metrics = OperatorMetrics(CollectorRegistry())
    context = Context(
        kube=kube,
        metrics=metrics,
        post_event=lambda *a: None,
        rebalancer=Rebalancer(metrics, fetch=fake.fetch, clock=lambda: fake.now, jobs=inline_jobs()),
        server_urls=lambda pool_name, pods, port: {o: f"http://server-{o}:{port}" for o in range(3)},
    )
    for _ in range(3):
        expertpool.resync(context, pool)
        fake.now += 600
    assert counts(metrics, "eaas_operator_stats_scrapes") == {}
    assert counts(metrics, "eaas_operator_rebalances") == {}


def test_the_operator_asks_a_silent_servers_control_port_before_it_counts_it_lost() -> None:
    from eaas.operator import expert_step, planning
    from eaas.operator.reconcile.expertpool import second_opinion

    def pod(n: int) -> dict[str, Any]:
        return {"metadata": {"name": f"p-{n}"}, "status": {"podIP": f"10.0.0.{n + 1}", "conditions": []}}

    shape = planning.PoolShape((1, 2), 4, 2)
    committed = planning.initial(shape, dict.fromkeys(range(3)), {})
    states = {n: expert_step.PodState(n, ready=True, uid=f"u{n}") for n in range(3)}
    reports = {n: expert_step.ServerReport(n == 1, 1, owner_uid=f"u{n}") for n in range(3)}
    world = expert_step.Observed("p", 3, shape, "", states, committed, None, reports)
    asked: list[str] = []

    def answering(url: str) -> Probe:
        asked.append(url)
        return "answers"

    context = Context(kube=MemoryKube(), metrics=OperatorMetrics(CollectorRegistry()), probe=answering)  # type: ignore[arg-type]
    vouched = second_opinion(context, "p", [pod(0), pod(1), pod(2)], 9100, world)
    assert asked == ["http://10.0.0.2:9100"] and vouched.probes == {1: "answers"}  # only the suspect
    context.probe = lambda url: "silent"
    # An answer of the last second stands (a recheck judges at once); then the port is asked again.
    assert second_opinion(context, "p", [pod(0), pod(1), pod(2)], 9100, world).probes == {1: "answers"}
    later = replace(world, heartbeat_interval_s=0.0)  # nothing is recent enough
    assert second_opinion(context, "p", [pod(0), pod(1), pod(2)], 9100, later).probes == {1: "silent"}
    # A server its clients fail over is asked too, though its heartbeat is fine.
    asked.clear()
    context.probe = answering
    world = later
    reported = second_opinion(
        context, "p", [pod(0), pod(1), pod(2)], 9100, replace(world, reported=frozenset({2}))
    )
    assert sorted(asked) == ["http://10.0.0.2:9100", "http://10.0.0.3:9100"] and set(reported.probes) == {
        1,
        2,
    }


# --- a placement that cannot be stored ----------------------------------------------------------
class RefusingKube(MemoryKube):
    """Refuses, as the API server does a ConfigMap over 1 MiB, placement ConfigMaps whose pending
    placement keeps every committed server (a rebalance; a re-homing drops the lost one)."""

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "ConfigMap":
            committed, pending = stored.read_config_map(obj)
            if committed is not None and pending is not None and pending.ordinals == committed.ordinals:
                message = "ConfigMap is invalid: []: Too long: must have at most 1048576 bytes"
                raise KubeError(422, "Invalid", message, f"PATCH configmaps/{obj['metadata']['name']}")
        return super().apply(obj)


def test_a_rebalance_the_api_server_refuses_is_reported_and_never_blocks_rehoming(
    pool: dict[str, Any],
) -> None:
    pool["spec"]["expertSlotsPerServer"] = 24  # two servers can hold R=2 of the 24 pairs
    kube = RefusingKube()
    committed = serving(kube, pool)
    for ordinal in range(3):  # each server heartbeats (a server without a Lease is still loading)
        name = naming.pod_name("tiny-experts", ordinal)
        uid = kube.objects[("Pod", name)]["metadata"]["uid"]
        settings = LeaseSettings(name, "ns", "tiny-experts", 1.0, 600.0, pod_uid=uid)
        kube.apply(lease_body(settings, datetime.now(UTC), committed.version, 0))
    fake = FakeServers()
    events: list[tuple[str, str, str]] = []
    metrics = OperatorMetrics(CollectorRegistry())
    context = Context(
        kube=kube,
        metrics=metrics,
        post_event=lambda obj, type_, reason, message: events.append((type_, reason, message)),
        rebalancer=Rebalancer(metrics, fetch=fake.fetch, clock=lambda: fake.now, jobs=inline_jobs()),
        server_urls=lambda pool_name, pods, port: {o: f"http://server-{o}:{port}" for o in range(3)},
        probe=lambda url: "refused",
    )
    for o in range(3):
        fake.answers[f"http://server-{o}:9100/v1/stats"] = stats(committed, o, np.zeros((3, 8)))
    expertpool.resync(context, pool)  # baseline
    load = np.full((3, 8), 1e4)
    load[0, 5] = 2e6
    for o in range(3):
        fake.answers[f"http://server-{o}:9100/v1/stats"] = stats(committed, o, load)
    fake.now += 61
    kube.status_patches.clear()
    expertpool.resync(context, pool)  # proposes a rebalance; the API server refuses it

    config_map = kube.objects[("ConfigMap", naming.placement_config_map_name("tiny-experts"))]
    assert stored.read_config_map(config_map) == (committed, None)  # unchanged
    [(kind, reason, message)] = events
    assert (kind, reason) == ("Warning", "PlacementTooLarge")
    assert f"placement v{committed.version + 1} cannot be stored" in message
    assert "would hold" in message and "1048576 bytes" in message
    conditions = {c["type"]: c for c in kube.status_patches[-1]["status"]["conditions"]}  # status written
    assert (
        conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "PlacementTooLarge"
    )
    assert conditions["Progressing"]["reason"] == "PlacementTooLarge"
    assert conditions["Ready"]["status"] == "True"  # still serving the committed placement

    # Server 1 stops serving for longer than its heartbeat timeout: its experts are re-homed.
    pool["status"] = kube.status_patches[-1]["status"]
    pod = kube.objects[("Pod", naming.pod_name("tiny-experts", 1))]
    pod["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}
    ]
    fake.now += 61
    expertpool.resync(context, pool)
    _, pending = stored.read_config_map(
        kube.objects[("ConfigMap", naming.placement_config_map_name("tiny-experts"))]
    )
    assert pending is not None and pending.ordinals == (0, 2)
    assert int(pending.replica_counts().min()) >= committed.replication
    assert [r for _, r, _ in events[1:]] == ["ServerLost"]


def test_a_placement_past_the_limit_is_not_sent_and_the_rest_of_the_pass_runs(
    pool: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube = MemoryKube()
    committed = serving(kube, pool)
    events: list[tuple[str, str, str]] = []
    context = Context(
        kube=kube,
        metrics=OperatorMetrics(CollectorRegistry()),
        post_event=lambda obj, type_, reason, message: events.append((type_, reason, message)),
    )
    limit = len(stored.pack(committed)) + 10  # the committed placement fits, not with a pending one
    monkeypatch.setattr(stored, "CONFIG_MAP_LIMIT_BYTES", limit)
    pool["spec"]["replicas"] = 4  # scale up: pending = committed + server 3, and pod 3
    kube.status_patches.clear()
    expertpool.reconcile(context, pool)

    assert stored.read_config_map(
        kube.objects[("ConfigMap", naming.placement_config_map_name("tiny-experts"))]
    ) == (
        committed,
        None,
    )
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "PlacementTooLarge")]
    assert "cannot be stored: the placement ConfigMap would hold" in events[0][2]
    assert f"the API server stores at most {limit}" in events[0][2]
    assert ("Pod", naming.pod_name("tiny-experts", 3)) not in kube.objects  # it would find no experts
    assert kube.status_patches  # the status is still written
    conditions = {c["type"]: c for c in kube.status_patches[-1]["status"]["conditions"]}
    assert conditions["Degraded"]["reason"] == "PlacementTooLarge"
