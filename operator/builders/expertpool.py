"""ExpertPool → expert-server Pods (one per GPU, stable ordinals), a headless Service and the
placement ConfigMap."""

from __future__ import annotations

from typing import Any

from eaas.operator import naming
from eaas.operator.api.pools import ExpertPoolSpec
from eaas.operator.builders.common import (
    Body,
    checkpoint_volume,
    common_env,
    container_security_context,
    content_hash,
    data_token_volume,
    drain_timeout,
    env,
    http_probe,
    owned,
    placement_volume,
    pod_security_context,
    resources,
    scheduling,
    scratch_volume,
    service_of,
    startup_probe,
    ucx_env,
    volume_mounts,
)
from eaas.runtime.placement import stored
from eaas.runtime.placement.placement import Placement

CONTAINER = "expert-server"


def _var(name: str) -> str:
    """A Kubernetes ``$(VAR)`` reference, expanded from the container's env by the kubelet."""
    return f"$({name})"


# The server follows the mounted placement directory itself: during a change it loads the union of
# its committed and pending experts, reports the pending version on its Lease, and drops what only
# the old placement had once the change is committed.
SERVER_ARGS = (
    *naming.EXPERT_SERVER_COMMAND,
    "--checkpoint", _var(naming.ENV_CHECKPOINT),
    "--placement-dir", naming.PLACEMENT_MOUNT,
    "--ordinal", _var(naming.ENV_ORDINAL),
    "--host", "0.0.0.0",
    "--control-port", _var(naming.ENV_PORT),
    "--tcp-port", _var(naming.ENV_DATA_PORT),
    "--transports", _var(naming.ENV_TRANSPORT),
    "--device", _var(naming.ENV_DEVICE),
    "--kernel-backend", _var(naming.ENV_KERNEL_BACKEND),
)  # fmt: skip
# Spec fields that change the placement or the pod count, not the pods themselves.
_NOT_IN_TEMPLATE = ("replicas", "replicationFactor", "expertSlotsPerServer", "placement")


def selector(pool: str) -> dict[str, str]:
    """Labels selecting every expert-server pod of `pool` (``status.selector``)."""
    return naming.pool_selector(pool, naming.EXPERT_COMPONENT)


def labels(pool: Body) -> dict[str, str]:
    name = pool["metadata"]["name"]
    return naming.common_labels(service_of(pool), naming.EXPERT_COMPONENT) | selector(name)


def template_hash(spec: ExpertPoolSpec) -> str:
    """Changes exactly when the pods must be replaced (image, resources, model, transport, ...).
    ``ucx`` counts only with transport ``nixl``, the one that reads it."""
    skipped = _NOT_IN_TEMPLATE if spec.transport == "nixl" else (*_NOT_IN_TEMPLATE, "ucx")
    template = {key: value for key, value in spec.to_k8s().items() if key not in skipped}
    return content_hash(template)


