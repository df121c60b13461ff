"""A small dict-in, dict-out client for the few resources the operator touches.

It sits on the ``kubernetes`` package's authenticated :class:`ApiClient` (kubeconfig or in-cluster
ServiceAccount) and speaks plain JSON, so builders stay plain dicts. Every request has a timeout.
Writes use server-side apply for objects the operator alone owns (Services, ConfigMaps,
Deployments), create/delete for Pods, and JSON merge patches for the pools' specs, ``/status``
and ``/scale``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from eaas.operator import naming
from eaas.operator.api.kinds import KINDS


@dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{namespace}/{self.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path


RESOURCES: dict[str, Resource] = {
    "Pod": Resource("v1", "pods"),
    "Service": Resource("v1", "services"),
    "ConfigMap": Resource("v1", "configmaps"),
    "Secret": Resource("v1", "secrets"),
    "ServiceAccount": Resource("v1", "serviceaccounts"),
    "Role": Resource("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Resource("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Resource("networking.k8s.io/v1", "networkpolicies"),
    "Event": Resource("v1", "events"),
    "Deployment": Resource("apps/v1", "deployments"),
    "PodDisruptionBudget": Resource("policy/v1", "poddisruptionbudgets"),
    "Lease": Resource("coordination.k8s.io/v1", "leases"),
    "HorizontalPodAutoscaler": Resource("autoscaling/v2", "horizontalpodautoscalers"),
    **{kind.kind: Resource(kind.api_version, kind.plural) for kind in KINDS},
}

RETRYABLE_STATUSES = frozenset({0, 409, 429, 500, 502, 503, 504})
# Failures that say nothing about the objects, only that the operator cannot see them now.
BLINDING_STATUSES = frozenset({0, 401, 403, 429})


class KubeError(Exception):
    """A failed API request; ``status`` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, reason: str, message: str, request: str) -> None:
        self.status = status
        self.reason = reason
        self.api_message = message
        super().__init__(f"{request}: {status} {reason}: {message}")

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling, server errors and connection failures are worth retrying."""
        return self.status in RETRYABLE_STATUSES


def load_config(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """An ApiClient: in-cluster when running in a pod (and no kubeconfig is given), else kubeconfig."""
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig, context=context)


class Kube:
    """The operator's view of the API server (synchronous; kopf runs sync handlers in threads)."""

    def __init__(self, api_client: client.ApiClient, request_timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.request_timeout = request_timeout
        # The last moment (Unix seconds) the operator could not read the API server: at start, and
        # at every request that failed for the server's sake (unreachable, 5xx, throttled, or 401
        # and 403 while a restarted server's authorizer warms up). Until a heartbeat period has
        # passed since then, a Lease that looks old may only look so (see ``blind_since``).
        self.unreadable_at = time.time()

    # -- plumbing --------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        where = f"{method} {path}"
        try:
            response = self.api_client.call_api(*serialized, _request_timeout=self.request_timeout)
            data = response.read()
        except client.ApiException as error:
            raise self._failed(_error(error.status or 0, error.reason or "", error.body, where)) from None
        except Exception as error:  # urllib3 connection/timeout errors
            raise self._failed(KubeError(0, type(error).__name__, str(error), where)) from None
        if response.status >= 400:
            raise self._failed(_error(response.status, response.reason or "", data, where))
        return json.loads(data) if data else {}

    def _failed(self, error: KubeError) -> KubeError:
        if error.status in BLINDING_STATUSES or error.status >= 500:
            self.unreadable_at = time.time()
        return error

    # -- reads -----------------------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", RESOURCES[kind].path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` whose labels match `selector`."""
        query = [("labelSelector", naming.selector_string(selector))]
        return list(self.request("GET", RESOURCES[kind].path(namespace), query).get("items") or [])

    # -- writes ----------------------------------------------------------------------------------
    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create `obj`; None when an object of that name already exists."""
        metadata = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(metadata["namespace"])
        try:
            return self.request("POST", path, [("fieldManager", naming.FIELD_MANAGER)], obj)
        except KubeError as error:
            if error.status == 409 and error.reason == "AlreadyExists":
                return None
            raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as the operator's field manager (forcing: the operator owns it)."""
        metadata = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(metadata["namespace"], metadata["name"])
        query = [("fieldManager", naming.FIELD_MANAGER), ("force", "true")]
        return self.request("PATCH", path, query, obj, "application/apply-patch+yaml")

    def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object or one of its subresources (``status``, ``scale``)."""
        path = RESOURCES[kind].path(namespace, name, subresource)
        query = [("fieldManager", naming.FIELD_MANAGER)]
        return self.request("PATCH", path, query, patch, "application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete an object (only the one with `uid`, when given); False when it was already gone."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", RESOURCES[kind].path(namespace, name), body=body)
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True


def _error(status: int, reason: str, body: Any, where: str) -> KubeError:
    """A KubeError carrying the API's ``Status`` reason and message."""
    message = ""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            parsed = json.loads(body)
            message = parsed.get("message", "")
            reason = parsed.get("reason", reason) or reason
        except (ValueError, AttributeError):
            message = str(body)[:500]
    return KubeError(status, reason, message, where)
