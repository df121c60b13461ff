"""Conditions, status aggregation, the built-in autoscaler and the operator's metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
from memory_kube import MemoryKube
from prometheus_client import CollectorRegistry

from eaas.operator.api import AutoscalingSpec, Condition, MoEServiceSpec
from eaas.operator.autoscaler import Autoscaler, raw_recommendation, target, token_rate_recommendation
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY, Observation, merge
from eaas.operator.handlers import backoff
from eaas.operator.kube import KubeError
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile.context import Context
from eaas.operator.reconcile.moeservice import carrying, set_expert_replicas
from eaas.operator.status import aggregate, deployment_conditions


def test_merge_keeps_transition_time_unless_status_changes() -> None:
    first = merge(
        None, [Observation.of(READY, False, "Creating")], generation=1, timestamp="2026-01-01T00:00:00Z"
    )
    assert first[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and first[0]["observedGeneration"] == 1
    Condition.model_validate(first[0])  # the CRD's condition shape
    same = merge(first, [Observation.of(READY, False, "StillCreating", "x")], 2, "2026-01-02T00:00:00Z")
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert (same[0]["reason"], same[0]["observedGeneration"]) == ("StillCreating", 2)
    flipped = merge(same, [Observation.of(READY, True, "Serving")], 2, "2026-01-03T00:00:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-03T00:00:00Z"


def test_merge_keeps_foreign_conditions() -> None:
    foreign = {"type": "Tested", "status": "True", "reason": "X", "message": "", "lastTransitionTime": "t"}
    merged = merge([foreign], [Observation.of(READY, True, "Serving")], 1)
    assert [c["type"] for c in merged] == [READY, "Tested"]


def pool(ready: str, progressing: str = "False", degraded: str = "False") -> dict[str, Any]:
    conditions = [
        {"type": READY, "status": ready, "reason": "R", "message": "r"},
        {"type": PROGRESSING, "status": progressing, "reason": "P", "message": "p"},
        {"type": DEGRADED, "status": degraded, "reason": "D", "message": "d"},
    ]
    return {"status": {"conditions": conditions}}


def by_type(observations: list[Observation]) -> dict[str, tuple[str, str]]:
    return {o.type: (o.status, o.reason) for o in observations}


def test_moeservice_is_ready_when_both_pools_are() -> None:
    assert by_type(aggregate({"ExpertPool": pool("True"), "AttentionPool": pool("True")})) == {
        READY: ("True", "Serving"),
        PROGRESSING: ("False", "Stable"),
        DEGRADED: ("False", "Healthy"),
    }
    mixed = aggregate({"ExpertPool": pool("True", "True", "True"), "AttentionPool": pool("False")})
    assert by_type(mixed) == {
        READY: ("False", "PoolsNotReady"),
        PROGRESSING: ("True", "PoolsProgressing"),
        DEGRADED: ("True", "PoolsDegraded"),
    }
    assert "AttentionPool: R: r" in mixed[0].message
    assert by_type(aggregate({"ExpertPool": None, "AttentionPool": pool("True")}))[READY] == (
        "False",
        "Creating",
    )


def test_a_pool_that_has_not_acted_on_its_latest_spec_makes_the_moeservice_progressing() -> None:
    """Right after the MoEService changes a pool's spec, the pool's conditions still describe the
    spec before: a stale "Stable" must not reach the MoEService (``kubectl wait`` would return)."""
    stale = pool("True")
    stale["metadata"] = {"generation": 4}
    stale["status"]["observedGeneration"] = 3
    current = pool("True")
    current["metadata"] = {"generation": 2}
    current["status"]["observedGeneration"] = 2
    observations = aggregate({"ExpertPool": current, "AttentionPool": stale})
    assert by_type(observations) == {
        READY: ("True", "Serving"),  # it still serves, on the spec before
        PROGRESSING: ("True", "PoolsProgressing"),
        DEGRADED: ("False", "Healthy"),
    }
    assert "AttentionPool: SpecNotObserved: generation 4 not acted on yet (last 3)" in observations[1].message
    stale["status"]["observedGeneration"] = 4
    assert by_type(aggregate({"ExpertPool": current, "AttentionPool": stale}))[PROGRESSING] == (
        "False",
        "Stable",
    )


def test_attention_conditions_from_the_deployment() -> None:
    rolled = {"status": {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}}
    assert by_type(deployment_conditions(2, rolled, True))[READY] == ("True", "ClientsReady")
    assert by_type(deployment_conditions(2, rolled, True))[DEGRADED] == ("False", "AllClientsReady")
    short = {"status": {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}}
    assert by_type(deployment_conditions(2, short, True))[DEGRADED] == ("True", "ClientsUnavailable")
    rolling = {"status": {"replicas": 3, "updatedReplicas": 1, "readyReplicas": 2}}
    assert by_type(deployment_conditions(2, rolling, True))[PROGRESSING] == ("True", "RollingOut")
    assert by_type(deployment_conditions(2, None, False))[READY] == ("False", "Creating")


SCALING = AutoscalingSpec(
    mode="builtin",
    metric="busy",
    min_replicas=2,
    max_replicas=10,
    target_utilization_milli=500,
    scale_up_stabilization_seconds=0,
    scale_down_stabilization_seconds=60,
)


def test_recommendation_follows_the_hpa_formula() -> None:
    assert raw_recommendation(4, 1000, SCALING) == 8
    assert raw_recommendation(4, 520, SCALING) == 4  # within the 10% tolerance
    assert raw_recommendation(4, 100, SCALING) == 2  # clamped to min
    assert raw_recommendation(8, 1000, SCALING) == 10  # clamped to max


def test_autoscaler_scales_up_at_once_and_down_after_the_window() -> None:
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 4, 1000, SCALING) == 8
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 4, 100, SCALING) == 4  # no full window seen yet
    assert scaler.recommend(30.0, 4, 100, SCALING) == 4
    assert scaler.recommend(61.0, 4, 100, SCALING) == 2
    busy = Autoscaler()
    busy.recommend(0.0, 4, 500, SCALING)
    busy.recommend(30.0, 4, 1000, SCALING)
    assert busy.recommend(61.0, 4, 100, SCALING) == 4  # a busy recommendation inside the window holds it
    assert Autoscaler().recommend(0.0, 1, None, SCALING) == 2  # no load reports: just stay in bounds


def test_servers_still_starting_count_as_idle_and_block_a_scale_down() -> None:
    """As the HPA treats unready pods: a scale-up in progress is not compounded while its servers
    load their experts (the ready ones' load alone would ask again at every pass)."""
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 4, 1000, SCALING, ready=4) == 8
    # 4 servers ready at full load, 4 starting: 4000 / 8 = 500 per server = the target: hold
    assert scaler.recommend(1.0, 8, 1000, SCALING, ready=4) == 8
    assert scaler.recommend(2.0, 8, 1000, SCALING, ready=6) == 10  # 6000 / 8 > target: more is needed
    idle = Autoscaler()
    assert idle.recommend(0.0, 4, 100, SCALING, ready=3) == 4
    assert idle.recommend(61.0, 4, 100, SCALING, ready=3) == 4  # no scale-down while one starts
    assert idle.recommend(62.0, 4, 100, SCALING, ready=4) == 4  # ... and a full window after that
    assert idle.recommend(123.0, 4, 100, SCALING, ready=4) == 2