def co_location(service: str, transport: str) -> dict[str, Any]:
    """Single-node transports (shm, cuda_ipc): every pod of the MoEService on one node, sharing IPC."""
    if transport not in ("shm", "cuda_ipc"):
        return {}
    return {
        "hostIPC": True,
        "affinity": {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {naming.SERVICE_LABEL: service}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
    }


def pod(pool: Body, spec: ExpertPoolSpec, ordinal: int) -> dict[str, Any]:
    """The expert-server Pod of `ordinal`: hostname ``<pool>-<n>`` under the headless Service."""
    name = pool["metadata"]["name"]
    namespace = pool["metadata"]["namespace"]
    service = service_of(pool)
    pod_name = naming.pod_name(name, ordinal)
    config_map = naming.placement_config_map_name(name)
    settings = common_env(service, name, spec.model, spec.transport, spec.heartbeat, config_map) | {
        naming.ENV_ORDINAL: ordinal,
        naming.ENV_PORT: spec.port,
        naming.ENV_DATA_PORT: spec.data_port,
        naming.ENV_EXPERT_SERVICE: f"{name}.{namespace}.svc",
        # A GPU pod keeps its experts on its GPU and computes with the Triton kernels (by default).
        naming.ENV_DEVICE: "cuda" if spec.gpus_per_pod else "cpu",
        naming.ENV_KERNEL_BACKEND: spec.kernel_backend or ("triton" if spec.gpus_per_pod else "torch"),
        naming.ENV_DRAIN_TIMEOUT: drain_timeout(spec),
        **ucx_env(spec.transport, spec.ucx),
    }
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(SERVER_ARGS),
        "env": env(settings),
        "ports": [
            {"name": "control", "containerPort": spec.port, "protocol": "TCP"},
            {"name": "data", "containerPort": spec.data_port, "protocol": "TCP"},
        ],
        "readinessProbe": http_probe("/readyz", "control", spec.heartbeat.interval_seconds, 3),
        "livenessProbe": http_probe("/healthz", "control", max(spec.heartbeat.interval_seconds, 5), 6),
        "startupProbe": startup_probe(spec, "control", spec.heartbeat.interval_seconds),
        "resources": resources(spec, spec.gpus_per_pod),
        "volumeMounts": volume_mounts(),
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "hostname": pod_name,
        "subdomain": name,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [
            checkpoint_volume(spec.model),
            placement_volume(config_map),
            data_token_volume(service),
            scratch_volume(),
        ],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector(name)},
            }
        ],
        **scheduling(spec, service),
        **co_location(service, spec.transport),
    }
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": namespace,
            "labels": labels(pool) | {naming.ORDINAL_LABEL: str(ordinal)},
            "annotations": {naming.TEMPLATE_HASH_ANNOTATION: template_hash(spec)},
        },
        "spec": pod_spec,
    }
    return owned(body, pool)


def disruption_budget(pool: Body, spec: ExpertPoolSpec) -> dict[str, Any]:
    """At most ``max(1, R-1)`` expert servers out at once by eviction (``kubectl drain``, the
    cluster autoscaler, node upgrades): an evicted server serves on until its experts are
    re-homed, and the next eviction waits until the pool is back to ``replicas`` Ready servers, so
    no expert loses its last replica to a drain. A budget of R-1 alone would block every drain of
    an R = 1 pool; the drain path moves its experts first, so one at a time is safe there too. An
    integer ``minAvailable``: the budget follows the pool's size as the operator writes it."""
    name = pool["metadata"]["name"]
    desired = max(spec.replicas, spec.replication_factor)
    body = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": pool["metadata"]["namespace"], "labels": labels(pool)},
        "spec": {
            "minAvailable": max(0, desired - max(1, spec.replication_factor - 1)),
            "selector": {"matchLabels": selector(name)},
            # A server that is not Ready serves nobody: evicting it costs nothing, and must not
            # wait on the budget (a stuck pod would otherwise block every drain of its node).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return owned(body, pool)


def headless_service(pool: Body, spec: ExpertPoolSpec) -> dict[str, Any]:
    """DNS ``<pool>-<n>.<pool>.<namespace>.svc`` for every server, ready or not (they handshake first)."""
    name = pool["metadata"]["name"]
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": pool["metadata"]["namespace"], "labels": labels(pool)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(name),
            "ports": [
                {"name": "control", "port": spec.port, "targetPort": "control", "protocol": "TCP"},
                {"name": "data", "port": spec.data_port, "targetPort": "data", "protocol": "TCP"},
            ],
        },
    }
    return owned(body, pool)


def placement_config_map(
    pool: Body, committed: Placement | None, pending: Placement | None
) -> dict[str, Any]:
    """The placement ConfigMap: ``placement.json`` (committed) and ``pending.json`` (being loaded)
    in ``binaryData``, packed (:mod:`eaas.runtime.placement.stored`); a key is absent when there is
    no such placement. Raises ``PlacementTooLarge`` when they do not fit in a ConfigMap.
    """
    name = pool["metadata"]["name"]
    binary_data = stored.config_map_data(committed, pending)
    annotations: dict[str, str] = {}
    if committed is not None:
        annotations[naming.PLACEMENT_VERSION_ANNOTATION] = str(committed.version)
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": naming.placement_config_map_name(name),
            "namespace": pool["metadata"]["namespace"],
            "labels": labels(pool),
            "annotations": annotations,
        },
        "binaryData": binary_data,
    }
    return owned(body, pool)
