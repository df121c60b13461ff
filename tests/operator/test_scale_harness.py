"""The scale harness's own arithmetic (e2e/scale.py): what an audit-log line says, what a window of
requests sums to, the extrapolation, and the MoEService it deploys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.scale import AuditLog, RequestSummary, parse_audit_line, scale_manifest, value_at
from eaas.operator.api.moeservice import MoEServiceSpec

USER = "system:serviceaccount:eaas-system:eaas-operator"


def audit_line(
    verb: str, uri: str, code: int, resource: str = "pods", stage: str = "ResponseComplete"
) -> str:
    return json.dumps(
        {
            "kind": "Event",
            "stage": stage,
            "verb": verb,
            "requestURI": uri,
            "user": {"username": USER},
            "objectRef": {"resource": resource, "namespace": "scale"},
            "responseStatus": {"code": code},
            "requestReceivedTimestamp": "2026-12-06T20:00:01.500000Z",
        }
    )


def test_an_audit_line_is_a_request_with_its_answer() -> None:
    request = parse_audit_line(audit_line("list", "/api/v1/namespaces/scale/pods?labelSelector=a%3Db", 200))
    assert request is not None
    assert (request.user, request.verb, request.resource, request.code) == (USER, "list", "pods", 200)
    assert request.at == pytest.approx(1796587201.5)
    assert not request.unfiltered_list
    assert parse_audit_line(audit_line("get", "/x", 200, stage="ResponseStarted")) is None
    assert parse_audit_line("not json") is None


def test_a_window_counts_conflicts_throttling_and_lists_without_a_selector() -> None:
    lines = [
        audit_line("list", "/apis/autoscaling/v2/namespaces/scale/horizontalpodautoscalers", 200, "hpa"),
        audit_line("list", "/api/v1/namespaces/scale/pods?labelSelector=a%3Db", 200),
        audit_line("create", "/api/v1/namespaces/scale/secrets", 409, "secrets"),
        audit_line("patch", "/api/v1/namespaces/scale/pods/x", 429),
        audit_line("watch", "/api/v1/pods?watch=true", 200),
        audit_line("get", "/api/v1/namespaces/scale/pods/y", 404),
    ]
    requests = [r for line in lines if (r := parse_audit_line(line)) is not None]
    summary = RequestSummary.of(requests, seconds=10.0)
    assert (summary.requests, summary.watches) == (5, 1)
    assert summary.per_second == pytest.approx(0.5)
    assert (summary.conflicts, summary.throttled, summary.unfiltered_lists, summary.errors) == (1, 1, 1, 0)
    assert summary.by_kind["create secrets"] == 1


def test_the_audit_log_is_read_as_it_grows_and_a_partial_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    first = audit_line("get", "/api/v1/namespaces/scale/pods/a", 200)
    second = audit_line("get", "/api/v1/namespaces/scale/pods/b", 200)
    path.write_text(first + "\n" + second[:20])
    log = AuditLog(path)
    assert [r.uri for r in log.read()] == ["/api/v1/namespaces/scale/pods/a"]
    path.write_text(first + "\n" + second + "\n")
    assert [r.uri for r in log.read()] == [
        "/api/v1/namespaces/scale/pods/a",
        "/api/v1/namespaces/scale/pods/b",
    ]


def test_the_figure_at_100_is_the_least_squares_line_through_the_sizes() -> None:
    assert value_at([(1, 3.0), (2, 5.0), (4, 9.0)], 100) == pytest.approx(201.0)
    assert value_at([(2, 7.0)], 100) == 7.0  # one size: no growth to extrapolate


def test_the_scale_manifest_is_a_valid_moeservice_with_room_for_its_replicas() -> None:
    manifest = scale_manifest("moe-000", 64)
    spec = MoEServiceSpec.from_k8s(manifest["spec"])
    assert spec.expert_pool.replicas == 64 and spec.expert_pool.replication_factor == 2
    slots = 58 * 256 * 2
    assert slots <= 64 * spec.expert_pool.expert_slots_per_server
    kimi = MoEServiceSpec.from_k8s(
        scale_manifest("kimi", 320, 3, 61, 1, 384, 8, "deepseek_v3", "kimi-k2")["spec"]
    )
    assert 320 * kimi.expert_pool.expert_slots_per_server >= 60 * 384 * 3
