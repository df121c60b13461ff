"""Pieces every builder shares: ownership, volumes, environment, resources, hashing."""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

import kopf

from eaas.operator import naming
from eaas.operator.api.common import HeartbeatSpec, ModelSpec, PodSettings, UCXSpec

Body = Mapping[str, Any]  # an object as the API returns it (camelCase dict)

# Bump when the operator changes the pods it builds, so existing pods are rolled.
POD_TEMPLATE_REVISION = 2


def owned(obj: dict[str, Any], owner: Body) -> dict[str, Any]:
    """`obj` adopted by `owner` (controller ownerReference, owner's namespace and labels)."""
    kopf.adopt(obj, owner=owner)  # type: ignore[arg-type]
    return obj


def owner_stub(body: Body) -> dict[str, Any]:
    """The parts of an object that adoption reads (kopf bodies are live views; copy them)."""
    metadata = body.get("metadata", {})
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {
            "name": metadata["name"],
            "namespace": metadata.get("namespace"),
            "uid": metadata["uid"],
            "labels": dict(metadata.get("labels") or {}),
        },
    }


def service_of(body: Body) -> str:
    """The MoEService an object belongs to (its label, else its own name)."""
    metadata = body.get("metadata", {})
    return str((metadata.get("labels") or {}).get(naming.SERVICE_LABEL) or metadata["name"])


def checkpoint_volume(model: ModelSpec) -> dict[str, Any]:
    checkpoint = model.checkpoint
    if checkpoint.persistent_volume_claim is not None:
        claim = checkpoint.persistent_volume_claim
        return {
            "name": "checkpoint",
            "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": claim.read_only},
        }
    assert checkpoint.host_path is not None  # the CRD allows exactly one source
    return {"name": "checkpoint", "hostPath": {"path": checkpoint.host_path.path, "type": "Directory"}}


def checkpoint_path(model: ModelSpec) -> str:
    sub = model.checkpoint.sub_path.strip("/")
    return f"{naming.CHECKPOINT_MOUNT}/{sub}" if sub else naming.CHECKPOINT_MOUNT


def placement_volume(config_map: str) -> dict[str, Any]:
    return {"name": "placement", "configMap": {"name": config_map}}


def data_token_volume(service: str) -> dict[str, Any]:
    """The MoEService's data-token Secret (the kubelet swaps the file when the Secret changes)."""
    return {"name": "data-token", "secret": {"secretName": naming.data_token_secret_name(service)}}


def runtime_service_account(owner: Body) -> dict[str, Any]:
    """The pods' ServiceAccount for MoEService `owner` (used unless the spec names another)."""
    return _runtime_object(
        owner, "v1", "ServiceAccount", naming.runtime_account_name(owner["metadata"]["name"])
    )


def runtime_role_binding(owner: Body, cluster_role: str) -> dict[str, Any]:
    """Binds `cluster_role` (the runtime's: Leases) to the pods' ServiceAccount, in this namespace only."""
    service = owner["metadata"]["name"]
    return _runtime_binding(owner, naming.runtime_account_name(service), "ClusterRole", cluster_role)


def runtime_placement_role(owner: Body) -> dict[str, Any]:
    """Reading the MoEService's placement ConfigMaps (both slots' expert pools) and no other: the
    pods watch theirs (a watch by ``fieldSelector=metadata.name``, authorized as that name)."""
    service = owner["metadata"]["name"]
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "list", "watch"],
        "resourceNames": [
            naming.placement_config_map_name(naming.expert_pool_name(service, slot)) for slot in naming.SLOTS
        ],
    }
    name = naming.runtime_placement_role_name(service)
    return _runtime_object(owner, "rbac.authorization.k8s.io/v1", "Role", name, rules=[rule])


