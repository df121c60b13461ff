"""Fixtures of the operator's e2e tests: the chart installed once per module, and the operator
running as its ServiceAccount."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.cluster import Cluster
from e2e.operator.harness import CHART, OperatorProcess, operator_as


@dataclass(frozen=True)
class Release:
    """The eaas chart installed with replicaCount=0: CRDs, RBAC and the ServiceAccount only."""

    name: str
    namespace: str
    service_account: str


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[Release]:
    with cluster.namespace(prefix="eaas-system") as namespace:
        name = "eaas"
        cluster.helm(
            "install",
            name,
            str(CHART),
            "-n",
            namespace,
            "--set",
            "replicaCount=0",
            "--wait",
            "--timeout",
            "2m",
        )
        for crd in ("moeservices.eaas.io", "attentionpools.eaas.io", "expertpools.eaas.io"):
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
        try:
            yield Release(name=name, namespace=namespace, service_account=f"{name}-operator")
        finally:
            cluster.helm("uninstall", name, "-n", namespace, check=False)


@pytest.fixture
def operator(cluster: Cluster, release: Release, tmp_path: Path) -> Iterator[OperatorProcess]:
    """`eaas operator` as the chart's ServiceAccount; the test fails if the API server forbade anything."""
    with operator_as(cluster, release.namespace, release.service_account, tmp_path) as process:
        yield process
