"""Names, labels, annotations and environment variables: the contract between the operator, the
pods it creates and the runtime inside them.

Children are named after their owner so they are found without lookups:

=====================  ==========================================
MoEService ``m``       AttentionPool ``m-attention``, ExpertPool ``m-experts`` (slot ``blue``;
                       slot ``green``: ``m-green-attention``, ``m-green-experts``), the
                       API's Service ``m`` (selects the serving slot's attention pods)
ExpertPool ``p``       Pods ``p-0``, ``p-1``, ... (stable ordinals), headless Service ``p``,
                       placement ConfigMap ``p-placement``
AttentionPool ``a``    Deployment ``a``, Service ``a``
=====================  ==========================================

Expert servers and attention clients renew a ``coordination.k8s.io/v1`` Lease named after their
Pod; an expert server writes the newest placement version whose experts it has loaded into the
Lease annotation :data:`LOADED_VERSION_ANNOTATION` and its busy fraction into
:data:`UTILIZATION_ANNOTATION`, its routed tokens per second into :data:`TOKEN_RATE_ANNOTATION`;
an attention client names the servers it fails over in :data:`FAILED_OVER_ANNOTATION`.
"""

from __future__ import annotations

from typing import Literal

from eaas.runtime import contract
from eaas.runtime.contract import *  # noqa: F403  (the operator reads the shared names from here too)

FIELD_MANAGER = "eaas-operator"

# Set by a person on an expert-server pod (any value but "false"): drain that server and retire it.
RETIRE_ANNOTATION = f"{contract.GROUP}/retire"


# A MoEService's two slots for a pair of pools: a new model revision comes up in the slot that is
# not serving (blue/green), and the API's Service moves to it when it is Ready.
Slot = Literal["blue", "green"]
SLOTS: tuple[Slot, ...] = ("blue", "green")


def other_slot(slot: Slot) -> Slot:
    return "green" if slot == "blue" else "blue"


def _in_slot(service: str, slot: Slot) -> str:
    return service if slot == "blue" else f"{service}-green"


def attention_pool_name(service: str, slot: Slot = "blue") -> str:
    return f"{_in_slot(service, slot)}-attention"


def expert_pool_name(service: str, slot: Slot = "blue") -> str:
    return f"{_in_slot(service, slot)}-experts"


def api_service_name(service: str) -> str:
    """The MoEService's own Service: the API of whichever slot serves."""
    return service


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


def runtime_account_name(service: str) -> str:
    """The ServiceAccount of MoEService `service`'s pods (and its RoleBinding), made by the operator."""
    return f"{service}-runtime"


def runtime_placement_role_name(service: str) -> str:
    """The Role (and its RoleBinding) that lets MoEService `service`'s pods read its placement ConfigMaps."""
    return f"{service}-runtime-placement"


def data_token_secret_name(service: str) -> str:
    """The Secret holding MoEService `service`'s data token (created by the operator, never read)."""
    return f"{service}-data-token"


def placement_config_map_name(pool: str) -> str:
    return f"{pool}-placement"


def common_labels(service: str, component: str) -> dict[str, str]:
    """Labels on every child of MoEService `service`."""
    return {
        contract.NAME_LABEL: contract.APP,
        contract.INSTANCE_LABEL: service,
        contract.COMPONENT_LABEL: component,
        contract.PART_OF_LABEL: contract.APP,
        contract.MANAGED_BY_LABEL: contract.MANAGED_BY,
        contract.SERVICE_LABEL: service,
    }


def pool_selector(pool: str, component: str) -> dict[str, str]:
    """The labels that select a pool's pods (stable across template changes)."""
    return {contract.POOL_LABEL: pool, contract.COMPONENT_LABEL: component}


def selector_string(labels: dict[str, str]) -> str:
    """``k1=v1,k2=v2`` (sorted): the string form HPAs read from ``status.selector``."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
