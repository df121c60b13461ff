"""The ``eaas.io/v1alpha1`` API: pydantic models, the single source of the CRD schemas."""

from eaas.operator.api.base import CRDModel, Rule
from eaas.operator.api.common import (
    TRANSPORTS,
    CheckpointSpec,
    Condition,
    HeartbeatSpec,
    ModelSpec,
    PlacementSpec,
    ResourceRequirements,
    Transport,
    UCXSpec,
)
from eaas.operator.api.kinds import (
    API_VERSION,
    ATTENTIONPOOL,
    EXPERTPOOL,
    GROUP,
    KINDS,
    MOESERVICE,
    VERSION,
    Kind,
)
from eaas.operator.api.moeservice import AutoscalingSpec, MoEServiceSpec, MoEServiceStatus
from eaas.operator.api.pools import (
    AttentionPoolSpec,
    AttentionPoolStatus,
    AttentionPoolTemplate,
    ExpertPoolSpec,
    ExpertPoolStatus,
    ExpertPoolTemplate,
)

__all__ = [
    "API_VERSION",
    "ATTENTIONPOOL",
    "EXPERTPOOL",
    "GROUP",
    "KINDS",
    "MOESERVICE",
    "TRANSPORTS",
    "VERSION",
    "AttentionPoolSpec",
    "AttentionPoolStatus",
    "AttentionPoolTemplate",
    "AutoscalingSpec",
    "CRDModel",
    "CheckpointSpec",
    "Condition",
    "ExpertPoolSpec",
    "ExpertPoolStatus",
    "ExpertPoolTemplate",
    "HeartbeatSpec",
    "Kind",
    "MoEServiceSpec",
    "MoEServiceStatus",
    "ModelSpec",
    "PlacementSpec",
    "ResourceRequirements",
    "Rule",
    "Transport",
    "UCXSpec",
]
