"""The CustomResourceDefinition of each kind, from its pydantic model (the models are the source of truth).

pydantic's JSON Schema is not a structural schema; this turns one into the other:
``$ref``/``$defs`` are inlined, ``anyOf [X, null]`` becomes ``X`` with ``nullable: true``,
``int | str`` becomes ``x-kubernetes-int-or-string``, titles and ``additionalProperties: false``
go, ``const`` becomes a one-value ``enum`` and every default is materialised (an object's default is
its complete dump: the API server checks defaults against the CEL rules before nested defaulting).
``crdgen`` writes these as YAML files, ``docgen`` as the reference docs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import core_schema

from eaas.operator.api.kinds import GROUP, VERSION, Kind

NAME_RULE = "^[a-z]([-a-z0-9]*[a-z0-9])?$"


class _WithFactoryDefaults(GenerateJsonSchema):
    """pydantic leaves ``default_factory`` defaults out of the schema; CRDs need them materialised."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return factory()  # type: ignore[call-arg]
        return super().get_default_value(schema)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `model` (camelCase properties, inline, no titles)."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_WithFactoryDefaults)
    definitions = raw.pop("$defs", {})
    return _convert(raw, definitions)


def _resolve(node: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` (and one-element ``allOf``); keys next to the reference win (field docs, defaults)."""
    node = dict(node)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    while "$ref" in node:
        target = definitions[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}
    return node


def _convert(node: Any, definitions: dict[str, Any]) -> Any:
    if not isinstance(node, dict):
        return node
    node = _resolve(node, definitions)
    if "anyOf" in node:
        options = [_resolve(option, definitions) for option in node.pop("anyOf")]
        non_null = [option for option in options if option.get("type") != "null"]
        if len(non_null) < len(options):
            node["nullable"] = True
        types = sorted(option.get("type", "") for option in non_null)
        if len(non_null) == 1:
            node = {**non_null[0], **node}
        elif types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        else:
            raise ValueError(f"cannot express anyOf {options} in a structural schema")
    for key in ("title", "examples"):
        node.pop(key, None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "properties" in node:
        node.pop("additionalProperties", None)
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            node[plain] = node[bound]
            node[bound] = True
    if "description" in node:
        node["description"] = _clean(node["description"])
    if "default" in node:
        default = node["default"]
        if default is None:
            del node["default"]
        else:
            # The API server validates a default as given (CEL rules included), before any
            # nested defaulting: object defaults must be complete, so they are the whole dump.
            node["default"] = _without_nulls(default)
    if "properties" in node:
        node["properties"] = {
            name: _convert(child, definitions) for name, child in node["properties"].items()
        }
    if "x-kubernetes-validations" in node:
        order = ("rule", "message", "messageExpression", "fieldPath", "reason")
        node["x-kubernetes-validations"] = [
            {key: entry[key] for key in order if key in entry} for entry in node["x-kubernetes-validations"]
        ]
    if isinstance(node.get("items"), dict):
        node["items"] = _convert(node["items"], definitions)
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _convert(node["additionalProperties"], definitions)
    return _ordered(node)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(child) for key, child in value.items() if child is not None}
    if isinstance(value, list):
        return [_without_nulls(child) for child in value]
    return value


_KEY_ORDER = ("description", "type", "format", "nullable", "x-kubernetes-int-or-string", "enum", "default")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Stable, readable key order: description and type first, then constraints, then children."""
    first = [key for key in _KEY_ORDER if key in node]
    children = [key for key in ("properties", "required", "items", "additionalProperties") if key in node]
    rest = sorted(key for key in node if key not in first and key not in children)
    return {key: node[key] for key in [*first, *rest, *children]}


def _clean(text: str) -> str:
    """Docstrings to descriptions: one paragraph per blank line, reST double backticks to single."""
    paragraphs = [" ".join(part.split()) for part in text.strip().split("\n\n")]
    return "\n".join(paragraphs).replace("``", "`")


def name_max_length(kind: Kind) -> int:
    """Longest object name whose generated children still have valid names: a pool's pods are
    ``<pool>-<n>``, and a MoEService's longest pool, its green attention pool of a blue/green
    rollout, is ``<name>-green-attention``, a pool's name of at most 56."""
    return 56 - len("-green-attention") if kind.kind == "MoEService" else 56


def name_rule(limit: int) -> dict[str, str]:
    """CEL on ``metadata.name``: children are named ``<name>-...``, so it must stay short and DNS-safe."""
    return {
        "rule": f"self.metadata.name.size() <= {limit} && self.metadata.name.matches('{NAME_RULE}')",
        "message": f"metadata.name must be a DNS label of at most {limit} characters starting with a letter "
        "(it prefixes the names of the pods and Services it creates)",
    }


def crd(kind: Kind) -> dict[str, Any]:
    """The CustomResourceDefinition of `kind`."""
    limit = name_max_length(kind)
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}, **({"scale": dict(kind.scale)} if kind.scale else {})},
        "additionalPrinterColumns": [dict(column) for column in kind.printer_columns],
        "schema": {
            "openAPIV3Schema": {
                "description": kind.description,
                "type": "object",
                "x-kubernetes-validations": [name_rule(limit)],
                "required": ["spec"],
                "properties": {
                    "apiVersion": {
                        "description": "APIVersion of this object (eaas.io/v1alpha1).",
                        "type": "string",
                    },
                    "kind": {"description": f"Kind of this object ({kind.kind}).", "type": "string"},
                    "metadata": {"type": "object"},
                    "spec": structural_schema(kind.spec),
                    "status": structural_schema(kind.status),
                },
            }
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name, "labels": {"app.kubernetes.io/part-of": "eaas"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": list(kind.categories),
            },
            "scope": "Namespaced",
            "versions": [version],
        },
    }
