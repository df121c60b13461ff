"""The MoEService's pass reads its pools from the bodies kopf's watch delivered (and its own
writes returned), not from the API server on every resync."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from eaas.operator.api.moeservice import MoEServiceSpec
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile.context import Context
from eaas.operator.reconcile.revisions import ensure_pair
from eaas.operator.store import Store
from tests.operator.memory_kube import MemoryKube


def body(name: str, version: str, replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": version},
        "spec": {"replicas": replicas},
    }


def test_the_newest_body_is_kept_and_a_deleted_one_forgotten() -> None:
    store = Store()
    store.saw("ExpertPool", body("p", "12", 3))
    store.saw("ExpertPool", body("p", "11", 2))  # an older event arriving late
    assert store.get("ExpertPool", "ns", "p") == body("p", "12", 3)
    store.saw("ExpertPool", body("p", "13", 4))
    copy = store.get("ExpertPool", "ns", "p")
    assert copy is not None and copy["spec"]["replicas"] == 4
    copy["spec"]["replicas"] = 99  # a reader's change stays its own
    assert store.get("ExpertPool", "ns", "p") == body("p", "13", 4)
    store.forget("ExpertPool", "ns", "p")
    assert store.get("ExpertPool", "ns", "p") is None


class ReadCountingKube(MemoryKube):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append((kind, name))
        return super().get(kind, namespace, name)


def test_the_pools_are_read_from_the_api_server_only_until_seen(moes_body: dict[str, Any]) -> None:
    kube = ReadCountingKube()
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()), post_event=lambda *a: None)  # type: ignore[arg-type]
    spec = MoEServiceSpec.from_k8s(moes_body["spec"])
    experts, attention = ensure_pair(context, moes_body, spec, "blue")  # created: the store has them
    assert len(kube.reads) == 2  # the first look: neither known
    for _ in range(3):  # resyncs
        again = ensure_pair(context, moes_body, spec, "blue")
    assert len(kube.reads) == 2
    assert again == (experts, attention)
    # A change someone else made arrives through the watch: the next pass sees it.
    changed = {**experts, "status": {"readyReplicas": 7}}
    changed["metadata"] = {**experts["metadata"], "resourceVersion": "99"}
    context.store.saw("ExpertPool", changed)
    assert ensure_pair(context, moes_body, spec, "blue")[0]["status"] == {"readyReplicas": 7}
    assert len(kube.reads) == 2
