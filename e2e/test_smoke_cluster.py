# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""The control plane is the pinned, real Kubernetes: version, components and RBAC."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e import binaries
from e2e.cluster import Cluster

pytestmark = pytest.mark.e2e


def test_server_and_kubectl_report_the_pinned_version(cluster: Cluster) -> None:
    if cluster.backend != "local":
        pytest.skip("only the local control plane runs the pinned version")
    expected = f"v{binaries.kubernetes_version()}"
    assert cluster.server_version() == expected
    versions = cluster.kubectl("version", "-o", "json").stdout
    assert f'"gitVersion": "{expected}"' in versions


def test_rbac_is_enforced_for_service_accounts(cluster: Cluster, namespace: str) -> None:
    """A ServiceAccount without bindings is denied; a Role + RoleBinding grant exactly what they say."""
    user = f"system:serviceaccount:{namespace}:default"
    base = ["auth", "can-i", "--as", user, "-n", namespace]
    assert cluster.kubectl(*base, "list", "configmaps", check=False).stdout.strip() == "no"
    cluster.rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="read-configmaps"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["get", "list"])],
        ),
    )
    cluster.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "read-configmaps"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-configmaps"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    assert cluster.kubectl(*base, "list", "configmaps").stdout.strip() == "yes"
    assert cluster.kubectl(*base, "delete", "configmaps", check=False).stdout.strip() == "no"
