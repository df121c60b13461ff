"""AttentionPool → a Deployment of attention clients (placement ConfigMap mounted) and its Service."""

from __future__ import annotations

from typing import Any

from eaas.operator import naming
from eaas.operator.api.pools import AttentionPoolSpec
from eaas.operator.builders.common import (
    Body,
    checkpoint_volume,
    common_env,
    container_security_context,
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
from eaas.operator.builders.expertpool import co_location

CONTAINER = "attention-client"


def selector(pool: str) -> dict[str, str]:
    return naming.pool_selector(pool, naming.ATTENTION_COMPONENT)


def labels(pool: Body) -> dict[str, str]:
    return naming.common_labels(service_of(pool), naming.ATTENTION_COMPONENT) | selector(
        pool["metadata"]["name"]
    )


def endpoint(pool: Body, spec: AttentionPoolSpec) -> str:
    """In-cluster URL of the OpenAI-compatible API."""
    return f"http://{pool['metadata']['name']}.{pool['metadata']['namespace']}.svc:{spec.port}/v1"


def api_keys_env(spec: AttentionPoolSpec) -> list[dict[str, Any]]:
    """The API keys from the user's Secret (not optional: a missing Secret or key keeps the pod
    from starting, with the kubelet's event naming it, rather than serving without keys)."""
    if spec.api_keys_secret is None:
        return []
    ref = {"name": spec.api_keys_secret.name, "key": spec.api_keys_secret.key, "optional": False}
    return [{"name": naming.ENV_API_KEYS, "valueFrom": {"secretKeyRef": ref}}]


def deployment(pool: Body, spec: AttentionPoolSpec) -> dict[str, Any]:
    """Attention clients: stateless towards Kubernetes (KV caches are per request), so a Deployment."""
    name = pool["metadata"]["name"]
    namespace = pool["metadata"]["namespace"]
    service = service_of(pool)
    settings = common_env(
        service, name, spec.model, spec.transport, spec.heartbeat, spec.placement_config_map
    ) | {
        naming.ENV_PORT: spec.port,
        naming.ENV_EXPERT_SERVICE: f"{spec.expert_pool_name}.{namespace}.svc",
        naming.ENV_EXPERT_PORT: spec.expert_pool_port,
        naming.ENV_DRAIN_TIMEOUT: drain_timeout(spec),
        naming.ENV_MICRO_BATCHES: spec.micro_batches or "auto",
        **ucx_env(spec.transport, spec.ucx),
    }
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(naming.ATTENTION_CLIENT_COMMAND),
        "env": env(settings) + api_keys_env(spec),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "readinessProbe": http_probe("/readyz", "http", spec.heartbeat.interval_seconds, 3),
        "livenessProbe": http_probe("/healthz", "http", max(spec.heartbeat.interval_seconds, 5), 6),
        "startupProbe": startup_probe(spec, "http", spec.heartbeat.interval_seconds),
        "resources": resources(spec, spec.gpus_per_pod),
        "volumeMounts": volume_mounts(),
        "securityContext": container_security_context(),
    }
    pod_labels = labels(pool)
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": pod_labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    "containers": [container],
                    "volumes": [
                        checkpoint_volume(spec.model),
                        placement_volume(spec.placement_config_map),
                        data_token_volume(service),
                        scratch_volume(),
                    ],
                    **scheduling(spec, service),
                    **co_location(service, spec.transport),
                },
            },
        },
    }
    return owned(body, pool)


def disruption_budget(pool: Body, spec: AttentionPoolSpec) -> dict[str, Any]:
    """One attention pod out at a time by eviction: it stops taking new requests and finishes the
    ones it has (its grace period), while the others serve. A pool of one replica has nobody to
    take over: give it two where evictions happen."""
    name = pool["metadata"]["name"]
    body = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": pool["metadata"]["namespace"], "labels": labels(pool)},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return owned(body, pool)


def service(pool: Body, spec: AttentionPoolSpec) -> dict[str, Any]:
    """The OpenAI-compatible API inside the cluster (expose it with an Ingress/Gateway of your own)."""
    name = pool["metadata"]["name"]
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": pool["metadata"]["namespace"], "labels": labels(pool)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return owned(body, pool)