def runtime_placement_role_binding(owner: Body) -> dict[str, Any]:
    """Binds :func:`runtime_placement_role` to the pods' ServiceAccount."""
    name = naming.runtime_placement_role_name(owner["metadata"]["name"])
    return _runtime_binding(owner, name, "Role", name)


def _runtime_binding(owner: Body, name: str, role_kind: str, role: str) -> dict[str, Any]:
    service, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    account = {"kind": "ServiceAccount", "name": naming.runtime_account_name(service), "namespace": namespace}
    return _runtime_object(
        owner,
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        name,
        roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
        subjects=[account],
    )


def _runtime_object(owner: Body, api_version: str, kind: str, name: str, **fields: Any) -> dict[str, Any]:
    """`kind` `name` (with `fields`) of the pods' access, in the MoEService's namespace and owned by it."""
    service = owner["metadata"]["name"]
    metadata = {"name": name, "namespace": owner["metadata"]["namespace"]}
    body = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": metadata | {"labels": naming.common_labels(service, "runtime")},
    }
    return owned(body | fields, owner)


def data_token_secret(owner: Body) -> dict[str, Any]:
    """A random data token for MoEService `owner`; created once, then left to the user (rotation)."""
    service = owner["metadata"]["name"]
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": naming.data_token_secret_name(service),
            "namespace": owner["metadata"]["namespace"],
            "labels": naming.common_labels(service, "data-token"),
        },
        "stringData": {naming.DATA_TOKEN_KEY: secrets.token_urlsafe(32)},
    }
    return owned(body, owner)


RUNTIME_UID = 65532  # the image's non-root user (Dockerfile)
SCRATCH = "/tmp"  # the only writable path of a runtime container (an emptyDir): caches, temp files


def pod_security_context() -> dict[str, Any]:
    """What the ``restricted`` Pod Security Standard asks of a pod; fsGroup lets the non-root user
    read the mounted Secret and ConfigMap."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """No privilege escalation, no capabilities, a read-only root filesystem (scratch: ``/tmp``)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_volume() -> dict[str, Any]:
    return {"name": "scratch", "emptyDir": {}}


def volume_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "checkpoint", "mountPath": naming.CHECKPOINT_MOUNT, "readOnly": True},
        {"name": "placement", "mountPath": naming.PLACEMENT_MOUNT, "readOnly": True},
        {"name": "data-token", "mountPath": naming.DATA_TOKEN_MOUNT, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH},
    ]


