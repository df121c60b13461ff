"""The MoEService's pass makes sure of its pods' prerequisites on its first pass and then every
few minutes, not every resync: no create answered 409 AlreadyExists on every pass."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile.context import Context
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
    assert sorted(kube.creates) == ["RoleBinding", "Secret", "ServiceAccount"]
    for _ in range(10):  # resyncs: nothing asked of the API server
        now[0] += 10
        ensure_pod_prerequisites(context, moes_body)
    assert len(kube.creates) == 3
    del kube.objects[("Secret", f"{moes_body['metadata']['name']}-data-token")]  # someone deletes it
    now[0] = 1000.0 + PREREQUISITES_EVERY_S
    ensure_pod_prerequisites(context, moes_body)
    assert len(kube.creates) == 6
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
