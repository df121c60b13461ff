"""The API server itself rejects invalid eaas.io objects (schema + CEL), naming the field, and the
chart's RBAC is least-privilege. No operator runs here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from e2e.cluster import Cluster
from e2e.operator.conftest import Release
from e2e.operator.harness import ROOT

pytestmark = pytest.mark.e2e


def manifest(name: str, **changes: Any) -> str:
    """The tiny MoEService renamed, with dotted-path changes to its spec."""
    document = copy.deepcopy(yaml.safe_load((ROOT / "manifests" / "moeservice-tiny-cpu.yaml").read_text()))
    document["metadata"]["name"] = name
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = document["spec"]
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return yaml.safe_dump(document)


INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("topk", {"model.topK": 9}, "spec.model.topK: Invalid value", "topK must be <= numExperts"),
    (
        "replication",
        {"expertPool.replicationFactor": 4},
        "spec.expertPool.replicationFactor: Invalid value",
        "replicationFactor must be <= replicas",
    ),
    (
        "transport",
        {"transport": "rdma"},
        "spec.transport: Unsupported value",
        '"tcp", "shm", "cuda_ipc", "nixl"',
    ),
    ("ucxtls", {"ucx": {"transports": "tcp;rc"}}, "spec.ucx.transports: Invalid value", "should match"),
    (
        "ucxports",
        {"transport": "nixl", "ucx": {"tcpPortMin": 9000, "tcpPortMax": 9200}},
        "spec.ucx: Invalid value",
        "must not contain the pods' ports",
    ),
    (
        "minmax",
        {"autoscaling.minReplicas": 5, "autoscaling.maxReplicas": 4},
        "spec.autoscaling.minReplicas: Invalid value",
        "minReplicas must be <= maxReplicas",
    ),
    (
        "waittarget",
        {"autoscaling.metric": "expertWait"},
        "spec.autoscaling.targetExpertWaitMillis: Invalid value",
        "metric expertWait needs targetExpertWaitMillis",
    ),
    (
        "slo",
        {"autoscaling.sloTimePerOutputTokenMillis": 0},
        "spec.autoscaling.sloTimePerOutputTokenMillis: Invalid value",
        "should be greater than or equal to 1",
    ),
    (
        "apikeys",
        {"attentionPool.apiKeysSecret": {"name": "Not_A_Secret"}},
        "spec.attentionPool.apiKeysSecret.name: Invalid value",
        "should match",
    ),
    ("gpus", {"transport": "cuda_ipc"}, "spec.transport: Invalid value", "needs expertPool.gpusPerPod = 1"),
    (
        "nvshmem",  # planned, not offered: the API server refuses it
        {"transport": "nvshmem"},
        "spec.transport: Unsupported value",
        '"tcp", "shm", "cuda_ipc", "nixl"',
    ),
    (
        "failover",
        {"placement": {"failoverFactorPercent": 50}},
        "spec.placement.failoverFactorPercent: Invalid value",
        "failoverFactorPercent must be 0 (off) or at least 100",
    ),
    (
        "checkpoint",
        {"model.checkpoint": {"hostPath": {"path": "/m"}, "persistentVolumeClaim": {"claimName": "w"}}},
        "spec.model.checkpoint: Invalid value",
        "set exactly one of persistentVolumeClaim or hostPath",
    ),
    (
        "tolerate-all",
        {"expertPool.tolerations": [{"effect": "NoSchedule"}]},
        "spec.expertPool.tolerations[0].operator: Invalid value",
        "operator must be Exists when key is empty",
    ),
    (
        "toleration-seconds",
        {"attentionPool.tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 300}]},
        "spec.attentionPool.tolerations[0].tolerationSeconds: Invalid value",
        "tolerationSeconds needs effect NoExecute",
    ),
    (
        "toleration-value",
        {"expertPool.tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]},
        "spec.expertPool.tolerations[0].value: Invalid value",
        "value must be empty when operator is Exists",
    ),
    (
        "toleration-key",
        {"expertPool.tolerations": [{"key": "gpu node", "operator": "Exists"}]},
        "spec.expertPool.tolerations[0].key: Invalid value",
        "should match",
    ),
    (
        "node-selector-value",
        {"attentionPool.nodeSelector": {"pool": "cpu only"}},
        "spec.attentionPool.nodeSelector.pool: Invalid value",
        "should match",
    ),
    (
        "autoscaling-floor",
        {
            "expertPool.replicas": 4,
            "expertPool.expertSlotsPerServer": 12,
            "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 8},
        },
        "spec.autoscaling.minReplicas: Invalid value",
        "autoscaling.minReplicas * expertPool.expertSlotsPerServer must be >=",
    ),
]


def test_invalid_moeservices_are_rejected_with_the_field_named(
    cluster: Cluster, release: Release, namespace: str
) -> None:
    for name, changes, where, message in INVALID:
        result = cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=manifest(f"bad-{name}", **changes), check=False
        )
        assert result.returncode != 0, f"{name} was accepted"
        assert where in result.stderr and message in result.stderr, result.stderr
    # 40: the longest whose pools of a blue/green rollout (``<name>-green-attention``) are valid
    long_name = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("x" * 41), check=False)
    assert long_name.returncode != 0 and "metadata.name must be a DNS label of at most 40" in long_name.stderr
    assert cluster.kubectl("get", "moeservices", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_model_identity_is_immutable_and_defaults_are_materialised(
    cluster: Cluster, release: Release, namespace: str
) -> None:
    cluster.apply(manifest("keep"), namespace)
    stored = yaml.safe_load(cluster.kubectl("get", "moeservice/keep", "-n", namespace, "-o", "yaml").stdout)
    assert stored["spec"]["placement"] == {
        "policy": "cost_aware",
        "rebalanceIntervalSeconds": 300,
        "maxExpertMovesPerRebalance": 2048,
        "failoverFactorPercent": 130,
    }
    assert stored["spec"]["expertPool"]["port"] == 9100 and stored["spec"]["model"]["numDenseLayers"] == 0
    changed = cluster.kubectl(
        "patch",
        "moeservice/keep",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"model":{"numExperts":16}}}',
        check=False,
    )
    assert changed.returncode != 0
    assert "spec.model: Forbidden: model identity" in changed.stderr and "is immutable" in changed.stderr
    # Everything else may change, e.g. the image.
    cluster.kubectl(
        "patch",
        "moeservice/keep",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"expertPool":{"image":"eaas:2"}}}',
    )


def test_chart_rbac_is_least_privilege(cluster: Cluster, release: Release, namespace: str) -> None:
    subject = f"system:serviceaccount:{release.namespace}:{release.service_account}"

    def can(*args: str) -> bool:
        result = cluster.kubectl("auth", "can-i", *args, "-n", namespace, "--as", subject, check=False)
        return result.stdout.strip() == "yes"

    assert can("patch", "expertpools.eaas.io", "--subresource=scale")
    assert can("patch", "moeservices.eaas.io", "--subresource=status")
    assert can("create", "pods") and can("delete", "pods")
    assert not can("list", "secrets") and not can("get", "secrets") and not can("update", "secrets")
    assert can("create", "secrets")  # the data-token Secret, once per MoEService
    assert can("bind", "clusterroles/eaas-runtime")  # the runtime's role, to each MoEService's account
    assert not can("bind", "clusterroles/cluster-admin") and not can("escalate", "roles")
    assert can("create", "rolebindings") and not can("delete", "rolebindings")
    # the pods' Role that reads their placement ConfigMaps by name (and so what it grants: list, watch)
    assert can("create", "roles") and not can("update", "roles") and not can("delete", "roles")
    assert can("watch", "configmaps") and not can("delete", "configmaps") and not can("update", "configmaps")
    assert not can("delete", "moeservices.eaas.io")
    assert not can("update", "pods")
    assert not can("delete", "deployments.apps") and not can("delete", "services")
