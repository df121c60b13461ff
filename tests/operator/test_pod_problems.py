"""What keeps an ExpertPool's pods from starting reaches its conditions and its MoEService's.

A MoEService whose checkpoint path does not exist, or whose servers keep crashing, would otherwise
say only that it waits for its servers: the cause was on the pods alone."""

from __future__ import annotations

from typing import Any

from eaas.operator import planning
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY, Observation, find, merge
from eaas.operator.expert_step import Observed, plan, tells
from eaas.operator.reconcile.expertpool import pod_state
from eaas.operator.status import POD_PROBLEM_CHARS, aggregate, pod_problem

SHAPE = planning.PoolShape(layers=(0, 1), num_experts=4, replication=1)
NOW = 1_000_000.0


def _pod(
    name: str,
    waiting: tuple[str, str] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    last_exit: int | None = None,
) -> dict[str, Any]:
    state = {"waiting": {"reason": waiting[0], "message": waiting[1]}} if waiting else {"running": {}}
    container: dict[str, Any] = {"name": "server", "ready": False, "restartCount": 0, "state": state}
    if last_exit is not None:
        container["lastState"] = {"terminated": {"exitCode": last_exit, "reason": "Error"}}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "annotations": {}},
        "spec": {},
        "status": {
            "phase": "Pending",
            "conditions": conditions or [{"type": "Ready", "status": "False"}],
            "containerStatuses": [container],
        },
    }


CONFIG_ERROR = ("CreateContainerConfigError", "volume weights: hostPath /x is not a directory")


def test_a_pods_blocking_reason_is_read_from_its_status() -> None:
    assert pod_problem(_pod("p-0", CONFIG_ERROR)) == (
        "CreateContainerConfigError: volume weights: hostPath /x is not a directory"
    )
    crashing = pod_problem(_pod("p-0", ("CrashLoopBackOff", "back-off 10s restarting"), last_exit=1))
    assert crashing == "CrashLoopBackOff: back-off 10s restarting; last exit code 1 (Error)"
    unschedulable = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes fit"}
    ]
    assert pod_problem(_pod("p-0", conditions=unschedulable)) == "Unschedulable: 0/3 nodes fit"
    # Starting, or running while it loads: nothing to report.
    assert pod_problem(_pod("p-0", ("ContainerCreating", ""))) == ""
    assert pod_problem(_pod("p-0")) == ""
    assert pod_problem({"metadata": {"name": "p-0"}}) == ""
    assert len(pod_problem(_pod("p-0", ("ErrImagePull", "x" * 10_000)))) == POD_PROBLEM_CHARS


def _first_placement_conditions(pods: dict[str, dict[str, Any]]) -> list[Observation]:
    """The ExpertPool's conditions while its first placement waits for its servers."""
    states = {n: pod_state(n, pod, NOW) for n, pod in enumerate(pods.values())}
    pending = planning.initial(SHAPE, dict.fromkeys(states), {})
    step = plan(
        Observed(
            pool="tiny-experts",
            desired_replicas=len(states),
            shape=SHAPE,
            template_hash="",
            pods=states,
            committed=None,
            pending=pending,
        )
    )
    return step.conditions


def test_the_pools_and_the_services_conditions_name_the_cause() -> None:
    observations = _first_placement_conditions(
        {"tiny-experts-0": _pod("tiny-experts-0", CONFIG_ERROR), "tiny-experts-1": _pod("tiny-experts-1")}
    )
    cause = "pod tiny-experts-0: CreateContainerConfigError: volume weights: hostPath /x is not a directory"
    by_type = {o.type: o for o in observations}
    assert by_type[PROGRESSING].status == "True"
    assert by_type[PROGRESSING].message.startswith("waiting for servers [0, 1] to load placement v1")
    assert cause in by_type[PROGRESSING].message
    assert cause in by_type[READY].message
    assert "tiny-experts-1" not in by_type[PROGRESSING].message  # running (loading): no problem

    pool = {"status": {"conditions": merge(None, observations, 1)}}
    attention = {"status": {"conditions": merge(None, [Observation.of(READY, True, "ClientsReady")], 1)}}
    service = {o.type: o for o in aggregate({"tiny-experts": pool, "tiny-attention": attention})}
    assert cause in service[PROGRESSING].message
    assert cause in service[READY].message
    assert find(pool["status"]["conditions"], DEGRADED) is not None


def test_the_named_causes_are_bounded() -> None:
    pods = {f"p-{n}": _pod(f"p-{n}", ("ErrImagePull", f"{n}" * 5_000)) for n in range(10)}
    progressing = next(o for o in _first_placement_conditions(pods) if o.type == PROGRESSING)
    assert "pod tiny-experts-0: ErrImagePull" in progressing.message
    assert "tiny-experts-9" not in progressing.message
    assert "7 more" in progressing.message
    assert len(progressing.message) < 4 * POD_PROBLEM_CHARS + 200


def test_a_degraded_pool_names_why_its_servers_are_down() -> None:
    ready = _pod("tiny-experts-0", conditions=[{"type": "Ready", "status": "True"}])
    crashing = _pod("tiny-experts-1", ("CrashLoopBackOff", "back-off 40s restarting"), last_exit=1)
    states = {0: pod_state(0, ready, NOW), 1: pod_state(1, crashing, NOW)}
    committed = planning.initial(SHAPE, dict.fromkeys(states), {})
    step = plan(Observed("tiny-experts", 2, SHAPE, "", states, committed=committed, pending=None))
    degraded = next(o for o in step.conditions if o.type == DEGRADED)
    assert (degraded.status, degraded.reason) == ("True", "ServersUnavailable")
    assert (
        "pod tiny-experts-1: CrashLoopBackOff: back-off 40s restarting; last exit code 1" in degraded.message
    )
    assert "tiny-experts-0:" not in degraded.message


def test_a_standing_problem_is_still_told_once_with_the_pods_named() -> None:
    """The reconcile posts a standing problem's Event only when the Progressing condition does not
    tell it already; the pods named after it do not make it new."""
    said = {"message": "no room (pod p-0: CreateContainerConfigError: x)"}
    assert tells(said, "no room")
    assert tells({"message": "no room"}, "no room")
    assert not tells(said, "no")
    assert not tells({"message": "no room for 2"}, "no room")
