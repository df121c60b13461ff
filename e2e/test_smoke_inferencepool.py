# mypy: disable-error-code="union-attr"
"""manifests/inferencepool.yaml against the Gateway API Inference Extension's own InferencePool CRD
on the real API server, and against the labels and port the operator gives the AttentionPool's pods.

The endpoint picker and a Gateway are not built or run here: the API server validates the manifest
against the CRD's schema (``kubectl apply --dry-run=server``), and the pool's selector and target
port are checked against what the operator's builders put on the pods it selects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e import binaries
from e2e.cluster import Cluster, CommandError
from eaas.operator.api.moeservice import MoEServiceSpec
from eaas.operator.api.pools import AttentionPoolSpec
from eaas.operator.builders import attentionpool, moeservice

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "inferencepool.yaml"


@pytest.fixture(scope="module")
def inferencepool_crd(cluster: Cluster) -> Iterator[str]:
    path = binaries.bin_dir() / "inference-crds" / "inference.networking.k8s.io_inferencepools.yaml"
    if not path.exists():
        pytest.fail(f"the InferencePool CRD is missing ({path}): run `make k8s-bins`", pytrace=False)
    with cluster.custom_resource_definition(
        path.read_text(), "inferencepools", "inference.networking.k8s.io"
    ) as name:
        yield name


def test_the_inferencepool_manifest_is_valid_and_selects_the_attention_pods(
    cluster: Cluster, namespace: str, inferencepool_crd: str
) -> None:
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(MANIFEST), "-n", namespace, "-o", "json")
    applied = json.loads(out.stdout)
    assert applied["kind"] == "InferencePool" and applied["apiVersion"] == "inference.networking.k8s.io/v1"
    # It selects the pods the operator makes for MoEService `tiny`'s AttentionPool, on their port.
    (pool,) = yaml.safe_load_all(MANIFEST.read_text())
    manifest = yaml.safe_load((ROOT / "manifests" / "moeservice-tiny-cpu.yaml").read_text())
    service = {"metadata": {"name": "tiny", "namespace": namespace, "uid": "uid-1"}, "spec": manifest["spec"]}
    attention = moeservice.attention_pool(service, MoEServiceSpec.from_k8s(manifest["spec"]))
    attention["metadata"]["uid"] = "uid-2"
    deployment = attentionpool.deployment(attention, AttentionPoolSpec.from_k8s(attention["spec"]))
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports if p["name"] == "http"] == [
        pool["spec"]["targetPorts"][0]["number"]
    ]
    # The schema is really checked: a second target port is refused, with the field named.
    pool["spec"]["targetPorts"].append({"number": 8001})
    with pytest.raises(CommandError, match="targetPorts"):
        cluster.kubectl("apply", "--dry-run=server", "-f", "-", "-n", namespace, input=json.dumps(pool))
