# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""The controller-manager's garbage collector deletes dependents through ownerReferences."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.waiting import wait_until

pytestmark = pytest.mark.e2e


def _config_map(name: str, owner: client.V1ConfigMap | None = None) -> dict:
    metadata: dict = {"name": name}
    if owner is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name, "uid": owner.metadata.uid}
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"k": "v"}}


def _exists(read: object, *args: str) -> bool:
    try:
        read(*args)  # type: ignore[operator]
    except client.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def test_owner_deletion_collects_children_and_spares_others(cluster: Cluster, namespace: str) -> None:
    core = cluster.core
    parent = core.create_namespaced_config_map(namespace, _config_map("parent"))
    core.create_namespaced_config_map(namespace, _config_map("child-a", owner=parent))
    core.create_namespaced_config_map(namespace, _config_map("child-b", owner=parent))
    core.create_namespaced_config_map(namespace, _config_map("bystander"))
    read = core.read_namespaced_config_map

    core.delete_namespaced_config_map("parent", namespace, propagation_policy="Background")
    wait_until(
        lambda: not _exists(read, "child-a", namespace) and not _exists(read, "child-b", namespace),
        60,
        "the garbage collector to delete child-a and child-b",
    )
    assert _exists(read, "bystander", namespace)


def test_foreground_deletion_of_a_deployment_removes_replicasets_and_pods(
    cluster: Cluster, namespace: str
) -> None:
    labels = {"app": "gc"}
    cluster.apps.create_namespaced_deployment(
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "gc"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/eaas/gc:e2e"}]},
                },
            },
        },
    )
    wait_until(
        lambda: len(cluster.core.list_namespaced_pod(namespace, label_selector="app=gc").items) == 2,
        60,
        "2 Pods of Deployment gc",
    )
    assert len(cluster.apps.list_namespaced_replica_set(namespace).items) == 1

    cluster.apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Foreground")
    wait_until(
        lambda: (
            not cluster.apps.list_namespaced_replica_set(namespace).items
            and not cluster.core.list_namespaced_pod(namespace).items
            and not _exists(cluster.apps.read_namespaced_deployment, "gc", namespace)
        ),
        90,
        "the Deployment, its ReplicaSet and its Pods to be deleted",
    )
