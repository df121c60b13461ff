"""The CRD generator: structural schemas from the pydantic models, committed and in sync."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import Field

from eaas.operator import crdgen, crdschema
from eaas.operator.api import KINDS, MOESERVICE, CRDModel, Rule
from eaas.operator.api.kinds import EXPERTPOOL

ROOT = Path(__file__).resolve().parents[2]
CRD_DIRS = [ROOT / "crds", ROOT / "charts" / "eaas" / "crds"]


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path."""
    nodes = [(path, schema)]
    for name, child in (schema.get("properties") or {}).items():
        nodes += walk(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        nodes += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        nodes += walk(schema["additionalProperties"], f"{path}{{}}")
    return nodes


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to `value` (defaults of absent fields)."""
    if isinstance(value, dict) and "properties" in schema:
        value = dict(value)
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def spec_schema(kind: Any) -> dict[str, Any]:
    return crdschema.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize("directory", CRD_DIRS, ids=lambda d: str(d.relative_to(ROOT)))
def test_committed_crds_match_the_models(directory: Path) -> None:
    stale = crdgen.write([directory], check=True)
    assert not stale, f"CRDs out of date: {stale}; run `make crds`"


def test_committed_reference_docs_match_the_models() -> None:
    from eaas.operator import docgen

    committed = (ROOT / "docs" / "crd-reference.md").read_text()
    assert committed == docgen.render(), "docs/crd-reference.md is out of date; run `make crds`"


def test_check_mode_reports_drift_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "eaas.io_expertpools.yaml").write_text("# edited by hand\n")
    (tmp_path / "eaas.io_removedkinds.yaml").write_text("# a kind that no longer exists\n")
    command = [sys.executable, "-m", "eaas.operator.crdgen", "--out", str(tmp_path), "--check"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1
    assert "eaas.io_expertpools.yaml" in result.stdout and "eaas.io_removedkinds.yaml" in result.stdout
    assert (tmp_path / "eaas.io_expertpools.yaml").read_text() == "# edited by hand\n"
    written = crdgen.write([tmp_path])
    assert {path.name for path in written} == {crdgen.file_name(kind) for kind in KINDS} | {
        "eaas.io_removedkinds.yaml"
    }
    assert crdgen.write([tmp_path], check=True) == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schemas_are_structural(kind: Any) -> None:
    schema = crdschema.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        for forbidden in ("$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "const"):
            assert forbidden not in node, f"{kind.kind}{path} has {forbidden}"
        assert node.get("additionalProperties") is not False, f"{kind.kind}{path}"
        assert not ("properties" in node and "additionalProperties" in node), f"{kind.kind}{path}"
        if not node.get("x-kubernetes-int-or-string"):
            assert node.get("type") in {"object", "array", "string", "integer", "boolean", "number"}, path
        named = not path.endswith(("{}", "[]"))  # map values and list items of scalars need no docs
        if named and path.startswith((".spec", ".status")):
            assert node.get("description"), f"{kind.kind}{path} is undocumented"


def test_generator_translates_pydantic_idioms() -> None:
    class Inner(CRDModel):
        """Inner doc."""

        count: int = Field(default=1, gt=0)

    class Outer(CRDModel):
        """Outer doc."""

        maybe: Inner | None = None
        inner: Inner = Inner()
        quantity: int | str = 1
        fixed: Literal["only"] = "only"

    schema = crdschema.structural_schema(Outer)
    props = schema["properties"]
    assert props["maybe"]["nullable"] is True and props["maybe"]["type"] == "object"
    assert "default" not in props["maybe"]
    assert props["inner"]["default"] == {"count": 1}  # complete: CEL rules see defaults as given
    assert props["inner"]["properties"]["count"]["minimum"] == 0
    assert props["inner"]["properties"]["count"]["exclusiveMinimum"] is True
    assert props["quantity"]["x-kubernetes-int-or-string"] is True
    assert props["fixed"]["enum"] == ["only"]
    assert schema["description"] == "Outer doc."


def test_rules_appear_in_the_crd_and_non_transition_rules_have_python_twins() -> None:
    text = "\n".join(crdgen.rendered().values())
    documents = [yaml.safe_load(t) for t in crdgen.rendered().values()]
    emitted = {
        entry["rule"]
        for document in documents
        for _, node in walk(document["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for entry in node.get("x-kubernetes-validations", [])
    }
    models: list[type[CRDModel]] = []
    for kind in KINDS:
        models += [kind.spec, kind.status]
    seen: list[Rule] = []
    stack = list(models)
    while stack:
        model = stack.pop()
        seen += model.rules
        for field in model.model_fields.values():
            for candidate in (*getattr(field.annotation, "__args__", ()), field.annotation):
                if isinstance(candidate, type) and issubclass(candidate, CRDModel):
                    stack.append(candidate)
    assert seen
    for rule in seen:
        assert rule.cel in emitted, rule.cel
        assert rule.is_transition or rule.check is not None, f"no Python twin for {rule.cel}"
    assert "oldSelf" in text  # the model identity is immutable


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schema_defaults_equal_pydantic_defaults(kind: Any, moes_body: dict[str, Any]) -> None:
    """Defaulting a minimal object in the API server gives exactly what the models default to."""
    model = {
        "family": "mixtral",
        "numLayers": 3,
        "numExperts": 8,
        "topK": 2,
        "checkpoint": {"hostPath": {"path": "/m"}},
    }
    minimal = {
        "MoEService": {"model": model, "attentionPool": {"image": "i"}, "expertPool": {"image": "i"}},
        "AttentionPool": {"model": model, "image": "i", "expertPoolName": "e", "placementConfigMap": "c"},
        "ExpertPool": {"model": model, "image": "i"},
    }[kind.kind]
    defaulted = apply_defaults(spec_schema(kind), minimal)
    assert kind.spec.from_k8s(minimal).to_k8s() == defaulted


def test_crd_metadata() -> None:
    expert = crdschema.crd(EXPERTPOOL)["spec"]
    version = expert["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    selector = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["selector"]
    assert selector["type"] == "string"  # HPAs need a string selector
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Desired",
        "Replicas",
        "Placement",
        "R",
        "Age",
    ]
    moes = crdschema.crd(MOESERVICE)["spec"]
    assert moes["names"]["shortNames"] == ["moes"] and moes["scope"] == "Namespaced"
    for kind in KINDS:
        spec = crdschema.crd(kind)["spec"]
        names = [c["name"] for c in spec["versions"][0]["additionalPrinterColumns"]]
        assert names[0] == "Ready" and names[-1] == "Age"
        assert "status" in spec["versions"][0]["subresources"]
        assert "ep" not in spec["names"]["shortNames"]  # taken by Endpoints
