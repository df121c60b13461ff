# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""Pods requesting nvidia.com/gpu are scheduled to the fake GPU nodes and become Running (kwok)."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.cluster import GPU_RESOURCE, Cluster, pod_is_running
from e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

IMAGE = "registry.invalid/eaas/expert:e2e"  # never pulled: kwok fakes the kubelet


def _gpu_nodes_or_skip(cluster: Cluster) -> list[str]:
    nodes = cluster.gpu_nodes()
    if not nodes:
        assert cluster.backend != "local", "the local control plane must have Ready fake GPU nodes"
        pytest.skip(f"the {cluster.backend} cluster has no Ready node with {GPU_RESOURCE}")
    return nodes


def _deployment(name: str, replicas: int, gpus: int) -> dict:
    labels = {"app": name}
    container = {"name": "expert", "image": IMAGE, "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def test_deployment_pods_reach_running_on_fake_gpu_nodes(cluster: Cluster, namespace: str) -> None:
    gpu_nodes = _gpu_nodes_or_skip(cluster)
    cluster.apps.create_namespaced_deployment(namespace, _deployment("experts", replicas=3, gpus=2))

    wait_until(
        lambda: cluster.apps.read_namespaced_deployment("experts", namespace).status.ready_replicas == 3,
        120,
        "3 ready replicas of Deployment experts",
    )
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=experts").items
    assert len(pods) == 3
    for pod in pods:
        assert pod_is_running(pod), pod.status
        assert pod.spec.node_name in gpu_nodes
        assert pod.status.pod_ip, "kwok assigns a Pod IP"
        assert pod.spec.containers[0].resources.limits[GPU_RESOURCE] == "2"
    # The Deployment → ReplicaSet → Pod chain was built by the controller-manager.
    owner = pods[0].metadata.owner_references[0]
    assert owner.kind == "ReplicaSet" and owner.controller


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(cluster: Cluster, namespace: str) -> None:
    _gpu_nodes_or_skip(cluster)
    too_many = 1 + max(
        int(node.status.allocatable.get(GPU_RESOURCE, "0")) for node in cluster.core.list_node().items
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "greedy"},
        "spec": {
            "containers": [
                {"name": "expert", "image": IMAGE, "resources": {"limits": {GPU_RESOURCE: str(too_many)}}}
            ]
        },
    }
    cluster.core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> client.V1PodCondition | None:
        read = cluster.core.read_namespaced_pod("greedy", namespace)
        for condition in read.status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return condition
        return None

    condition = wait_until(unschedulable, 60, "the scheduler to mark Pod greedy Unschedulable")
    assert f"Insufficient {GPU_RESOURCE}" in condition.message
    read = cluster.core.read_namespaced_pod("greedy", namespace)
    assert read.status.phase == "Pending" and not read.spec.node_name