def test_reconcile_metrics_count_results() -> None:
    metrics = OperatorMetrics(CollectorRegistry())
    with metrics.reconcile("ExpertPool"):
        pass
    with pytest.raises(KubeError), metrics.reconcile("ExpertPool"):
        raise KubeError(409, "Conflict", "stale", "PATCH x")
    with pytest.raises(KubeError), metrics.reconcile("ExpertPool"):
        raise KubeError(403, "Forbidden", "no", "PATCH x")

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    assert value("eaas_operator_reconcile_total", kind="ExpertPool", result="success") == 1
    assert value("eaas_operator_reconcile_total", kind="ExpertPool", result="retry") == 1
    assert value("eaas_operator_reconcile_total", kind="ExpertPool", result="error") == 1
    assert value("eaas_operator_reconcile_duration_seconds_count", kind="ExpertPool") == 3


def test_backoff_is_exponential_and_capped() -> None:
    assert [backoff(n) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


class ScaleKube:
    """The calls :func:`set_expert_replicas` makes: list HPAs, patch /scale."""

    def __init__(self, autoscalers: list[dict[str, Any]] | KubeError) -> None:
        self.autoscalers = autoscalers
        self.scaled: list[int] = []

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        assert kind == "HorizontalPodAutoscaler"
        if isinstance(self.autoscalers, KubeError):
            raise self.autoscalers
        return self.autoscalers

    def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any], sub: str) -> None:
        assert (kind, sub) == ("ExpertPool", "scale")
        self.scaled.append(patch["spec"]["replicas"])


