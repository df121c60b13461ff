"""The custom resources' event handlers reconcile on changes of the objects, not on their own
status patches: a pool reconciles on its resync, not back to back."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from memory_kube import MemoryKube
from prometheus_client import CollectorRegistry

from eaas.operator import handlers
from eaas.operator.api.kinds import EXPERTPOOL
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile import expertpool
from eaas.operator.reconcile.context import Context


@pytest.fixture
def kube() -> Iterator[MemoryKube]:
    kube = MemoryKube()
    handlers.install(
        Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()), post_event=lambda *a: None)
    )
    yield kube
    handlers._context = None


def counting(calls: list[str]) -> handlers.Reconcile:
    """The ExpertPool reconcile, counted."""

    def reconcile(ctx: Context, body: Mapping[str, Any]) -> None:
        calls.append(body["metadata"]["name"])
        expertpool.reconcile(ctx, body)

    return reconcile


def test_a_pools_own_status_patches_trigger_no_reconcile(kube: MemoryKube, pool_body: dict[str, Any]) -> None:
    calls: list[str] = []
    on_event = handlers.event_handler(EXPERTPOOL, counting(calls))
    pool_body["metadata"]["generation"] = 1
    kube.objects[("ExpertPool", pool_body["metadata"]["name"])] = copy.deepcopy(pool_body)

    on_event(body=copy.deepcopy(pool_body), type=None)  # listed at the operator's start
    assert calls == ["tiny-experts"]
    assert kube.status_patches  # the reconcile wrote the pool's status ...
    for _ in range(3):  # ... and the watch delivers that write (and the next pass's) as MODIFIED
        written = kube.objects[("ExpertPool", "tiny-experts")]
        written["metadata"]["resourceVersion"] = str(len(kube.status_patches))
        on_event(body=copy.deepcopy(written), type="MODIFIED")
        kube.merge_patch("ExpertPool", "ns", "tiny-experts", {"status": {"tokensPerSecond": 7}}, "status")
    assert calls == ["tiny-experts"]


@pytest.mark.parametrize(
    ("change", "due"),
    [
        ({"status": {"replicas": 5, "conditions": []}}, False),
        ({"metadata": {"resourceVersion": "99", "managedFields": [{"manager": "eaas-operator"}]}}, False),
        ({"metadata": {"generation": 2}, "spec": {"replicas": 4}}, True),  # spec edits and /scale writes
        ({"metadata": {"labels": {"eaas.io/moeservice": "other"}}}, True),
        ({"metadata": {"annotations": {"example.com/note": "x"}}}, True),
    ],
)
def test_which_changes_of_a_pool_reconcile_it(
    kube: MemoryKube, pool_body: dict[str, Any], change: dict[str, Any], due: bool
) -> None:
    calls: list[str] = []
    on_event = handlers.event_handler(EXPERTPOOL, lambda ctx, body: calls.append(body["metadata"]["name"]))
    pool_body["metadata"]["generation"] = 1
    on_event(body=copy.deepcopy(pool_body), type="ADDED")
    changed = copy.deepcopy(pool_body)
    for part, fields in change.items():
        changed.setdefault(part, {}).update(fields)
    on_event(body=changed, type="MODIFIED")
    assert len(calls) == (2 if due else 1)


def test_a_pool_deleted_and_created_again_is_reconciled_anew(
    kube: MemoryKube, pool_body: dict[str, Any]
) -> None:
    calls: list[str] = []
    on_event = handlers.event_handler(EXPERTPOOL, lambda ctx, body: calls.append(body["metadata"]["name"]))
    pool_body["metadata"]["generation"] = 1
    on_event(body=copy.deepcopy(pool_body), type="ADDED")
    on_event(body=copy.deepcopy(pool_body), type="DELETED")
    on_event(body=copy.deepcopy(pool_body), type="ADDED")
    assert calls == ["tiny-experts", "tiny-experts"]
