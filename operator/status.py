"""Conditions of AttentionPools and MoEServices from what their children report (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eaas.operator.conditions import DEGRADED, PROGRESSING, READY, Observation, find


def deployment_conditions(
    desired: int, deployment: Mapping[str, Any] | None, generation_seen: bool
) -> list[Observation]:
    """An AttentionPool's conditions from its Deployment (None: not created yet).

    Ready: at least one client is Ready (the API answers); Degraded: fewer Ready than desired once
    the rollout is done; Progressing: the Deployment has not caught up with its spec yet.
    """
    if deployment is None:
        return [
            Observation.of(READY, False, "Creating", "the Deployment does not exist yet"),
            Observation.of(PROGRESSING, True, "Creating", "creating the Deployment"),
            Observation.of(DEGRADED, False, "Creating", "nothing is running yet"),
        ]
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    rolling = not generation_seen or updated < desired or total > desired
    progressing = Observation.of(
        PROGRESSING,
        rolling,
        "RollingOut" if rolling else "Stable",
        f"{updated}/{desired} clients updated, {total} running"
        if rolling
        else f"{desired} clients up to date",
    )
    ready_condition = Observation.of(
        READY,
        ready >= 1,
        "ClientsReady" if ready >= 1 else "NoClientReady",
        f"{ready}/{desired} attention clients Ready",
    )
    short = ready < desired and not rolling
    degraded = Observation.of(
        DEGRADED,
        short,
        "ClientsUnavailable" if short else "AllClientsReady" if ready >= desired else "RollingOut",
        f"{ready}/{desired} attention clients Ready",
    )
    return [ready_condition, progressing, degraded]


def aggregate(children: Mapping[str, Mapping[str, Any] | None]) -> list[Observation]:
    """A MoEService's conditions from its pools (name → the pool object, None if missing).

    Ready when every pool is Ready; Progressing when any is, or when any has not yet acted on its
    latest spec (``status.observedGeneration`` below ``metadata.generation``: its conditions still
    describe the spec before, e.g. right after the MoEService changed its replicas); Degraded when
    any is.
    """
    missing = [name for name, child in children.items() if child is None]
    if missing:
        return [
            Observation.of(READY, False, "Creating", f"creating {', '.join(missing)}"),
            Observation.of(PROGRESSING, True, "Creating", f"creating {', '.join(missing)}"),
            Observation.of(DEGRADED, False, "Creating", "nothing is running yet"),
        ]

    def with_status(type_: str, status: str) -> list[tuple[str, dict[str, Any]]]:
        found = []
        for name, child in children.items():
            condition = find((child or {}).get("status", {}).get("conditions"), type_)
            if condition is not None and condition.get("status") == status:
                found.append((name, condition))
        return found

    def describe(items: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(f"{name}: {c.get('reason')}: {c.get('message', '')}" for name, c in items)

    ready = with_status(READY, "True")
    not_ready = [
        (n, find((c or {}).get("status", {}).get("conditions"), READY) or {"reason": "Unknown"})
        for n, c in children.items()
        if n not in dict(ready)
    ]
    progressing = with_status(PROGRESSING, "True")
    for name, child in children.items():
        generation = int(((child or {}).get("metadata") or {}).get("generation") or 0)
        observed = int(((child or {}).get("status") or {}).get("observedGeneration") or 0)
        if observed < generation and name not in dict(progressing):
            progressing.append(
                (
                    name,
                    {
                        "reason": "SpecNotObserved",
                        "message": f"generation {generation} not acted on yet (last {observed})",
                    },
                )
            )
    degraded = with_status(DEGRADED, "True")
    return [
        Observation.of(READY, True, "Serving", "every pool is Ready")
        if not not_ready
        else Observation.of(READY, False, "PoolsNotReady", describe(not_ready)),
        Observation.of(PROGRESSING, True, "PoolsProgressing", describe(progressing))
        if progressing
        else Observation.of(PROGRESSING, False, "Stable", "no change in flight"),
        Observation.of(DEGRADED, True, "PoolsDegraded", describe(degraded))
        if degraded
        else Observation.of(DEGRADED, False, "Healthy", "no pool is degraded"),
    ]


def invalid_spec(message: str) -> list[Observation]:
    """Conditions of an object whose spec the operator cannot use (it changes nothing)."""
    return [
        Observation.of(READY, False, "InvalidSpec", message),
        Observation.of(PROGRESSING, False, "InvalidSpec", "fix the spec; nothing is changed until then"),
        Observation.of(DEGRADED, True, "InvalidSpec", message),
    ]


POD_PROBLEM_CHARS = 240  # a pod's blocking reason is cut to this in a condition message
STARTING = frozenset({"ContainerCreating", "PodInitializing"})  # waiting reasons of a pod on its way


def pod_problem(pod: Mapping[str, Any]) -> str:
    """What keeps a pod from running, as its status says ("" when nothing does, or it is only
    starting): a failed scheduling, a container waiting for another reason than its start (with
    its last exit code when it keeps failing), one that exited and stays down, the pod's own
    reason. At most :data:`POD_PROBLEM_CHARS` characters."""
    status = pod.get("status") or {}
    text = ""
    scheduled = find(status.get("conditions"), "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        text = _reason(scheduled.get("reason") or "Unschedulable", scheduled.get("message"))
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in containers:
        if text:
            break
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        terminated = state.get("terminated") or {}
        if waiting.get("reason") and waiting["reason"] not in STARTING:
            text = _reason(waiting["reason"], waiting.get("message"))
            last = (container.get("lastState") or {}).get("terminated") or {}
            if last.get("exitCode") is not None:
                text += f"; last exit code {last['exitCode']}" + (
                    f" ({last['reason']})" if last.get("reason") else ""
                )
        elif terminated.get("exitCode"):
            text = _reason(terminated.get("reason") or "Terminated", f"exit code {terminated['exitCode']}")
    if not text and status.get("reason"):
        text = _reason(status["reason"], status.get("message"))
    return text[:POD_PROBLEM_CHARS]


def _reason(reason: str, message: str | None) -> str:
    return f"{reason}: {message}" if message else reason