def _hpa(kind: str, name: str, api_version: str = "eaas.io/v1alpha1") -> dict[str, Any]:
    return {
        "metadata": {"name": f"hpa-{name}"},
        "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": name}},
    }


@pytest.mark.parametrize(
    ("autoscalers", "writes"),
    [
        ([], [5]),
        ([_hpa("Deployment", "tiny-experts"), _hpa("ExpertPool", "other-experts")], [5]),
        ([_hpa("ExpertPool", "tiny-experts", "example.com/v1")], [5]),  # another group's kind
        (KubeError(403, "Forbidden", "no grant", "list"), [5]),  # cannot tell: as before
        ([_hpa("ExpertPool", "tiny-experts")], []),  # the HPA's: left alone, said once
    ],
)
def test_the_operator_never_fights_an_hpa_over_replicas(
    autoscalers: list[dict[str, Any]] | KubeError, writes: list[int], moes_body: dict[str, Any]
) -> None:
    """Mode off (or builtin): the operator writes replicas, unless an HPA targets the pool."""
    manifest = moes_body
    manifest["spec"]["autoscaling"] = {"mode": "off"}
    manifest["spec"]["expertPool"]["replicas"] = 5
    spec = MoEServiceSpec.from_k8s(manifest["spec"])
    kube = ScaleKube(autoscalers)
    events: list[tuple[str, str, str]] = []
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    context.post_event = lambda obj, kind, reason, message: events.append((kind, reason, message))
    pool = {"metadata": {"namespace": "ns", "name": "tiny-experts"}, "spec": {"replicas": 3}}
    for _ in range(2):
        set_expert_replicas(context, manifest, spec, pool)
    assert kube.scaled == writes
    if writes:
        assert [reason for _, reason, _ in events] == ["ScaledUp"]
        return
    ((kind, reason, message),) = events  # once, not every pass
    assert (kind, reason) == ("Warning", "ConflictingAutoscaler")
    assert "hpa-tiny-experts" in message and "spec.autoscaling.mode: external" in message
    kube.autoscalers = []  # the HPA deleted: the operator scales again, and says so
    set_expert_replicas(context, manifest, spec, pool)
    assert kube.scaled == [5]
    assert [reason for _, reason, _ in events[1:]] == ["AutoscalerConflictResolved", "ScaledUp"]


WAIT = SCALING.model_copy(update={"metric": "expertWait", "target_expert_wait_millis": 50})


def test_expert_wait_scales_on_the_time_a_step_spends_on_the_pool() -> None:
    """Same formula, in the metric's units: microseconds of expert time per decoder step."""
    assert target(WAIT) == 50_000 and target(SCALING) == 500
    assert raw_recommendation(4, 100_000, WAIT) == 8  # 100 ms a step against 50: twice the servers
    assert raw_recommendation(4, 54_000, WAIT) == 4  # within the 10% tolerance
    assert raw_recommendation(4, 10_000, WAIT) == 2
    assert Autoscaler().recommend(0.0, 4, 100_000, WAIT, ready=4) == 8


def _builtin_pass(
    kube: ScaleKube, manifest: dict[str, Any], scaling: dict[str, Any], pool_status: dict[str, Any]
) -> list[tuple[str, str, str]]:
    """One ``set_expert_replicas`` pass of a builtin autoscaler (2-10 servers, at 4) with these
    metric settings, its ExpertPool's status as given; the Events it posted."""
    manifest["spec"]["expertPool"]["replicas"] = 4
    manifest["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": 2, "maxReplicas": 10, **scaling}
    spec = MoEServiceSpec.from_k8s(manifest["spec"])
    events: list[tuple[str, str, str]] = []
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    context.post_event = lambda obj, kind, reason, message: events.append((kind, reason, message))
    pool = {
        "metadata": {"namespace": "ns", "name": "tiny-experts"},
        "spec": {"replicas": 4},
        "status": pool_status,
    }
    set_expert_replicas(context, manifest, spec, pool)
    return events


