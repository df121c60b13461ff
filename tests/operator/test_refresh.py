"""The MoEService's pass makes sure of its pods' prerequisites on its first pass and then every
few minutes, not every resync: no create answered 409 AlreadyExists on every pass."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile.context import APPLY_EVERY_S, Context
from eaas.operator.reconcile.moeservice import PREREQUISITES_EVERY_S, ensure_pod_prerequisites
from eaas.operator.refresh import Refresh
from tests.operator.memory_kube import MemoryKube


class CountingKube(MemoryKube):
    def __init__(self) -> None:
        super().__init__()
        self.creates: list[str] = []

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self.creates.append(obj["kind"])
        return super().create(obj)


def test_prerequisites_are_created_once_then_made_sure_of_every_few_minutes(
    moes_body: dict[str, Any],
) -> None:
    now = [1000.0]
    kube = CountingKube()
    context = Context(
        kube=kube,  # type: ignore[arg-type]
        metrics=OperatorMetrics(CollectorRegistry()),
        post_event=lambda *a: None,
        runtime_cluster_role="eaas-runtime",
        refresh=Refresh(clock=lambda: now[0]),
    )
    ensure_pod_prerequisites(context, moes_body)
    # The ServiceAccount, its RoleBinding to the runtime's ClusterRole, the Role that reads the
    # placement ConfigMaps and its RoleBinding, the data-token Secret.
    made = ["Role", "RoleBinding", "RoleBinding", "Secret", "ServiceAccount"]
    assert sorted(kube.creates) == made
    for _ in range(10):  # resyncs: nothing asked of the API server
        now[0] += 10
        ensure_pod_prerequisites(context, moes_body)
    assert len(kube.creates) == len(made)
    del kube.objects[("Secret", f"{moes_body['metadata']['name']}-data-token")]  # someone deletes it
    now[0] = 1000.0 + PREREQUISITES_EVERY_S
    ensure_pod_prerequisites(context, moes_body)
    assert len(kube.creates) == 2 * len(made)
    assert ("Secret", f"{moes_body['metadata']['name']}-data-token") in kube.objects  # back


def test_a_failed_pass_is_tried_again_on_the_next_one_and_a_deleted_moeservice_is_forgotten(
    moes_body: dict[str, Any],
) -> None:
    class FailingKube(CountingKube):
        fail = True

        def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
            if self.fail:
                self.fail = False
                raise RuntimeError("API server unreachable")
            return super().create(obj)

    kube = FailingKube()
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()), post_event=lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        ensure_pod_prerequisites(context, moes_body)
    ensure_pod_prerequisites(context, moes_body)
    assert sorted(kube.creates) == ["Secret", "ServiceAccount"]
    metadata = moes_body["metadata"]
    context.forget("MoEService", metadata["namespace"], metadata["name"])
    ensure_pod_prerequisites(context, moes_body)
    assert len(kube.creates) == 4


class ApplyingKube(MemoryKube):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(("apply", obj["metadata"]["name"]))
        return super().apply(obj)

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        self.requests.append(("delete", name))
        return super().delete(kind, namespace, name, uid)


def test_an_unchanged_child_is_applied_again_only_every_few_minutes() -> None:
    now = [0.0]
    kube = ApplyingKube()
    context = Context(
        kube=kube,  # type: ignore[arg-type]
        metrics=OperatorMetrics(CollectorRegistry()),
        refresh=Refresh(clock=lambda: now[0]),
    )
    service = {"kind": "Service", "metadata": {"name": "s", "namespace": "ns"}, "spec": {"ports": [1]}}
    assert context.apply_seldom(service)
    for _ in range(5):  # resyncs with nothing changed
        now[0] += 10
        assert not context.apply_seldom(service)
    changed = {**service, "spec": {"ports": [2]}}
    assert context.apply_seldom(changed)  # a change is applied at once
    now[0] += APPLY_EVERY_S
    assert context.apply_seldom(changed)  # drift (or a deleted child) is put right within the interval
    assert kube.requests == [("apply", "s")] * 3
    for _ in range(3):
        context.delete_seldom("Service", "ns", "s")
    assert kube.requests[3:] == [("delete", "s")]
    assert context.apply_seldom(changed)  # wanted again: applied at once


def test_the_api_service_owned_by_someone_else_is_still_refused(moes_body: dict[str, Any]) -> None:
    from eaas.operator.api.moeservice import MoEServiceSpec
    from eaas.operator.reconcile.revisions import NotOurs, point_api_service

    kube = ApplyingKube()
    name = moes_body["metadata"]["name"]
    kube.objects[("Service", name)] = {"kind": "Service", "metadata": {"name": name, "ownerReferences": []}}
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    spec = MoEServiceSpec.from_k8s(moes_body["spec"])
    for _ in range(2):
        with pytest.raises(NotOurs):
            point_api_service(context, moes_body, spec, "blue")
    assert kube.requests == []


class ReadingKube(ApplyingKube):
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.requests.append(("get", name))
        return super().get(kind, namespace, name)

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        self.requests.append(("list", kind))
        return super().list(kind, namespace, selector)


def test_an_empty_other_slot_is_looked_at_again_only_when_a_rollout_may_fill_it(
    moes_body: dict[str, Any],
) -> None:
    from eaas.operator.reconcile.revisions import retire

    kube = ReadingKube()
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    lease = {
        "kind": "Lease",
        "metadata": {"name": "tiny-green-experts-0", "labels": {"eaas.io/pool": "tiny-green-experts"}},
    }
    kube.objects[("Lease", "tiny-green-experts-0")] = lease  # a retired server still going
    assert retire(context, moes_body, "green", "r1") is None
    assert retire(context, moes_body, "green", "r1") is None  # told again: its Lease is still there
    assert kube.requests.count(("list", "Lease")) == 2
    del kube.objects[("Lease", "tiny-green-experts-0")]
    retire(context, moes_body, "green", "r1")  # now nothing is left of the pair
    asked = len(kube.requests)
    for _ in range(5):  # resyncs: the empty slot costs no request
        assert retire(context, moes_body, "green", "r1") is None
    assert len(kube.requests) == asked
    retire(context, moes_body, "green", "r2")  # another revision serves: looked at again
    assert len(kube.requests) == asked + 3
