"""MoEService → its AttentionPool and ExpertPool.

The MoEService copies model, transport (with its UCX settings), heartbeat and placement into both
pools. It is the only
writer of the pools' specs, except ``ExpertPool.spec.replicas``, which has exactly one writer
chosen by ``spec.autoscaling.mode`` (:func:`replicas_writer`) and is changed through ``/scale``.
"""

from __future__ import annotations

from typing import Any, Literal

from eaas.operator import naming
from eaas.operator.api.kinds import ATTENTIONPOOL, EXPERTPOOL
from eaas.operator.api.moeservice import MoEServiceSpec
from eaas.operator.api.pools import AttentionPoolSpec, ExpertPoolSpec
from eaas.operator.builders.common import Body, owned

ReplicasWriter = Literal["moeservice", "autoscaler", "external"]


def replicas_writer(spec: MoEServiceSpec) -> ReplicasWriter:
    """Who owns ``ExpertPool.spec.replicas`` after creation: the MoEService (mode ``off``), the
    operator's autoscaler (``builtin``) or whoever uses ``/scale`` (``external``: HPA, KEDA, kubectl)."""
    return {"off": "moeservice", "builtin": "autoscaler", "external": "external"}[spec.autoscaling.mode]  # type: ignore[return-value]


def _metadata(service: Body, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": service["metadata"]["namespace"],
        "labels": naming.common_labels(service["metadata"]["name"], component),
    }


def expert_pool_spec(spec: MoEServiceSpec) -> ExpertPoolSpec:
    """The ExpertPool's spec; ``replicas`` is only the initial value (see :func:`replicas_writer`)."""
    return ExpertPoolSpec(
        **spec.expert_pool.model_dump(),
        model=spec.model,
        transport=spec.transport,
        ucx=spec.ucx,
        heartbeat=spec.heartbeat,
        placement=spec.placement,
    )


def attention_pool_spec(service: Body, spec: MoEServiceSpec, slot: naming.Slot = "blue") -> AttentionPoolSpec:
    experts = naming.expert_pool_name(service["metadata"]["name"], slot)
    return AttentionPoolSpec(
        **spec.attention_pool.model_dump(),
        model=spec.model,
        transport=spec.transport,
        ucx=spec.ucx,
        heartbeat=spec.heartbeat,
        expert_pool_name=experts,
        expert_pool_port=spec.expert_pool.port,
        placement_config_map=naming.placement_config_map_name(experts),
    )


def expert_pool(service: Body, spec: MoEServiceSpec, slot: naming.Slot = "blue") -> dict[str, Any]:
    """The ExpertPool object of `slot` (as created; later only its spec without replicas is reconciled)."""
    name = naming.expert_pool_name(service["metadata"]["name"], slot)
    body = {
        "apiVersion": EXPERTPOOL.api_version,
        "kind": EXPERTPOOL.kind,
        "metadata": _metadata(service, name, naming.EXPERT_COMPONENT),
        "spec": expert_pool_spec(spec).to_k8s(),
    }
    return owned(body, service)


def attention_pool(service: Body, spec: MoEServiceSpec, slot: naming.Slot = "blue") -> dict[str, Any]:
    """The AttentionPool object of `slot`."""
    name = naming.attention_pool_name(service["metadata"]["name"], slot)
    body = {
        "apiVersion": ATTENTIONPOOL.api_version,
        "kind": ATTENTIONPOOL.kind,
        "metadata": _metadata(service, name, naming.ATTENTION_COMPONENT),
        "spec": attention_pool_spec(service, spec, slot).to_k8s(),
    }
    return owned(body, service)


def api_service(service: Body, spec: MoEServiceSpec, slot: naming.Slot) -> dict[str, Any]:
    """The MoEService's API Service: the attention pods of the serving `slot`. A blue/green switch
    changes only its selector; connections already open stay with the pods they reached."""
    name = service["metadata"]["name"]
    pods = naming.pool_selector(naming.attention_pool_name(name, slot), naming.ATTENTION_COMPONENT)
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(service, naming.api_service_name(name), naming.ATTENTION_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": pods,
            "ports": [
                {"name": "http", "port": spec.attention_pool.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return owned(body, service)


def api_endpoint(service: Body, spec: MoEServiceSpec) -> str:
    """In-cluster URL of the OpenAI-compatible API (whichever slot serves)."""
    metadata = service["metadata"]
    name = naming.api_service_name(metadata["name"])
    return f"http://{name}.{metadata['namespace']}.svc:{spec.attention_pool.port}/v1"