TOKENS = SCALING.model_copy(update={"metric": "tokenRate", "target_tokens_per_second": 400})


def test_token_rate_scales_on_the_servers_routed_tokens() -> None:
    """On the ExpertPool's mean routed tokens per second per server: the load itself, so the
    servers needed are the pool's total over the target; up once a server carries more than it,
    down once the pool is sized below -3% of it (a settled pool is never more than 1 / 0.97 the
    servers needed)."""
    assert target(TOKENS) == 400
    assert token_rate_recommendation(4, 3200, 400, TOKENS) == 8  # 3200 tokens/s in all: 8 servers of 400
    assert token_rate_recommendation(4, 1600, 400, TOKENS) == 4  # 400 each: the target
    assert token_rate_recommendation(4, 1640, 400, TOKENS) == 5  # 410 each: above it
    assert token_rate_recommendation(5, 1800, 400, TOKENS) == 5  # 1800 / 388 = 4.6: 5 is not too many
    assert token_rate_recommendation(6, 1800, 400, TOKENS) == 5  # 6 is
    assert token_rate_recommendation(4, 600, 400, TOKENS) == 2  # 600 in all: 2 (the floor)
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 4, 800, TOKENS, ready=4) == 8
    assert scaler.per_server == 400


@pytest.mark.parametrize(
    ("status", "writes", "reads"),
    [
        # 900 tokens/s per server against 400 (busy reads idle, and is not what is read): 4 -> 9
        ({"readyReplicas": 4, "tokensPerSecond": 900, "utilizationMilli": 100}, [9], "900 tokens/s"),
        ({"readyReplicas": 4, "utilizationMilli": 900}, [], ""),  # no token rate reported: the size holds
    ],
)
def test_builtin_token_rate_reads_the_expert_pool_status(
    status: dict[str, Any], writes: list[int], reads: str, moes_body: dict[str, Any]
) -> None:
    kube = ScaleKube([])
    scaling = {"metric": "tokenRate", "targetTokensPerSecond": 400}
    events = _builtin_pass(kube, moes_body, scaling, status)
    assert kube.scaled == writes
    if writes:
        ((_, reason, message),) = events
        assert reason == "ScaledUp" and reads in message and "target 400" in message


def test_a_server_ready_before_the_placement_adding_it_is_committed_carries_no_load(
    moes_body: dict[str, Any],
) -> None:
    """The pool is growing 3 -> 4: the new server's pod is Ready, but clients still route by the
    committed placement of 3. The per-server reading is the 3's; the total load is 3 x it, not 4 x
    it (which would ask for a fifth server the load does not need)."""
    kube = ScaleKube([])
    scaling = {"metric": "tokenRate", "targetTokensPerSecond": 400}
    growing = {"readyReplicas": 4, "tokensPerSecond": 500, "servers": [0, 1, 2], "downServers": []}
    _builtin_pass(kube, moes_body, scaling, growing)
    assert kube.scaled == []  # 3 x 500 = 1500 tokens/s: the 4 being added suffice (4 x 500 asks for 5)
    assert carrying(growing) == 3
    assert carrying({"readyReplicas": 3, "servers": [0, 1, 2, 3], "downServers": [2]}) == 3
    assert carrying({"readyReplicas": 2}) == 2 and carrying({}) is None


def test_server_leases_with_garbled_load_readings_report_none() -> None:
    """A Lease's load annotations become the ExpertPool's status: a value the status schema
    refuses (negative, a busy fraction above 1000, not a number) is left out, not written."""
    from eaas.operator.reconcile.expertpool import server_reports

    def lease(ordinal: int, busy: str, tokens: str) -> dict[str, Any]:
        annotations = {"eaas.io/utilization-milli": busy, "eaas.io/tokens-per-second": tokens}
        return {
            "metadata": {"name": f"tiny-experts-{ordinal}", "annotations": annotations},
            "spec": {"renewTime": "2099-01-01T00:00:00.000000Z", "leaseDurationSeconds": 15},
        }

    leases = [lease(0, "640", "1200"), lease(1, "5000", "-3"), lease(2, "-1", "many")]
    reports = server_reports("tiny-experts", leases, 0.0)
    assert [(r.utilization_milli, r.tokens_per_second) for r in reports.values()] == [
        (640, 1200), (None, None), (None, None)
    ]  # fmt: skip


