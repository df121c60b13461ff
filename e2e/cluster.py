"""The object e2e tests talk to: a kubeconfig, Python API clients, and kubectl/helm helpers.

Three backends provide one (chosen by :func:`cluster_from_environment`):

``local`` (default)
    :class:`e2e.controlplane.ControlPlane` from the cached binaries (``make k8s-bins``).
``existing``
    ``EAAS_E2E_KUBECONFIG=/path/to/kubeconfig``: any reachable cluster; nothing is started or stopped.
``kind``
    ``EAAS_E2E_CLUSTER=kind``: a kind cluster through pytest-kind (needs Docker; opt-in only).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from e2e import binaries as bins
from e2e.waiting import wait_until

GPU_RESOURCE = "nvidia.com/gpu"


class CommandError(AssertionError):
    """A kubectl/helm command failed; the message carries its stdout and stderr."""

    def __init__(self, result: subprocess.CompletedProcess[str]) -> None:
        self.result = result
        super().__init__(
            f"`{' '.join(map(str, result.args))}` exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )


@dataclass
class Cluster:
    """A cluster the tests can use. Build one with :meth:`from_kubeconfig`.

    ``core``/``apps``/``custom``/``apiextensions``/``coordination``/``rbac`` are the typed clients of
    the ``kubernetes`` package, all sharing ``api_client``. ``backend`` is ``local``, ``existing`` or
    ``kind``; ``startup_seconds`` is how long the local control plane took to start (0 otherwise).
    """

    kubeconfig: Path
    backend: str
    api_client: client.ApiClient
    startup_seconds: float = 0.0
    work_dir: Path | None = None  # local backend: certificates, etcd data and logs/<component>.log
    kubectl_path: str | None = None  # default: the cached build, else `kubectl` from PATH
    helm_path: str | None = None  # default: the cached build, else `helm` from PATH

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path, backend: str, **kwargs: Any) -> Cluster:
        """A Cluster for `kubeconfig` (its current context); `kwargs` set the other fields."""
        api_client = config.new_client_from_config(config_file=str(kubeconfig))
        return cls(kubeconfig=kubeconfig, backend=backend, api_client=api_client, **kwargs)

    # -- typed API clients ---------------------------------------------------------------------
    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api_client)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    @property
    def apiextensions(self) -> client.ApiextensionsV1Api:
        return client.ApiextensionsV1Api(self.api_client)

    @property
    def coordination(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self.api_client)

    @property
    def rbac(self) -> client.RbacAuthorizationV1Api:
        return client.RbacAuthorizationV1Api(self.api_client)

    # -- command-line tools --------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def run_tool(
        self,
        tool: str,
        args: Sequence[str],
        check: bool = True,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run `tool` with KUBECONFIG set; raise :class:`CommandError` on failure when `check`."""
        result = subprocess.run(
            [tool, *map(str, args)],
            env=self._env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise CommandError(result)
        return result

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` against this cluster, e.g. ``cluster.kubectl("get", "pods", "-n", ns)``."""
        return self.run_tool(
            self.kubectl_path or bins.tool_path("kubectl"), args, check=check, input=input, timeout=timeout
        )

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``helm ARGS`` against this cluster, e.g. ``cluster.helm("install", "x", chart, "-n", ns)``."""
        return self.run_tool(self.helm_path or bins.tool_path("helm"), args, check=check, timeout=timeout)

    def apply(self, manifest: str, namespace: str | None = None) -> None:
        """``kubectl apply`` a YAML/JSON manifest given as text."""
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, input=manifest)

    @contextlib.contextmanager
    def custom_resource_definition(self, manifest: str, plural: str, group: str) -> Iterator[str]:
        """The CRD of ``manifest`` (text) applied server-side, Established and known to kubectl's
        discovery, for the duration of the ``with`` block; yields its name."""
        name = f"{plural}.{group}"
        self.kubectl("apply", "--server-side", "-f", "-", input=manifest)

        def established() -> bool:
            status = self.apiextensions.read_custom_resource_definition(name).status
            conditions = (status.conditions if status else None) or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_until(established, 60, f"CRD {name} Established")
        # Discovery (used by kubectl) can lag the Established condition by a moment.
        wait_until(lambda: self.kubectl("get", plural, "-A", check=False).returncode == 0, 30, "discovery")
        try:
            yield name
        finally:
            self.apiextensions.delete_custom_resource_definition(name)

    # -- namespaces and nodes ------------------------------------------------------------------
    def create_namespace(self, prefix: str = "e2e", timeout: float = 60) -> str:
        """Create a uniquely named namespace and wait until its ``default`` ServiceAccount exists
        (the ServiceAccount admission plugin rejects Pods before that)."""
        slug = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:40].strip("-") or "e2e"
        name = f"{slug}-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"eaas.io/e2e": "true"}))
        )
        wait_until(
            lambda: self.core.read_namespaced_service_account("default", name),
            timeout,
            f"the default ServiceAccount in {name}",
            ignore=(client.ApiException,),
        )
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace without waiting for it (the namespace controller finishes the job)."""
        with contextlib.suppress(client.ApiException):
            self.core.delete_namespace(name, propagation_policy="Background")

    @contextlib.contextmanager
    def namespace(self, prefix: str = "e2e") -> Iterator[str]:
        """A fresh namespace for the duration of the ``with`` block."""
        name = self.create_namespace(prefix)
        try:
            yield name
        finally:
            self.delete_namespace(name)

    def gpu_nodes(self) -> list[str]:
        """Ready nodes with allocatable ``nvidia.com/gpu`` (kwok's fake ones on the local backend)."""
        names = []
        for node in self.core.list_node().items:
            status = node.status or client.V1NodeStatus()
            gpus = int((status.allocatable or {}).get(GPU_RESOURCE, "0"))
            ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
            if gpus > 0 and ready and node.metadata and node.metadata.name:
                names.append(node.metadata.name)
        return names

    def server_version(self) -> str:
        """The API server's ``gitVersion``, e.g. ``v1.37.1``."""
        return str(client.VersionApi(self.api_client).get_code().git_version)


def pod_is_running(pod: Any) -> bool:
    """True when the Pod is Running and its Ready condition is True."""
    conditions = pod.status.conditions or []
    return pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True" for c in conditions)
