# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""helm install / upgrade / uninstall of the tiny chart in e2e/charts/eaas-smoke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import Cluster

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parent / "charts" / "eaas-smoke"


def _gone(read: object, *args: str) -> bool:
    try:
        read(*args)  # type: ignore[operator]
    except client.ApiException as error:
        return error.status == 404
    return False


def test_helm_install_upgrade_and_uninstall(cluster: Cluster, namespace: str) -> None:
    if not cluster.gpu_nodes():
        assert cluster.backend != "local"
        pytest.skip(f"the {cluster.backend} cluster has no GPU node for the chart's Deployment")
    release = "smoke"
    cluster.helm(
        "install",
        release,
        str(CHART),
        "-n",
        namespace,
        "--set",
        "greeting=from-e2e",
        "--wait",
        "--timeout",
        "2m",
    )
    config = cluster.core.read_namespaced_config_map(f"{release}-config", namespace)
    assert config.data["greeting"] == "from-e2e"
    assert config.data["kubeVersion"] == cluster.server_version()  # helm read the real /version
    deployment = cluster.apps.read_namespaced_deployment(f"{release}-worker", namespace)
    assert deployment.status.ready_replicas == 1  # --wait returned only once the Pod was Ready

    cluster.helm(
        "upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set", "replicas=2", "--wait"
    )
    status = json.loads(cluster.helm("status", release, "-n", namespace, "-o", "json").stdout)
    assert (status["info"]["status"], status["version"]) == ("deployed", 2)
    assert cluster.apps.read_namespaced_deployment(f"{release}-worker", namespace).status.ready_replicas == 2

    cluster.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "2m")
    assert json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout) == []
    assert _gone(cluster.core.read_namespaced_config_map, f"{release}-config", namespace)
    assert _gone(cluster.apps.read_namespaced_deployment, f"{release}-worker", namespace)