def _lease(name: str, wait: str | None, renewed: str = "2099-01-01T00:00:00.000000Z") -> dict[str, Any]:
    annotations = {} if wait is None else {"eaas.io/expert-wait-micros": wait}
    return {
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"renewTime": renewed, "leaseDurationSeconds": 15},
    }


class WaitKube(ScaleKube):
    """Also lists the attention clients' Leases."""

    def __init__(self, leases: list[dict[str, Any]] | KubeError) -> None:
        super().__init__([])
        self.leases = leases
        self.selectors: list[dict[str, str]] = []

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        if kind != "Lease":
            return super().list(kind, namespace, selector)
        self.selectors.append(selector)
        if isinstance(self.leases, KubeError):
            raise self.leases
        return self.leases


@pytest.mark.parametrize(
    ("leases", "writes", "reads"),
    [
        # two live clients at 90 and 110 ms a step against 50: 4 -> 8 servers
        ([_lease("a", "90000"), _lease("b", "110000")], [8], "expert wait 100.0 ms per step, target 50 ms"),
        # an expired Lease, one without the annotation and garbage are left out
        (
            [_lease("a", "80000"), _lease("old", "900000", "2020-01-01T00:00:00Z"), _lease("c", None),
             _lease("d", "fast"), _lease("e", "-5")],
            [7],
            "expert wait 80.0 ms per step",
        ),
        ([], [], ""),  # nothing reported: the size holds
        (KubeError(403, "Forbidden", "no grant", "list"), [], ""),
    ],
)  # fmt: skip
def test_builtin_expert_wait_reads_the_attention_clients_leases(
    leases: list[dict[str, Any]] | KubeError, writes: list[int], reads: str, moes_body: dict[str, Any]
) -> None:
    kube = WaitKube(leases)
    scaling = {"metric": "expertWait", "targetExpertWaitMillis": 50}
    idle = {"readyReplicas": 4, "utilizationMilli": 100}  # idle by busy: not what is read
    events = _builtin_pass(kube, moes_body, scaling, idle)
    assert kube.scaled == writes
    assert kube.selectors == [
        {"app.kubernetes.io/component": "attention-client", "eaas.io/moeservice": "tiny"}
    ]
    if writes:
        ((_, reason, message),) = events
        assert reason == "ScaledUp" and reads in message


def test_the_learned_token_rate_reads_the_worst_live_clients_time_per_token(
    moes_body: dict[str, Any],
) -> None:
    """``metric: tokenRate`` without a hand-set target: the operator lists the attention clients'
    Leases for their p99 time per output token (the highest live one counts) and, with nothing
    learned yet, holds the size."""
    from eaas.operator.reconcile.expertpool import clients_tpot

    def lease(name: str, tpot: str, renewed: str = "2099-01-01T00:00:00.000000Z") -> dict[str, Any]:
        return {
            "metadata": {"name": name, "annotations": {"eaas.io/tpot-p99-micros": tpot}},
            "spec": {"renewTime": renewed, "leaseDurationSeconds": 15},
        }

    leases = [lease("a", "40000"), lease("b", "70000"), lease("old", "900000", "2020-01-01T00:00:00Z")]
    now = 1795608000.0  # 2026-11-25T12:00:00Z
    assert clients_tpot([*leases, lease("c", "x"), lease("d", "-1")], now) == 70_000
    assert clients_tpot([], now) is None
    kube = WaitKube(leases)
    events = _builtin_pass(kube, moes_body, {}, {"readyReplicas": 4, "tokensPerSecond": 5000})
    assert kube.scaled == [] and events == []  # one reading, not settled: nothing learned yet
    assert kube.selectors == [
        {"app.kubernetes.io/component": "attention-client", "eaas.io/moeservice": "tiny"}
    ]


