# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""The API server validates built-in objects and rejects invalid ones with 422 Invalid."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.cluster import Cluster, CommandError

pytestmark = pytest.mark.e2e


def test_deployment_whose_selector_does_not_match_its_template_is_rejected(
    cluster: Cluster, namespace: str
) -> None:
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "mismatch"},
        "spec": {
            "selector": {"matchLabels": {"app": "a"}},
            "template": {
                "metadata": {"labels": {"app": "b"}},
                "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]},
            },
        },
    }
    with pytest.raises(client.ApiException) as rejected:
        cluster.apps.create_namespaced_deployment(namespace, body)
    assert rejected.value.status == 422
    assert "spec.template.metadata.labels" in rejected.value.body
    assert "does not match" in rejected.value.body
    assert cluster.apps.list_namespaced_deployment(namespace).items == []


def test_invalid_names_and_quantities_are_rejected(cluster: Cluster, namespace: str) -> None:
    with pytest.raises(client.ApiException) as bad_name:
        cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "Not_A_DNS_Name"}})
    assert bad_name.value.status == 422 and "metadata.name" in bad_name.value.body

    pod = """
apiVersion: v1
kind: Pod
metadata: {name: bad-quantity}
spec:
  containers:
    - name: c
      image: registry.invalid/x:1
      resources: {limits: {nvidia.com/gpu: "1.5"}}
"""
    # Extended resources must be whole numbers; kubectl surfaces the server's 422 message.
    with pytest.raises(CommandError, match=r"nvidia\.com/gpu"):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod)
    assert cluster.core.list_namespaced_pod(namespace).items == []
