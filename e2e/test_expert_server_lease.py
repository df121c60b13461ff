# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional; a None here is a test failure anyway.)
"""An expert server's heartbeat Lease against the real API server, with only the RBAC it documents.

The server runs as a process with the pod's environment (``EAAS_POD_NAME``, ``EAAS_NAMESPACE``,
``EAAS_POOL``, heartbeat settings) and a kubeconfig of a ServiceAccount bound to a Role that
allows ``leases`` ``get``/``create``/``update``/``list`` and nothing else; the operator's own Lease
reader (``server_reports``) must see it live, at the placement version it has loaded. The server
also lists its MoEService's attention clients' Leases and frees the slot of a client whose Lease
expired while its connection stayed open (a hung client), and only that one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.operator.harness import service_account_kubeconfig
from eaas.operator import naming
from eaas.operator.expert_step import ServerReport
from eaas.operator.reconcile.expertpool import server_reports
from eaas.runtime.client.connection import ServerConnection, http_json
from eaas.runtime.lease import Heartbeat, LeaseSettings
from eaas.runtime.model import preset, write_random_checkpoint
from eaas.runtime.placement import round_robin

SERVICE = "tiny"
POOL = "tiny-experts"
POD = f"{POOL}-0"
RUNTIME_RULES = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update", "list"],
    }
]


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def read_lease(cluster: Cluster, namespace: str) -> dict[str, Any] | None:
    leases = cluster.coordination.list_namespaced_lease(
        namespace, label_selector=f"{naming.POOL_LABEL}={POOL}"
    ).items
    return cluster.api_client.sanitize_for_serialization(leases[0]) if leases else None


def report(cluster: Cluster, namespace: str) -> ServerReport:
    """What the operator's Lease reader makes of the server's Lease now."""
    lease = read_lease(cluster, namespace)
    assert lease is not None
    return server_reports(POOL, [lease], time.time())[0]


@pytest.fixture
def runtime_kubeconfig(cluster: Cluster, namespace: str, tmp_path: Path) -> Path:
    """Credentials of a ServiceAccount with exactly the expert pods' RBAC."""
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "expert-server"}})
    cluster.rbac.create_namespaced_role(
        namespace, {"metadata": {"name": "eaas-runtime"}, "rules": RUNTIME_RULES}
    )
    cluster.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "eaas-runtime"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "eaas-runtime"},
            "subjects": [{"kind": "ServiceAccount", "name": "expert-server", "namespace": namespace}],
        },
    )
    return service_account_kubeconfig(cluster, namespace, "expert-server", tmp_path / "runtime.kubeconfig")