def test_a_lease_the_operator_could_not_see_renewed_is_unknown_not_expired() -> None:
    """After an API-server outage (or the operator's own start) every Lease looks as old as the
    outage; they come back to life one by one as servers renew. Until a full Lease duration has
    passed since the operator could read again, an old Lease is not held against its server."""
    from eaas.operator.reconcile.expertpool import lease_expired, pod_state

    lease = {"spec": {"renewTime": "2026-11-25T12:00:00.000000Z", "leaseDurationSeconds": 5}}
    renewed = 1795608000.0  # 2026-11-25T12:00:00Z
    assert lease_expired(lease, renewed + 6)  # seen all along: expired
    back = renewed + 30  # the API server answered again 30 s later
    assert not lease_expired(lease, back + 1, blind_until=back)
    assert not lease_expired(lease, back + 5, blind_until=back)
    assert lease_expired(lease, back + 5.1, blind_until=back)  # a full duration since: it is lost
    unready = {
        "metadata": {"name": "p-0", "uid": "u"},
        "status": {
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-25T12:00:00Z"}]
        },
    }
    assert pod_state(0, unready, back + 1).unready_seconds == 31
    assert pod_state(0, unready, back + 1, blind_until=back).unready_seconds == 1


def test_the_operator_is_blind_from_its_start_and_after_any_failure_that_is_not_the_objects() -> None:
    from eaas.operator.kube import Kube, KubeError

    kube = Kube.__new__(Kube)  # no API client needed for the bookkeeping
    kube.unreadable_at = 0.0
    kube._failed(KubeError(404, "NotFound", "", "GET x"))
    kube._failed(KubeError(409, "Conflict", "", "PATCH x"))
    assert kube.unreadable_at == 0.0  # about the objects: the operator sees fine
    for status in (0, 403, 429, 503):
        kube.unreadable_at = 0.0
        kube._failed(KubeError(status, "", "", "GET x"))
        assert kube.unreadable_at > 0.0, status


def test_a_lease_is_as_old_as_the_operator_last_saw_it_renewed_not_as_its_timestamp_says() -> None:
    """After an API-server restart its cache can answer with an older renewTime than it already
    gave, and a node's clock may differ from the operator's: neither makes a live server look
    dead. Age = time since the operator first saw the newest renewal."""
    from eaas.operator.reconcile.expertpool import server_reports
    from eaas.operator.renewals import RenewalClock

    def lease(renewed: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "tiny-experts-0", "annotations": {}},
            "spec": {"renewTime": renewed, "leaseDurationSeconds": 5},
        }

    clock = RenewalClock()
    skewed = lease("2020-01-01T00:00:00.000000Z")  # a node clock years behind
    assert clock.ages("ns", "tiny-experts", [skewed], 1000.0) == {"tiny-experts-0": 0.0}  # first seen
    ages = clock.ages("ns", "tiny-experts", [skewed], 1004.0)
    assert ages == {"tiny-experts-0": 4.0}
    assert not server_reports("tiny-experts", [skewed], 1004.0, 0.0, ages)[0].expired
    newer = lease("2020-01-01T00:00:02.000000Z")
    assert clock.ages("ns", "tiny-experts", [newer], 1004.5) == {"tiny-experts-0": 0.0}  # renewed
    stale = clock.ages("ns", "tiny-experts", [skewed], 1006.0)  # a lagging read: the older one again
    assert stale == {"tiny-experts-0": 1.5}
    late = clock.ages("ns", "tiny-experts", [newer], 1010.0)  # nothing new for 5.5 s: expired
    assert server_reports("tiny-experts", [newer], 1010.0, 0.0, late)[0].expired
    assert clock.ages("ns", "tiny-experts", [], 1011.0) == {}  # gone: forgotten


def _learned_pass(kube: ScaleKube, manifest: dict[str, Any], context: Context) -> list[int]:
    """One pass of a builtin tokenRate autoscaler with a learned target (SLO 100 ms; 2-10
    servers, at 4, each carrying 900 tokens/s, no p99 reported yet): the /scale writes."""
    manifest["spec"]["expertPool"]["replicas"] = 4
    manifest["spec"]["autoscaling"] = {
        "mode": "builtin",
        "minReplicas": 2,
        "maxReplicas": 10,
        "metric": "tokenRate",
    }
    spec = MoEServiceSpec.from_k8s(manifest["spec"])
    context.post_event = lambda *event: None  # type: ignore[method-assign]
    pool = {
        "metadata": {"namespace": "ns", "name": "tiny-experts"},
        "spec": {"replicas": 4},
        "status": {"readyReplicas": 4, "tokensPerSecond": 900},
    }
    before = len(kube.scaled)
    set_expert_replicas(context, manifest, spec, pool)
    return kube.scaled[before:]


