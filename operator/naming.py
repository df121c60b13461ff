"""Names, labels, annotations and environment variables: the contract between the operator, the
pods it creates and the runtime inside them.

Children are named after their owner so they are found without lookups:

=====================  ==========================================
MoEService ``m``       AttentionPool ``m-attention``, ExpertPool ``m-experts``
ExpertPool ``p``       Pods ``p-0``, ``p-1``, ... (stable ordinals), headless Service ``p``,
                       placement ConfigMap ``p-placement``
AttentionPool ``a``    Deployment ``a``, Service ``a``
=====================  ==========================================

Expert servers and attention clients renew a ``coordination.k8s.io/v1`` Lease named after their
Pod; an expert server writes the newest placement version whose experts it has loaded into the
Lease annotation :data:`LOADED_VERSION_ANNOTATION` and its busy fraction into
:data:`UTILIZATION_ANNOTATION`.
"""

from __future__ import annotations

from eaas.operator.api.kinds import GROUP

FIELD_MANAGER = "eaas-operator"

# Labels ------------------------------------------------------------------------------------------
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
SERVICE_LABEL = f"{GROUP}/moeservice"
POOL_LABEL = f"{GROUP}/pool"
ORDINAL_LABEL = f"{GROUP}/ordinal"

APP = "eaas"
MANAGED_BY = "eaas-operator"
EXPERT_COMPONENT = "expert-server"
ATTENTION_COMPONENT = "attention-client"

# Annotations -------------------------------------------------------------------------------------
TEMPLATE_HASH_ANNOTATION = f"{GROUP}/template-hash"
PLACEMENT_VERSION_ANNOTATION = f"{GROUP}/placement-version"
LOADED_VERSION_ANNOTATION = f"{GROUP}/loaded-placement-version"
UTILIZATION_ANNOTATION = f"{GROUP}/utilization-milli"

# Placement ConfigMap keys and mount ------------------------------------------------------------
PLACEMENT_KEY = "placement.json"  # the committed placement: what clients route by
PENDING_KEY = "pending.json"  # the next placement, being loaded by its servers (absent when none)
PLACEMENT_MOUNT = "/etc/eaas/placement"
CHECKPOINT_MOUNT = "/models"

# Environment of the pods (the runtime reads its settings from these) ---------------------------
ENV_POD_NAME = "EAAS_POD_NAME"
ENV_NAMESPACE = "EAAS_NAMESPACE"
ENV_POD_UID = "EAAS_POD_UID"  # owner of the pod's Lease, so it is deleted with the pod
ENV_SERVICE = "EAAS_MOESERVICE"
ENV_POOL = "EAAS_POOL"
ENV_ORDINAL = "EAAS_SERVER_ORDINAL"
ENV_TRANSPORT = "EAAS_TRANSPORT"
ENV_CHECKPOINT = "EAAS_CHECKPOINT"
ENV_PLACEMENT_FILE = "EAAS_PLACEMENT_FILE"
ENV_PENDING_FILE = "EAAS_PENDING_PLACEMENT_FILE"
ENV_PLACEMENT_CONFIGMAP = "EAAS_PLACEMENT_CONFIGMAP"
ENV_PORT = "EAAS_PORT"
ENV_DATA_PORT = "EAAS_DATA_PORT"
ENV_DEVICE = "EAAS_DEVICE"  # where an expert server computes: "cuda" on GPU pods, else "cpu"
ENV_KERNEL_BACKEND = "EAAS_KERNEL_BACKEND"  # "triton" on GPU pods, else "torch"
ENV_EXPERT_SERVICE = "EAAS_EXPERT_SERVICE"
ENV_EXPERT_PORT = "EAAS_EXPERT_PORT"
ENV_HEARTBEAT_INTERVAL = "EAAS_HEARTBEAT_INTERVAL_SECONDS"
ENV_HEARTBEAT_TIMEOUT = "EAAS_HEARTBEAT_TIMEOUT_SECONDS"

EXPERT_SERVER_COMMAND = ("eaas", "expert-server")
ATTENTION_CLIENT_COMMAND = ("eaas", "attention-client")


def attention_pool_name(service: str) -> str:
    return f"{service}-attention"


def expert_pool_name(service: str) -> str:
    return f"{service}-experts"


def pod_name(pool: str, ordinal: int) -> str:
    """Expert-server Pod of `ordinal` (also its hostname and its Lease's name)."""
    return f"{pool}-{ordinal}"


def ordinal_of(pool: str, name: str) -> int | None:
    """The ordinal in a Pod name ``<pool>-<n>``; None when the name is not of that form."""
    prefix = f"{pool}-"
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix) :]
    if not tail.isdigit() or (len(tail) > 1 and tail.startswith("0")):
        return None
    return int(tail)


def placement_config_map_name(pool: str) -> str:
    return f"{pool}-placement"


def common_labels(service: str, component: str) -> dict[str, str]:
    """Labels on every child of MoEService `service`."""
    return {
        NAME_LABEL: APP,
        INSTANCE_LABEL: service,
        COMPONENT_LABEL: component,
        PART_OF_LABEL: APP,
        MANAGED_BY_LABEL: MANAGED_BY,
        SERVICE_LABEL: service,
    }


def pool_selector(pool: str, component: str) -> dict[str, str]:
    """The labels that select a pool's pods (stable across template changes)."""
    return {POOL_LABEL: pool, COMPONENT_LABEL: component}


def selector_string(labels: dict[str, str]) -> str:
    """``k1=v1,k2=v2`` (sorted): the string form HPAs read from ``status.selector``."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
