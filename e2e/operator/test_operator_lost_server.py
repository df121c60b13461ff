# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
# (the kubernetes client types every model field as Optional; a None here is a test failure anyway.)
"""A lost expert server on a real control plane: its heartbeat Lease expires → the operator
re-places its experts on the survivors (R kept), commits that, deletes the lost pod, and brings
the pool back to its size.

The pods here run nothing (kwok marks them Running), so the test writes the Lease a server would
write: owned by the pod, in the pool, last renewed long ago (what a crashed or hung server leaves).
"""

from __future__ import annotations

import datetime
import time

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.operator.harness import OperatorProcess
from e2e.operator.test_operator_lifecycle import (
    POOL,
    apply_tiny,
    committed,
    expert_pods,
    get,
    wait_ready,
)
from e2e.waiting import wait_until
from eaas.runtime import contract
from eaas.runtime.placement.placement import Placement

pytestmark = pytest.mark.e2e


def stale_lease(pod: client.V1Pod, seconds_ago: float) -> dict:
    """The Lease a server of `pod` leaves behind when it stops renewing (as the runtime writes it)."""
    renewed = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    stamp = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "metadata": {
            "name": pod.metadata.name,
            "labels": {contract.POOL_LABEL: POOL, contract.COMPONENT_LABEL: contract.EXPERT_COMPONENT},
            "annotations": {contract.LOADED_VERSION_ANNOTATION: "1", contract.UTILIZATION_ANNOTATION: "0"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
            ],
        },
        "spec": {
            "holderIdentity": pod.metadata.name,
            "leaseDurationSeconds": 10,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }


def test_a_lost_server_is_re_placed_then_replaced(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_tiny(cluster, namespace)
    first = wait_ready(cluster, namespace, servers=3)
    assert first.ordinals == (0, 1, 2)

    lost = expert_pods(cluster, namespace)[f"{POOL}-1"]
    started = time.monotonic()
    cluster.coordination.create_namespaced_lease(namespace, stale_lease(lost, seconds_ago=60))

    # The placement without server 1 is committed (R kept on 0 and 2) before its pod goes.
    def re_placed() -> Placement | None:
        placement = committed(cluster, namespace)
        return placement if placement is not None and 1 not in placement.ordinals else None

    without = wait_until(re_placed, 60, "a committed placement without the lost server", interval=0.3)
    assert without.version > first.version and without.replica_counts().min() >= 2
    re_placed_s = time.monotonic() - started

    # The lost pod is deleted and the pool grows back to 3 with a new server, one at a time.
    final = wait_ready(cluster, namespace, servers=3)
    back_s = time.monotonic() - started
    assert final.ordinals == (0, 2, 3) and final.replica_counts().min() >= 2
    assert f"{POOL}-1" not in expert_pods(cluster, namespace)
    pool = get(cluster, "expertpools", namespace, POOL)
    assert pool["status"]["downServers"] == [] and pool["status"]["fewestLiveReplicas"] >= 2

    events = cluster.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={POOL}").items
    lost_events = [e for e in events if e.reason == "ServerLost"]
    assert len(lost_events) == 1 and lost_events[0].type == "Warning"
    assert f"{POOL}-1 (its Lease was not renewed for 10 s)" in lost_events[0].message
    assert {"PlacementCommitted", "ServerRemoved", "ScalingUp"} <= {e.reason for e in events}
    print(f"lost server re-placed in {re_placed_s:.1f} s; pool back to 3 servers in {back_s:.1f} s")


def test_retiring_a_chosen_server_drains_exactly_that_one(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_tiny(cluster, namespace)
    first = wait_ready(cluster, namespace, servers=3)
    uids = {name: pod.metadata.uid for name, pod in expert_pods(cluster, namespace).items()}

    for _ in range(2):  # asking twice is asking once
        cluster.kubectl("annotate", "--overwrite", "pod", f"{POOL}-1", "eaas.io/retire=true", "-n", namespace)

    def retired() -> Placement | None:
        placement = committed(cluster, namespace)
        pods = expert_pods(cluster, namespace)
        if placement is None or placement.ordinals != (0, 2, 3) or f"{POOL}-1" in pods or len(pods) != 3:
            return None
        return placement

    final = wait_until(retired, 90, "server 1 retired and replaced by server 3", interval=0.3)
    assert final.version > first.version and final.replica_counts().min() >= 2
    pods = expert_pods(cluster, namespace)
    assert {name: pods[name].metadata.uid for name in (f"{POOL}-0", f"{POOL}-2")} == {
        name: uids[name] for name in (f"{POOL}-0", f"{POOL}-2")
    }, "only the chosen server may leave"
    reasons = [
        e.reason
        for e in cluster.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={POOL}"
        ).items
    ]
    assert reasons.count("Retiring") == 1 and "ScalingUp" in reasons
