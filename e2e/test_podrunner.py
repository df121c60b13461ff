# mypy: disable-error-code="arg-type,union-attr"
# (the kubernetes client takes plain dicts for bodies and types every model field as Optional.)
"""The process runner (the stand-in for kubelet on the drills' nodes) keeps what it reports true.

When the API server is away for longer than the node-monitor grace period (a drill stops it for
30 s; on a slow machine its restart adds more), the node lifecycle controller marks the runner's
nodes Unknown, taints them and marks their pods not Ready. Only the node's agent can undo that, as
a kubelet does: it posts the node's status again and patches its pods' conditions back to what it
sees. Without it every later drill finds its pods not Ready."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from e2e.backends import plane_cluster
from e2e.backends import process_plane as process_plane_of
from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane, ProcessNodeSpec
from e2e.podrunner import Runner, RunnerConfig, Unsupported, _newer, _resource_value
from e2e.waiting import wait_until

NODE = "runner-node-0"


@pytest.fixture(scope="module")
def process_plane() -> Iterator[ControlPlane]:
    with process_plane_of(ProcessNodeSpec(count=1, gpus=1, name_prefix="runner-node-")) as plane:
        yield plane


@pytest.fixture(scope="module")
def runner_cluster(process_plane: ControlPlane) -> Cluster:
    return plane_cluster(process_plane)


def _condition(conditions: list[Any] | None, kind: str) -> str | None:
    return next((c.status for c in conditions or [] if c.type == kind), None)


def _web_pod(name: str) -> dict[str, Any]:
    serve = (
        "import http.server as h; "
        "h.ThreadingHTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "web",
                    "image": "unused",
                    "command": [os.path.basename(sys.executable), "-c", serve],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                }
            ],
        },
    }


def test_the_runner_undoes_the_node_lifecycle_controllers_marks(runner_cluster: Cluster) -> None:
    core = runner_cluster.core
    with runner_cluster.namespace("runner") as namespace:
        _undo_marks(core, namespace)


def _undo_marks(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, _web_pod("web"))

    def pod_ready() -> bool:
        return _condition(core.read_namespaced_pod("web", namespace).status.conditions, "Ready") == "True"

    def node_healthy() -> bool:
        node = core.read_node(NODE)
        unreachable = [t for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        return _condition(node.status.conditions, "Ready") == "True" and not unreachable

    wait_until(pod_ready, 60, "the pod Ready")
    wait_until(node_healthy, 60, "the node Ready and untainted")

    # What the node lifecycle controller writes when a node's Lease looks too old.
    core.patch_node_status(
        NODE,
        {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "Unknown",
                        "reason": "NodeStatusUnknown",
                        "message": "Kubelet stopped posting node status.",
                    }
                ]
            }
        },
    )
    marked = core.patch_namespaced_pod_status(
        "web",
        namespace,
        {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}},
    )
    assert _condition(marked.status.conditions, "Ready") == "False"  # the mark landed (the runner may
    # already be undoing it: reading the pod again here could race with it)

    wait_until(pod_ready, 10, "the runner to mark its pod Ready again")
    wait_until(node_healthy, 60, "the runner to post its node Ready again (and the taints lifted)")
    # And it stays so: the runner does not flap with its own stale view.
    for _ in range(10):
        assert pod_ready()
        time.sleep(0.5)


ALLOCATABLE = {"cpu": "64", "memory": "512Gi"}
CONTAINER = {"resources": {"requests": {"cpu": "500m", "memory": "1.5Gi"}, "limits": {"cpu": "2100m"}}}


def _slow_web_pod(name: str, delay_s: float, startup_failures: int) -> dict[str, Any]:
    """A web server that listens only after `delay_s` (a process loading its weights), with a
    liveness probe that would restart it long before that, and a startup probe."""
    pod = _web_pod(name)
    container = pod["spec"]["containers"][0]
    container["command"][-1] = f"import time; time.sleep({delay_s}); " + container["command"][-1]
    get = {"path": "/", "port": 8080}
    container["livenessProbe"] = {"httpGet": get, "periodSeconds": 1, "failureThreshold": 2}
    container["startupProbe"] = {"httpGet": get, "periodSeconds": 1, "failureThreshold": startup_failures}
    return pod


def test_a_startup_probe_holds_the_liveness_probe_until_it_passes(runner_cluster: Cluster) -> None:
    """As the kubelet does: a slow start within the startup probe's budget is not restarted by
    the liveness probe, and reports started and Ready once it serves; one past the budget is
    restarted."""
    core = runner_cluster.core
    with runner_cluster.namespace("startup") as namespace:
        core.create_namespaced_pod(namespace, _slow_web_pod("slow", 6, 30))
        core.create_namespaced_pod(namespace, _slow_web_pod("stuck", 600, 3))

        def status(name: str) -> Any:
            return core.read_namespaced_pod(name, namespace).status

        def restarted(name: str) -> bool:
            statuses = status(name).container_statuses or []
            return bool(statuses) and statuses[0].restart_count >= 1

        wait_until(lambda: _condition(status("slow").conditions, "Ready") == "True", 60, "the slow pod Ready")
        container = status("slow").container_statuses[0]
        assert container.started and container.restart_count == 0, container
        wait_until(lambda: restarted("stuck"), 60, "the stuck pod restarted by its startup probe")
        assert not status("stuck").container_statuses[0].ready
        events = core.list_namespaced_event(namespace).items
        assert any("Startup probe failed" in (e.message or "") for e in events), [e.message for e in events]


@pytest.mark.parametrize(
    ("resource", "divisor", "value"),
    [
        ("requests.cpu", "1", "1"),  # whole cores, rounded up, as kubelet does
        ("requests.cpu", "1m", "500"),
        ("requests.cpu", None, "1"),  # divisor 1 by default
        ("limits.cpu", "1", "3"),
        ("requests.memory", "1Mi", "1536"),
        ("limits.memory", "1Gi", "512"),  # an unset limit is the node's allocatable
        ("requests.ephemeral-storage", None, "0"),  # an unset request is 0
    ],
)
def test_resource_field_refs_get_what_kubelet_gives(resource: str, divisor: str | None, value: str) -> None:
    ref = {"resource": resource} | ({"divisor": divisor} if divisor else {})
    assert _resource_value(CONTAINER, ref, ALLOCATABLE) == value
    assert _resource_value({}, {"resource": "requests.cpu", "divisor": "1"}, ALLOCATABLE) == "0"


@pytest.mark.parametrize(
    "ref", [{"resource": "requests.nvidia.com/gpu"}, {"resource": "requests.cpu", "divisor": "lots"}]
)
def test_resource_field_refs_the_runner_cannot_answer_are_refused(ref: dict[str, str]) -> None:
    with pytest.raises(Unsupported):
        _resource_value(CONTAINER, ref, ALLOCATABLE)


def test_a_pod_that_starts_after_a_config_error_keeps_no_stale_reason(runner_cluster: Cluster) -> None:
    """As the kubelet does: the reason a pod could not start (its ConfigMap not created yet) is
    reported while it lasts and cleared once the containers run (`kubectl get pods` shows a pod's
    status.reason over its phase, so a stale one reads as an error on a Ready pod)."""
    core = runner_cluster.core
    with runner_cluster.namespace("late-config") as namespace:
        pod = _web_pod("late")
        pod["spec"]["volumes"] = [{"name": "placement", "configMap": {"name": "placement"}}]
        pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "placement", "mountPath": "/placement"}]
        core.create_namespaced_pod(namespace, pod)

        def status() -> Any:
            return core.read_namespaced_pod("late", namespace).status

        def config_error() -> bool:
            statuses = status().container_statuses or []
            waiting = statuses[0].state.waiting if statuses else None
            return waiting is not None and waiting.reason == "CreateContainerConfigError"

        wait_until(config_error, 60, "the pod waiting on its ConfigMap")
        assert status().reason == "CreateContainerConfigError", status()
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "placement"}, "data": {"placement.json": "{}"}}
        )
        wait_until(lambda: _condition(status().conditions, "Ready") == "True", 60, "the pod Ready")
        ready = status()
        assert ready.reason is None and ready.message is None, ready
        state = ready.container_statuses[0].state
        assert state.running is not None and state.waiting is None, state


def test_volumes_can_show_changes_as_late_as_a_kubelet_does() -> None:
    """With ``volume_delay_s`` a refreshed volume gets the object as it was that long ago (the
    drills run with 60 s: a kubelet's sync period plus its cache's TTL); never an older one than it
    has (the resourceVersions say which is later)."""
    runner = Runner.__new__(Runner)  # the object cache alone: no API server, no nodes
    runner.settings = RunnerConfig("", [], 1, "", "", "", "", "", "", 443, "", volume_delay_s=0.3)
    runner.cache, runner.history = {}, {}
    key = ("ConfigMap", "ns", "placement")

    def config_map(version: str) -> dict[str, Any]:
        return {"metadata": {"name": "placement", "resourceVersion": version}}

    runner._cache(key, config_map("5"))
    assert runner.delayed(*key) is None  # not seen 0.3 s ago: the volume keeps what it has
    time.sleep(0.35)
    runner._cache(key, config_map("7"))
    assert runner.lookup(*key) == config_map("7")  # what a starting pod projects: the object now
    assert runner.delayed(*key) == config_map("5")
    time.sleep(0.35)
    assert runner.delayed(*key) == config_map("7")
    runner._cache(key, None)  # deleted: shown late too (and then a volume keeps its files)
    assert runner.delayed(*key) == config_map("7")
    # the states no delayed look can return any more are dropped
    assert [state for _, state in runner.history[key]] == [config_map("7"), None]
    assert _newer("10", "9") and not _newer("9", "10") and not _newer("7", "7")
