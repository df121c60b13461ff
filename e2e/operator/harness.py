"""Running `eaas operator` as a local process with the chart's ServiceAccount credentials."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import Cluster
from e2e.processes import ManagedProcess, free_port, tail
from eaas.runtime.placement import Placement, stored

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "eaas"
RESYNC_SECONDS = 1
RUNTIME_CLUSTER_ROLE = "eaas-runtime"  # the chart's <release>-runtime for release "eaas"


def service_account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as ServiceAccount `namespace/account` (a bound token), so
    the operator has exactly the chart's RBAC, nothing of the admin's."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration", "2h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    server = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    cluster_entry: dict[str, Any] = {"server": server["server"]}
    if "certificate-authority-data" in server:
        cluster_entry["certificate-authority-data"] = server["certificate-authority-data"]
    elif "certificate-authority" in server:
        ca = Path(server["certificate-authority"]).read_bytes()
        cluster_entry["certificate-authority-data"] = base64.b64encode(ca).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster_entry}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": "e2e", "user": account}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class OperatorProcess:
    """`eaas operator` started from this checkout's Python, logging to `log_path`."""

    kubeconfig: Path
    log_path: Path
    namespace: str = ""  # the release's: NetworkPolicies admit the operator from there
    process: ManagedProcess | None = None
    metrics_port: int = 0
    health_port: int = 0
    resync_seconds: float = RESYNC_SECONDS  # EAAS_OPERATOR_RESYNC_SECONDS (the chart's default: 10)
    verbose: bool = False  # --verbose: debug logging (kopf's own patches included)
    # (start, end) in seconds since the epoch: a kube-apiserver that has just started refuses
    # requests until its RBAC caches are filled, so its 403s then are not the chart's fault
    forbidden_grace: list[tuple[float, float]] = field(default_factory=list)

    def start(self) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "eaas.runtime.cli",
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            "--metrics-port",
            str(self.metrics_port),
            "--health-port",
            str(self.health_port),
            "--request-timeout",
            "10",
            *(["--verbose"] if self.verbose else []),
        ]
        env = {
            **os.environ,
            "EAAS_OPERATOR_RESYNC_SECONDS": str(self.resync_seconds),
            "EAAS_RUNTIME_CLUSTER_ROLE": RUNTIME_CLUSTER_ROLE,  # as the chart's Deployment passes it
            "EAAS_OPERATOR_POD_NAMESPACE": self.namespace,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.process = ManagedProcess("eaas-operator", argv, self.log_path, env=env)
        self.process.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash or an evicted pod would: no cleanup runs."""
        assert self.process is not None and self.process.popen is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.popen.wait(timeout=10)
        self.process = None

    def check_alive(self) -> None:
        assert self.process is not None and self.process.running(), (
            self.process.describe_exit() if self.process else ""
        )

    def forbidden(self) -> list[str]:
        """Log lines where the API server refused the ServiceAccount (missing RBAC). A 403 from the
        NamespaceLifecycle admission plugin (a write into a namespace an earlier test is deleting)
        is not about RBAC and is left out."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [
            line
            for line in text.splitlines()
            if ("403 Forbidden" in line or " is forbidden: " in line)
            and "because it is being terminated" not in line
            and not self._in_grace(line)
        ]

    def _in_grace(self, line: str) -> bool:
        """Was `line` (it starts with the log's local timestamp) logged in a grace window?"""
        try:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            return False
        return any(start <= stamp <= end for start, end in self.forbidden_grace)

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    def wait_started(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if "eaas operator watching" in (
                self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"the operator did not start in {timeout} s:\n{self.log_tail()}")


@contextlib.contextmanager
def operator_as(cluster: Cluster, namespace: str, account: str, directory: Path) -> Iterator[OperatorProcess]:
    """`eaas operator` as ServiceAccount `namespace/account`, logging into `directory`; afterwards
    fails if the API server forbade it anything (RBAC the chart lacks)."""
    kubeconfig = service_account_kubeconfig(cluster, namespace, account, directory / "operator.kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_path=directory / "operator.log", namespace=namespace)
    process.start()
    process.wait_started()
    try:
        yield process
    finally:
        process.stop()
    assert not process.forbidden(), "the chart's RBAC is missing something:\n" + "\n".join(
        process.forbidden()
    )


def stored_placements(config_map: Any) -> tuple[Placement | None, Placement | None]:
    """(committed, pending) of a placement ConfigMap as the Kubernetes client returns it."""
    return stored.read_config_map(
        {
            "metadata": {"name": config_map.metadata.name},
            "data": config_map.data,
            "binaryData": config_map.binary_data,
        }
    )
