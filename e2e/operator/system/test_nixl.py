# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
"""The tiny MoEService with ``transport: nixl`` on the process nodes: each pod in its own network
namespace, so the attention clients reach the expert servers' NIXL agents (UCX over TCP, the
MoEService's ``spec.ucx`` default) across the pod network, as pods on different hosts would.

It serves completions equal to the reference through its Service, every slot the expert servers
hold is a ``nixl`` slot that answered requests (none over ``tcp``), and drills 2 (SIGKILL of an
expert server) and 3 (SIGSTOP) pass on it as they do on ``tcp`` (:mod:`test_drills`): no failed
request, answers equal to the reference, the interruption and the time to full R printed.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane
from e2e.operator.harness import OperatorProcess
from e2e.operator.system.conftest import pod_logs
from e2e.operator.system.workload import (
    NAME,
    System,
    completions_equal_reference,
    deploy,
    pod_url,
    ready,
    sigkill_drill,
    sigstop_drill,
)
from e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRANSPORT = "nixl"


@pytest.fixture(scope="module")
def system(
    cluster: Cluster, process_plane: ControlPlane, node_checkpoint: Path, system_operator: OperatorProcess
) -> Iterator[System]:
    """`kubectl apply` of the tiny MoEService with ``transport: nixl`` → Ready with every pod
    serving (its Service answers)."""
    with deploy(
        cluster,
        process_plane,
        node_checkpoint,
        system_operator,
        "nixl",
        customize=lambda manifest: manifest["spec"].__setitem__("transport", TRANSPORT),
    ) as deployed:
        yield deployed


def data_token(system: System) -> str:
    """The MoEService's data token (the first of its Secret's): the expert servers' /v1/slots
    answer only to it."""
    secret = system.cluster.core.read_namespaced_secret(f"{NAME}-data-token", system.namespace)
    return base64.b64decode(secret.data["tokens"]).decode().split()[0]


def attached_slots(system: System) -> dict[str, list[dict[str, Any]]]:
    """The attached (not OFFLINE) slots of every Ready expert server, from its /v1/slots, by pod."""
    token = data_token(system)
    slots = {}
    for pod in system.expert_pods():
        if pod.metadata.deletion_timestamp is None and ready(pod):
            request = urllib.request.Request(
                f"{pod_url(pod, 'control')}/v1/slots", headers={"Authorization": f"Bearer {token}"}
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                rows = json.loads(response.read())["slots"]
            slots[pod.metadata.name] = [row for row in rows if row["state"] != "OFFLINE"]
    return slots


def requests_by_transport(system: System) -> dict[str, dict[str, float]]:
    """Requests each Ready expert server answered (any status), by transport, from its /metrics."""
    counts: dict[str, dict[str, float]] = {}
    for pod in system.expert_pods():
        if pod.metadata.deletion_timestamp is None and ready(pod):
            text = urllib.request.urlopen(f"{pod_url(pod, 'control')}/metrics", timeout=5).read().decode()
            per = counts.setdefault(pod.metadata.name, {})
            for line in text.splitlines():
                if line.startswith("eaas_expert_server_requests_total{"):
                    labels, value = line.rsplit(" ", 1)
                    transport = labels.split('transport="', 1)[1].split('"', 1)[0]
                    per[transport] = per.get(transport, 0.0) + float(value)
    return counts


def check_serving_over_nixl(system: System) -> str:
    """Every Ready expert server holds one slot per attention pod, each a ``nixl`` slot that has
    answered requests, and has answered none over another transport (after a burst of completions
    equal to the reference); returns what was seen."""
    clients = len(system.attention_pods())

    def one_slot_per_client() -> bool:
        slots = attached_slots(system)
        return len(slots) == 3 and all(len(rows) == clients for rows in slots.values())

    try:
        wait_until(one_slot_per_client, 60, f"{clients} attached slot(s) on each of 3 expert servers")
    except AssertionError as error:
        logs = pod_logs(system.plane, system.namespace)
        raise AssertionError(f"{error}: {attached_slots(system)}\n{logs}") from None
    completions_equal_reference(system, 4)
    slots = attached_slots(system)
    assert len(slots) == 3, slots
    for pod, rows in slots.items():
        assert len(rows) == clients, (pod, rows)
        assert {row["transport"] for row in rows} == {TRANSPORT}, (pod, rows)  # not tcp
        assert all(row["requests"] > 0 for row in rows), (pod, rows)
    answered = requests_by_transport(system)
    for pod, per in answered.items():
        assert per.get(TRANSPORT, 0) > 0, (pod, per)
        assert not {t: n for t, n in per.items() if t != TRANSPORT and n}, (pod, per)
    return ", ".join(
        f"{pod}: {[(row['transport'], row['requests']) for row in rows]}"
        for pod, rows in sorted(slots.items())
    )


def test_completions_through_the_service_equal_the_reference(system: System) -> None:
    completions_equal_reference(system)


def test_expert_servers_answer_over_nixl(system: System) -> None:
    """The clients really use nixl: a silent fallback to tcp (or a server offering only tcp)
    leaves tcp slots, or tcp requests in the servers' metrics, and fails this."""
    seen = check_serving_over_nixl(system)
    print(f"\nnixl slots (transport, requests answered) per expert server: {seen}")


def test_sigkill_of_an_expert_server_loses_no_request(system: System) -> None:
    """Drill 2 on nixl: a crashed server's NIXL peers see its endpoint break; its replicas take
    its share at once, the kubelet restarts it, and the clients attach to it again over nixl."""
    sigkill_drill(system, "nixl drill 2 (SIGKILL)")
    check_serving_over_nixl(system)


def test_sigstop_of_an_expert_server_loses_no_request(system: System) -> None:
    """Drill 3 on nixl: a hung server (its UCX endpoints stay up); clients time it out, its Lease
    expires, the operator re-places its experts and replaces the pod, and the clients attach to
    the replacement over nixl."""
    sigstop_drill(system, "nixl drill 3 (SIGSTOP)")
    check_serving_over_nixl(system)