def test_the_learned_capacity_outlives_an_operator_restart(moes_body: dict[str, Any]) -> None:
    """What the autoscaler learned goes to the MoEService's status; a new operator takes it back
    and scales on it at its first pass (without it: no target yet, the size holds). Readings at
    another SLO, or unreadable ones, are not taken."""
    from eaas.operator.api.moeservice import LearnedCapacity
    from eaas.operator.autoscaler import HEADROOM, Capacity
    from eaas.operator.reconcile.moeservice import learned_capacity

    kube = WaitKube([])
    first = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    assert _learned_pass(kube, moes_body, first) == []  # nothing learned: the size holds
    spec = MoEServiceSpec.from_k8s(moes_body["spec"])
    pool = {"metadata": {"namespace": "ns", "name": "tiny-experts"}}
    assert learned_capacity(first, moes_body, spec, pool) is None
    capacity = first.autoscalers[("ns", "tiny-experts")].capacity
    assert capacity is not None
    for rate, micros in [(300, 40_000), (305, 41_000), (450, 60_000), (600, 90_000), (700, 130_000)]:
        capacity.observe(rate, micros)
    capacity.observe(452.5, 61_001)  # medians that are not integers
    capacity.observe(103.0447, 20_000)  # a rate 0.04% above a 5% band's edge
    kept = learned_capacity(first, moes_body, spec, pool)
    assert kept is not None and LearnedCapacity.from_k8s(kept).tokens_per_second == pytest.approx(
        capacity.estimate()[0], rel=1e-3
    )
    again = Capacity(capacity.slo_micros)
    again.restore(
        [
            (b.tokens_per_second, b.time_per_output_token_micros, b.readings)
            for b in LearnedCapacity.from_k8s(kept).bands
        ]
    )
    assert sorted(again.readings) == sorted(capacity.readings)  # every reading back in its band
    capacity.observe(650, 110_000)
    moes_body["status"] = {"learnedCapacity": kept}
    assert learned_capacity(first, moes_body, spec, pool) == kept  # written at most every minute

    restarted = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    moes_body["status"] = {"learnedCapacity": kept}
    learned = LearnedCapacity.from_k8s(kept).tokens_per_second
    assert learned is not None
    want = math.ceil(4 * 900 / (HEADROOM * learned))
    assert _learned_pass(kube, moes_body, restarted) == [want]  # at once, on what was learned
    assert isinstance(restarted.autoscalers[("ns", "tiny-experts")].capacity, Capacity)

    for status in ({**kept, "sloTimePerOutputTokenMicros": 50_000}, {**kept, "bands": "garbled"}):
        fresh = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        moes_body["status"] = {"learnedCapacity": status}
        assert _learned_pass(kube, moes_body, fresh) == []  # not taken: learning afresh


def test_events_are_posted_to_the_api_before_the_reconcile_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """An Event is created through the API client at once (not queued: an operator stopped right
    after a placement change, as by a drain of its own node, must still have told of it), names
    its object, and a failure to post one is logged, never raised."""
    kube = MemoryKube()
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    pool = {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "ExpertPool",
        "metadata": {"name": "m-experts", "namespace": "models", "uid": "u-1"},
    }
    context.event(pool, "Normal", "ServerLeaving", "x" * 5000)
    context.event(pool, "Warning", "PlacementFailed", "no room")
    events = [obj for (kind, _), obj in kube.objects.items() if kind == "Event"]
    assert len(events) == 2  # two Events about one object get distinct names
    leaving = next(e for e in events if e["reason"] == "ServerLeaving")
    assert leaving["metadata"]["name"].startswith("m-experts.")
    assert leaving["metadata"]["namespace"] == "models"
    assert leaving["involvedObject"] == {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "ExpertPool",
        "name": "m-experts",
        "namespace": "models",
        "uid": "u-1",
    }
    assert leaving["type"] == "Normal" and len(leaving["message"]) <= 1024 and "..." in leaving["message"]
    assert leaving["firstTimestamp"] == leaving["lastTimestamp"] and leaving["count"] == 1

    def refuse(obj: dict[str, Any]) -> None:
        raise KubeError(503, "ServiceUnavailable", "etcd is down", "POST events")

    kube.create = refuse  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="eaas.operator"):
        context.event(pool, "Normal", "ScalingUp", "adding m-experts-3")
    assert "could not post Event ScalingUp" in caplog.text and "etcd is down" in caplog.text
