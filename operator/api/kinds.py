"""The three kinds of ``eaas.io/v1alpha1``: names, models, printer columns and subresources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eaas.operator.api.base import CRDModel
from eaas.operator.api.moeservice import MoEServiceSpec, MoEServiceStatus
from eaas.operator.api.pools import AttentionPoolSpec, AttentionPoolStatus, ExpertPoolSpec, ExpertPoolStatus
from eaas.runtime.contract import GROUP

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "eaas"

_READY = '.status.conditions[?(@.type=="Ready")].status'


def _column(name: str, path: str, type_: str = "string", description: str = "", priority: int = 0) -> dict:
    column: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path}
    if description:
        column["description"] = description
    if priority:
        column["priority"] = priority
    return column


AGE = _column("Age", ".metadata.creationTimestamp", "date")


@dataclass(frozen=True)
class Kind:
    """One custom resource kind and everything its CRD says besides the schema."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    spec: type[CRDModel]
    status: type[CRDModel]
    description: str
    printer_columns: tuple[dict, ...]
    scale: dict[str, str] | None = None
    categories: tuple[str, ...] = field(default=(CATEGORY,))

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def api_version(self) -> str:
        return API_VERSION


MOESERVICE = Kind(
    kind="MoEService",
    plural="moeservices",
    singular="moeservice",
    short_names=("moes",),
    spec=MoEServiceSpec,
    status=MoEServiceStatus,
    description="A served Mixture-of-Experts model: one AttentionPool (the OpenAI-compatible front) "
    "and one ExpertPool (stateless expert servers, one per GPU).",
    printer_columns=(
        _column("Ready", _READY, description="Ready condition"),
        _column("Experts", ".status.experts.readyReplicas", "integer", "Ready expert servers"),
        _column("Attention", ".status.attention.readyReplicas", "integer", "Ready attention clients"),
        _column("Placement", ".status.placementVersion", "integer", "Published placement version"),
        _column("Transport", ".spec.transport", priority=1),
        _column("Model", ".spec.model.family", priority=1),
        _column("Revision", ".status.revision", description="Model revision serving", priority=1),
        AGE,
    ),
)

ATTENTIONPOOL = Kind(
    kind="AttentionPool",
    plural="attentionpools",
    singular="attentionpool",
    short_names=("attnpool",),
    spec=AttentionPoolSpec,
    status=AttentionPoolStatus,
    description="Attention clients of a MoEService: a Deployment and a Service with the placement mounted.",
    printer_columns=(
        _column("Ready", _READY, description="Ready condition"),
        _column("Desired", ".spec.replicas", "integer", "Desired attention clients"),
        _column("Replicas", ".status.readyReplicas", "integer", "Ready attention clients"),
        _column("Endpoint", ".status.endpoint", priority=1),
        AGE,
    ),
)

EXPERTPOOL = Kind(
    kind="ExpertPool",
    plural="expertpools",
    singular="expertpool",
    short_names=("expool",),
    spec=ExpertPoolSpec,
    status=ExpertPoolStatus,
    description="Expert servers of a MoEService: one Pod per GPU with a stable ordinal, a headless "
    "Service and the placement ConfigMap. Scales through the scale subresource.",
    printer_columns=(
        _column("Ready", _READY, description="Ready condition"),
        _column("Desired", ".spec.replicas", "integer", "Desired expert servers (GPUs)"),
        _column("Replicas", ".status.replicas", "integer", "Expert-server pods"),
        _column("Placement", ".status.placementVersion", "integer", "Published placement version"),
        _column("R", ".spec.replicationFactor", "integer", "Replicas of every expert", priority=1),
        AGE,
    ),
    scale={
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    },
)

KINDS: tuple[Kind, ...] = (MOESERVICE, ATTENTIONPOOL, EXPERTPOOL)
