# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
# (the kubernetes client types every model field as Optional; a None here is a test failure anyway.)
"""The pods the operator makes meet the `restricted` Pod Security Standard, proven by the API
server's own PodSecurity admission: the namespace enforces `restricted`, and a MoEService (tcp,
checkpoint on a PersistentVolumeClaim) still becomes Ready with every pod admitted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.operator.harness import OperatorProcess
from e2e.operator.test_operator_lifecycle import (
    ATTENTION,
    apply_tiny,
    expert_pods,
    tiny_gpu_manifest,
    wait_ready,
)
from e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@pytest.fixture
def weights(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A PersistentVolumeClaim bound to a PersistentVolume made for it (the checkpoint's volume)."""
    volume = f"{namespace}-weights"
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": "/var/lib/eaas/tiny-mixtral"},  # the PV's source, not the pod's
                "claimRef": {"namespace": namespace, "name": "weights"},
            },
        }
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": "weights"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    try:
        yield "weights"
    finally:
        cluster.core.delete_persistent_volume(volume)


def test_every_pod_is_admitted_under_restricted(
    cluster: Cluster, namespace: str, weights: str, operator: OperatorProcess
) -> None:
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED}})

    # Enforcement is on: a pod with a hostPath volume and no security context is refused.
    bare = {
        "metadata": {"name": "bare"},
        "spec": {
            "containers": [{"name": "c", "image": "registry.invalid/x:1"}],
            "volumes": [{"name": "h", "hostPath": {"path": "/var/lib"}}],
        },
    }

    # The admission plugin reads namespaces from its informer's cache, which takes the new labels
    # a moment after the patch: wait for a dry run to be refused, then create it for real.
    def refused_dry_run() -> str | None:
        try:
            cluster.core.create_namespaced_pod(namespace, bare, dry_run="All")
        except client.ApiException as error:
            return error.body if error.status == 403 else None
        return None

    assert "violates PodSecurity" in wait_until(refused_dry_run, 30, "PodSecurity enforced in the namespace")
    with pytest.raises(client.ApiException) as refused:
        cluster.core.create_namespaced_pod(namespace, bare)
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body

    manifest = tiny_gpu_manifest()
    manifest["spec"]["model"]["checkpoint"] = {"persistentVolumeClaim": {"claimName": weights}}
    apply_tiny(cluster, namespace, manifest)
    wait_ready(cluster, namespace, servers=3)  # the attention Deployment's pod included

    pods = list(expert_pods(cluster, namespace).values())
    pods += cluster.core.list_namespaced_pod(namespace, label_selector=f"eaas.io/pool={ATTENTION}").items
    assert len(pods) == 4
    for pod in pods:
        security = pod.spec.security_context
        assert security.run_as_non_root and security.seccomp_profile.type == "RuntimeDefault"
        (container,) = pod.spec.containers
        assert container.security_context.read_only_root_filesystem
        assert container.security_context.capabilities.drop == ["ALL"]
    failed = [
        e.message
        for e in cluster.core.list_namespaced_event(namespace).items
        if e.reason in ("FailedCreate", "FailedScheduling")
    ]
    assert not failed, failed
