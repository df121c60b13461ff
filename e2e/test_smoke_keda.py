# mypy: disable-error-code="union-attr"
"""manifests/expertpool-keda.yaml against KEDA's own ScaledObject CRD on the real API server.

KEDA itself is not built or run here (its operator compiles every scaler's SDK, far beyond the CI
budget; docs/scaling.md says so): the API server validates the manifest against the CRD's schema
(``kubectl apply --dry-run=server``). KEDA's admission webhook, which would also check the target's
/scale, and the scaling itself are not exercised; the same HPA path is, by the HPA drills.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e import binaries
from e2e.cluster import Cluster, CommandError

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "expertpool-keda.yaml"


@pytest.fixture(scope="module")
def scaledobject_crd(cluster: Cluster) -> Iterator[str]:
    path = binaries.bin_dir() / "keda-crds" / "keda.sh_scaledobjects.yaml"
    if not path.exists():
        pytest.fail(f"KEDA's ScaledObject CRD is missing ({path}): run `make k8s-bins`", pytrace=False)
    with cluster.custom_resource_definition(path.read_text(), "scaledobjects", "keda.sh") as name:
        yield name


def test_the_keda_manifest_is_a_valid_scaledobject(
    cluster: Cluster, namespace: str, scaledobject_crd: str
) -> None:
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(MANIFEST), "-n", namespace, "-o", "json")
    applied = json.loads(out.stdout)
    assert applied["kind"] == "ScaledObject"
    assert applied["spec"]["scaleTargetRef"]["kind"] == "ExpertPool"
    # The schema is really checked: the same object with a wrong type is refused, with the field named.
    (broken,) = yaml.safe_load_all(MANIFEST.read_text())
    broken["spec"]["minReplicaCount"] = "two"
    with pytest.raises(CommandError, match="minReplicaCount"):
        cluster.kubectl("apply", "--dry-run=server", "-f", "-", "-n", namespace, input=json.dumps(broken))