@pytest.fixture
def server(
    namespace: str, runtime_kubeconfig: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """Server 0 of a 2-server placement, as its pod would run it: (process, placement dir, log)."""
    config = preset("mixtral")
    checkpoint = write_random_checkpoint(config, tmp_path / "checkpoint", seed=3)
    directory = tmp_path / "placement"
    directory.mkdir()
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1).with_version(1)
    (directory / naming.PLACEMENT_KEY).write_text(placement.to_json())
    log_path = tmp_path / "server.log"
    env = {
        **os.environ,
        naming.ENV_POD_NAME: POD,
        naming.ENV_NAMESPACE: namespace,
        naming.ENV_POOL: POOL,
        naming.ENV_SERVICE: SERVICE,
        naming.ENV_HEARTBEAT_INTERVAL: "0.5",
        naming.ENV_HEARTBEAT_TIMEOUT: "2",
    }
    command = [
        sys.executable, "-m", "eaas.runtime.server", "--checkpoint", str(checkpoint),
        "--placement-dir", str(directory), "--placement-poll-seconds", "0.2", "--ordinal", "0",
        "--transports", "tcp", "--threads", "1", "--kubeconfig", str(runtime_kubeconfig),
        "--exit-with-parent", str(os.getpid()), "--ready-file", str(tmp_path / "ready.json"),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield process, directory, log_path
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_lease_is_created_renewed_and_reports_the_loaded_placement(
    cluster: Cluster, namespace: str, server: tuple[subprocess.Popen[bytes], Path, Path]
) -> None:
    process, directory, log_path = server
    lease = wait_for(lambda: read_lease(cluster, namespace), "the Lease to be created", 30)
    assert lease["metadata"]["name"] == POD
    assert lease["metadata"]["labels"][naming.POOL_LABEL] == POOL
    assert lease["spec"]["holderIdentity"] == POD and lease["spec"]["leaseDurationSeconds"] == 2
    annotations = lease["metadata"]["annotations"]
    assert annotations[naming.LOADED_VERSION_ANNOTATION] == "1"
    assert 0 <= int(annotations[naming.UTILIZATION_ANNOTATION]) <= 1000
    assert annotations[naming.TOKEN_RATE_ANNOTATION] == "0"  # nothing routed to it yet

    first = lease["spec"]["renewTime"]
    renewed = wait_for(
        lambda: (lease := read_lease(cluster, namespace)) and lease["spec"]["renewTime"] > first and lease,
        "renewTime to advance",
    )
    seen = server_reports(POOL, [renewed], time.time())[0]
    assert not seen.expired and seen.loaded_version == 1 and seen.utilization_milli is not None
    assert seen.tokens_per_second == 0

    # A pending placement that moves experts: the Lease reports it once the experts are loaded.
    config = preset("mixtral")
    pending = round_robin(config.moe_layers, config.num_experts, 3, replication=1).with_version(2)
    (directory / naming.PENDING_KEY).write_text(pending.to_json())
    wait_for(
        lambda: report(cluster, namespace).loaded_version == 2,
        "the Lease to report placement v2",
    )
    assert process.poll() is None, log_path.read_text()
    assert "not renewed" not in log_path.read_text()  # the Role's verbs were enough

    # A dead server's Lease expires after leaseDurationSeconds: the operator stops counting on it.
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    wait_for(
        lambda: report(cluster, namespace).expired,
        "the Lease to expire",
        10,
    )


def test_sigterm_is_announced_on_the_lease_at_once_and_the_server_serves_on(
    cluster: Cluster, namespace: str, server: tuple[subprocess.Popen[bytes], Path, Path]
) -> None:
    """What the operator reads to drain a server that received SIGTERM: the Lease says by when it
    will be gone, renewed at once (not at the next interval), while the process serves on."""
    process, _, log_path = server
    wait_for(lambda: read_lease(cluster, namespace), "the Lease to be created", 30)
    assert not report(cluster, namespace).leaving
    process.send_signal(signal.SIGTERM)
    lease = wait_for(
        lambda: (
            (lease := read_lease(cluster, namespace))
            and naming.LEAVING_ANNOTATION in lease["metadata"]["annotations"]
            and lease
        ),
        "the Lease to announce the departure",
        5,
    )
    by = lease["metadata"]["annotations"][naming.LEAVING_ANNOTATION]
    assert by.endswith("Z") and by > lease["spec"]["renewTime"]  # a deadline in the future
    seen = report(cluster, namespace)
    assert seen.leaving and not seen.expired
    time.sleep(1.0)
    assert process.poll() is None, log_path.read_text()  # the placement still names it: it serves on
    assert "SIGTERM: leaving" in log_path.read_text()


def test_heartbeat_keeps_retrying_through_api_errors(cluster: Cluster, namespace: str) -> None:
    """A namespace that does not exist yet: create fails (404), is retried, and succeeds later."""
    later = f"{namespace}-later"
    settings = LeaseSettings(POD, later, POOL, interval_s=0.5, timeout_s=2, kubeconfig=cluster.kubeconfig)
    heartbeat = Heartbeat(settings, lambda: 7, lambda: 0.0).start()
    try:
        wait_for(lambda: heartbeat.failures >= 2, "failed heartbeats")
        assert heartbeat.renewals == 0
        cluster.core.create_namespace({"metadata": {"name": later}})
        lease = wait_for(
            lambda: cluster.coordination.list_namespaced_lease(later).items, "the Lease after recovery"
        )[0]
        assert lease.metadata.annotations[naming.LOADED_VERSION_ANNOTATION] == "7"
        wait_for(lambda: heartbeat.renewals >= 2 and heartbeat.failures == 0, "renewals after recovery")
    finally:
        heartbeat.stop()
        cluster.delete_namespace(later)


def test_the_slot_of_a_client_whose_lease_expired_is_freed(
    cluster: Cluster,
    namespace: str,
    runtime_kubeconfig: Path,
    server: tuple[subprocess.Popen[bytes], Path, Path],
    tmp_path: Path,
) -> None:
    """Two attention clients renew Leases as their pods would; one stops renewing but keeps its
    connection open (hung): the server frees that slot within about the Lease's duration, counts it
    as ``lease_expired``, and leaves the live client's slot alone."""
    process, _, log_path = server
    ready = wait_for(lambda: (tmp_path / "ready.json").exists() and tmp_path / "ready.json", "the server", 60)
    url = json.loads(ready.read_text())["url"]
    beats = {}
    connections = {}
    for name in ("tiny-attention-live", "tiny-attention-hung"):
        settings = LeaseSettings(
            name, namespace, "tiny-attention", 0.5, 2, runtime_kubeconfig, None,
            naming.ATTENTION_COMPONENT, SERVICE,
        )  # fmt: skip
        beats[name] = Heartbeat(settings, lambda: 1, lambda: 0.0).start()
        connections[name] = ServerConnection(0, url, "tcp", name, 5.0, 5.0, lease=name)
        connections[name].connect()

    def attached() -> set[str]:
        rows = http_json("GET", f"{url}/v1/slots")["slots"]
        return {row["client_id"] for row in rows if row["state"] != "OFFLINE"}

    def lease_expired_count() -> float:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith('eaas_expert_server_reaped_slots_total{reason="lease_expired"}'):
                return float(line.split()[-1])
        return 0.0

    try:
        assert attached() == set(beats)
        time.sleep(3)  # more than a Lease duration: both renew, neither is freed
        assert attached() == set(beats) and lease_expired_count() == 0
        beats["tiny-attention-hung"].stop()  # hung: no renewals, the TCP connection stays open
        stopped = time.monotonic()
        wait_for(lambda: attached() == {"tiny-attention-live"}, "the hung client's slot to be freed", 10)
        freed_after = time.monotonic() - stopped
        print(f"hung client's slot freed {freed_after:.1f} s after its last renewal (Lease: 2 s)")
        assert 1.5 < freed_after < 5.0  # its Lease's duration, plus at most two listing intervals
        assert lease_expired_count() == 1
        assert "client Leases of" not in log_path.read_text()  # the Role's list verb was enough
    finally:
        for beat in beats.values():
            beat.stop()
        for connection in connections.values():
            connection.drop()
    assert process.poll() is None, log_path.read_text()