def env(pairs: Mapping[str, str | int]) -> list[dict[str, Any]]:
    """Literal environment variables plus the Downward-API ones every pod gets: its name, namespace
    and uid, and its torch threads, which are its CPU request rounded up to whole cores (kubelet
    rounds up; no request gives 0, torch's default). With more threads than the cores a pod gets,
    each parallel op waits at its barrier for the thread whose core another process took."""
    downward = [
        {"name": naming.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": naming.ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": naming.ENV_POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {
            "name": naming.ENV_THREADS,
            "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}},
        },
    ]
    return downward + [{"name": name, "value": str(value)} for name, value in pairs.items()]


def common_env(
    service: str, pool: str, model: ModelSpec, transport: str, heartbeat: HeartbeatSpec, config_map: str
) -> dict[str, str | int]:
    """Settings both kinds of pods read (see :mod:`eaas.operator.naming`)."""
    return {
        naming.ENV_SERVICE: service,
        naming.ENV_POOL: pool,
        naming.ENV_TRANSPORT: transport,
        naming.ENV_CHECKPOINT: checkpoint_path(model),
        naming.ENV_MODEL_REVISION: model.revision_id,
        naming.ENV_PLACEMENT_CONFIGMAP: config_map,
        naming.ENV_PLACEMENT_FILE: f"{naming.PLACEMENT_MOUNT}/{naming.PLACEMENT_KEY}",
        naming.ENV_PENDING_FILE: f"{naming.PLACEMENT_MOUNT}/{naming.PENDING_KEY}",
        naming.ENV_HEARTBEAT_INTERVAL: heartbeat.interval_seconds,
        naming.ENV_HEARTBEAT_TIMEOUT: heartbeat.timeout_seconds,
        naming.ENV_DATA_TOKEN_FILE: f"{naming.DATA_TOKEN_MOUNT}/{naming.DATA_TOKEN_KEY}",
        "HOME": SCRATCH,  # caches that default to ~ (Triton's kernels, torch's) land on the scratch volume
    }


def ucx_env(transport: str, ucx: UCXSpec) -> dict[str, str]:
    """UCX's own environment variables, read when a NIXL agent starts: only for transport ``nixl``.

    ``UCX_TLS`` (transports), ``UCX_TCP_PORT_RANGE`` (``MIN-MAX``: the TCP transport's listening
    ports, which the NetworkPolicies open) and ``UCX_NET_DEVICES`` when the spec names devices.
    """
    if transport != "nixl":
        return {}
    variables = {
        "UCX_TLS": ucx.transports,
        "UCX_TCP_PORT_RANGE": f"{ucx.tcp_port_min}-{ucx.tcp_port_max}",
    }
    if ucx.net_devices:
        variables["UCX_NET_DEVICES"] = ucx.net_devices
    return variables


def resources(settings: PodSettings, gpus: int) -> dict[str, Any]:
    """Container resources: the user's CPU/memory plus exactly `gpus` GPUs (requests = limits)."""
    requests = {key: str(value) for key, value in settings.resources.requests.items()}
    limits = {key: str(value) for key, value in settings.resources.limits.items()}
    requests.pop(settings.gpu_resource_name, None)
    limits.pop(settings.gpu_resource_name, None)
    if gpus:
        requests[settings.gpu_resource_name] = str(gpus)
        limits[settings.gpu_resource_name] = str(gpus)
    result: dict[str, Any] = {}
    if requests:
        result["requests"] = requests
    if limits:
        result["limits"] = limits
    return result


EXIT_MARGIN_S = 5  # of the grace period, kept for the process's exit after its drain


def drain_timeout(settings: PodSettings) -> int:
    """How long a pod's process serves on after SIGTERM (``EAAS_DRAIN_TIMEOUT_SECONDS``)."""
    return settings.termination_grace_period_seconds - EXIT_MARGIN_S


def scheduling(settings: PodSettings, service: str) -> dict[str, Any]:
    """serviceAccountName (the spec's, else the operator-made ``<service>-runtime``), nodeSelector,
    tolerations and the termination grace period of a pod spec."""
    spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account_name or naming.runtime_account_name(service),
        "terminationGracePeriodSeconds": settings.termination_grace_period_seconds,
    }
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [toleration.to_k8s() for toleration in settings.tolerations]
        for toleration in spec["tolerations"]:
            for key in ("key", "value", "effect"):
                if toleration.get(key) == "":
                    del toleration[key]
    return spec


def startup_probe(settings: PodSettings, port: str, period: int) -> dict[str, Any]:
    """``/healthz`` every `period` (the readiness probe's, so a pod is Ready as soon as before)
    for ``startupTimeoutSeconds``: the process answers it once it has loaded its weights; the
    kubelet holds the liveness and readiness probes until then."""
    failures = -(-settings.startup_timeout_seconds // period)
    return http_probe("/healthz", port, period, failures)


def http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": max(1, min(period, 5)),
    }


def content_hash(value: Any) -> str:
    """A short stable hash of JSON-able `value` (template change detection)."""
    text = json.dumps([POD_TEMPLATE_REVISION, value], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 JSON merge patch turning `old` into `new` (None when they are equal).

    Keys missing from `new` become ``null`` (removed); lists are replaced whole.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None if old == new else copy.deepcopy(new)
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        else:
            child = merge_patch(old[key], value)
            if child is not None or (old[key] is not None and value is None):
                patch[key] = child
    return patch or None
