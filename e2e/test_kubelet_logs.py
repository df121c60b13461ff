# mypy: disable-error-code="arg-type,union-attr"
# (the kubernetes client takes plain dicts for bodies and types every model field as Optional.)
"""``kubectl logs`` on the process nodes: the runner serves the kubelet's log endpoint
(:mod:`e2e.kubeletlogs`) to the API server, and to nobody else."""

from __future__ import annotations

import http.client
import os
import re
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.backends import plane_cluster
from e2e.backends import process_plane as process_plane_of
from e2e.cluster import Cluster, CommandError
from e2e.controlplane import ControlPlane, ProcessNodeSpec
from e2e.kubeletlogs import LogError, LogRequest, parse_request, tail_offset
from e2e.waiting import wait_until

NODES = ["logs-node-0", "logs-node-1"]
PYTHON = os.path.basename(sys.executable)


@pytest.fixture(scope="module")
def process_plane() -> Iterator[ControlPlane]:
    with process_plane_of(ProcessNodeSpec(count=2, gpus=1, name_prefix="logs-node-")) as plane:
        yield plane


@pytest.fixture(scope="module")
def logs_cluster(process_plane: ControlPlane) -> Cluster:
    return plane_cluster(process_plane)


@pytest.fixture
def namespace(logs_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the process nodes' plane (the conftest's is on the session cluster)."""
    with logs_cluster.namespace(prefix=request.node.name.removeprefix("test_")) as name:
        yield name


def _container(name: str, code: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "unused", "command": [PYTHON, "-u", "-c", code], **extra}


def _pod(name: str, node: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": containers, **spec},
    }


SLEEP = "import time; time.sleep(3600)"
# First run: says so and fails; the restart (the marker survives in the emptyDir) says so and stays.
CRASH_ONCE = (
    "import os, time\n"
    "if os.path.exists('/state/ran'):\n"
    "    print('second run'); time.sleep(3600)\n"
    "open('/state/ran', 'w').close(); print('first run'); raise SystemExit(1)\n"
)


def _logs(cluster: Cluster, namespace: str, *args: str, timeout: float = 60) -> str:
    return cluster.kubectl("logs", "-n", namespace, *args, timeout=timeout).stdout


def _wait_for_output(cluster: Cluster, namespace: str, pod: str, container: str, expected: str) -> None:
    def written() -> bool:
        result = cluster.kubectl("logs", "-n", namespace, pod, "-c", container, check=False)
        return result.returncode == 0 and result.stdout == expected

    wait_until(written, 60, f"{pod}/{container} to have written {expected!r}")


def test_kubectl_logs_returns_a_containers_output(logs_cluster: Cluster, namespace: str) -> None:
    lines = "one\ntwo\nthree\n"
    say = _container("say", f"import time; print({lines.rstrip()!r}); time.sleep(3600)")
    other = _container("other", f"import time; print('other line'); {SLEEP}")
    logs_cluster.core.create_namespaced_pod(namespace, _pod("talker", NODES[1], [say, other]))
    _wait_for_output(logs_cluster, namespace, "talker", "say", lines)

    assert _logs(logs_cluster, namespace, "talker", "-c", "say") == lines
    assert _logs(logs_cluster, namespace, "talker", "-c", "say", "--tail", "1") == "three\n"
    assert _logs(logs_cluster, namespace, "talker", "-c", "say", "--tail", "2") == "two\nthree\n"
    assert _logs(logs_cluster, namespace, "talker", "-c", "say", "--tail", "0") == ""
    assert _logs(logs_cluster, namespace, "talker", "-c", "say", "--limit-bytes", "6") == "one\ntw"
    assert _logs(logs_cluster, namespace, "talker", "-c", "other") == "other line\n"
    assert _logs(logs_cluster, namespace, "talker", "--all-containers", "--prefix").splitlines() == [
        "[pod/talker/say] one",
        "[pod/talker/say] two",
        "[pod/talker/say] three",
        "[pod/talker/other] other line",
    ]
    with pytest.raises(CommandError, match='previous terminated container "say" in pod "talker" not found'):
        _logs(logs_cluster, namespace, "talker", "-c", "say", "--previous")
    with pytest.raises(CommandError, match="timestamps"):
        _logs(logs_cluster, namespace, "talker", "-c", "say", "--timestamps")


def test_previous_returns_the_run_before_a_restart(logs_cluster: Cluster, namespace: str) -> None:
    crash = _container("crash", CRASH_ONCE, volumeMounts=[{"name": "state", "mountPath": "/state"}])
    pod = _pod("restarter", NODES[0], [crash], volumes=[{"name": "state", "emptyDir": {}}])
    logs_cluster.core.create_namespaced_pod(namespace, pod)
    _wait_for_output(logs_cluster, namespace, "restarter", "crash", "second run\n")

    assert _logs(logs_cluster, namespace, "restarter") == "second run\n"  # one container: no -c
    assert _logs(logs_cluster, namespace, "restarter", "--previous") == "first run\n"


def test_follow_streams_until_the_container_ends(logs_cluster: Cluster, namespace: str) -> None:
    code = "import time; print('early'); time.sleep(4); print('late')"
    pod = _pod("follower", NODES[0], [_container("main", code)], restartPolicy="Never")
    logs_cluster.core.create_namespaced_pod(namespace, pod)
    _wait_for_output(logs_cluster, namespace, "follower", "main", "early\n")

    # Started while the container sleeps: returns once it has ended, with what it wrote meanwhile.
    assert _logs(logs_cluster, namespace, "follower", "-f") == "early\nlate\n"


def _node_endpoint(cluster: Cluster, node: str) -> tuple[str, int]:
    status = cluster.core.read_node_status(node).status
    address = next(a.address for a in status.addresses if a.type == "InternalIP")
    return address, status.daemon_endpoints.kubelet_endpoint.port


def _get(plane: ControlPlane, node: str, path: str, cert: tuple[str, str] | None) -> tuple[int, str]:
    address, port = _node_endpoint(plane_cluster(plane), node)
    context = ssl.create_default_context(cafile=str(plane.pki.ca_cert))
    if cert is not None:
        context.load_cert_chain(*cert)
    connection = http.client.HTTPSConnection(address, port, context=context, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_only_the_api_server_reads_logs_from_a_node(
    process_plane: ControlPlane, logs_cluster: Cluster, namespace: str
) -> None:
    pod = _pod("secret", NODES[0], [_container("main", f"print('for the API server only'); {SLEEP}")])
    logs_cluster.core.create_namespaced_pod(namespace, pod)
    _wait_for_output(logs_cluster, namespace, "secret", "main", "for the API server only\n")
    path = f"/containerLogs/{namespace}/secret/main"
    pki = process_plane.pki

    # The API server's kubelet client certificate: the control that the endpoint answers at all.
    api_server = (str(pki.kubelet_client_cert), str(pki.kubelet_client_key))
    assert _get(process_plane, NODES[0], path, api_server) == (200, "for the API server only\n")
    # Another node serves its own pods alone; unknown names are 404 with the kubelet's words.
    assert _get(process_plane, NODES[1], path, api_server) == (404, 'pod "secret" does not exist\n')
    assert _get(process_plane, NODES[0], f"{path}x", api_server) == (
        404,
        'container "mainx" not found in pod "secret"\n',
    )
    # A certificate of the same CA for somebody else (the cluster admin): forbidden.
    status, body = _get(process_plane, NODES[0], path, (str(pki.admin_cert), str(pki.admin_key)))
    assert status == 403 and "for the API server only" not in body, body
    # No client certificate: the TLS handshake is refused.
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        _get(process_plane, NODES[0], path, None)


@pytest.mark.parametrize(
    ("text", "lines", "expected"),
    [
        (b"a\nb\nc\n", 1, b"c\n"),
        (b"a\nb\nc", 1, b"c"),  # a last line without its newline counts
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc\n", 5, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 0, b""),
        (b"", 3, b""),
        (b"\n\n", 1, b"\n"),
        (b"x" * 200_000 + b"\n" + b"y" * 70_000 + b"\n", 1, b"y" * 70_000 + b"\n"),  # across blocks
    ],
)
def test_tail_finds_the_last_lines(tmp_path: Path, text: bytes, lines: int, expected: bytes) -> None:
    prefix = b"--- the runner's start line\n"
    path = tmp_path / "log"
    path.write_bytes(prefix + text + b"--- the next run\n")
    with open(path, "rb") as file:
        start, end = len(prefix), len(prefix) + len(text)
        offset = tail_offset(file, start, end, lines)
        file.seek(offset)
        assert file.read(end - offset) == expected


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/pods", 404, "/containerLogs/"),
        ("/containerLogs/ns/pod", 400, "{container}"),
        ("/containerLogs/ns/pod/c?tailLines=-1", 400, "tailLines: must be at least 0"),
        ("/containerLogs/ns/pod/c?tailLines=many", 400, "tailLines: 'many' is not an integer"),
        ("/containerLogs/ns/pod/c?limitBytes=0", 400, "limitBytes: must be at least 1"),
        ("/containerLogs/ns/pod/c?follow=yes", 400, "follow: 'yes' is not a boolean"),
        ("/containerLogs/ns/pod/c?sinceSeconds=10", 400, "sinceSeconds"),
    ],
)
def test_bad_log_requests_are_answered_with_what_is_wrong(path: str, status: int, words: str) -> None:
    with pytest.raises(LogError, match=re.escape(words)) as raised:
        parse_request(path)
    assert raised.value.status == status


def test_a_log_request_reads_its_parameters() -> None:
    assert parse_request(
        "/containerLogs/ns/pod/c?tailLines=3&follow=true&previous=false&limitBytes=9&timestamps=false"
    ) == LogRequest("ns", "pod", "c", tail_lines=3, follow=True, previous=False, limit_bytes=9)
