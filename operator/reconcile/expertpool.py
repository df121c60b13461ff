"""ExpertPool reconcile: observe pods, Leases and the placement ConfigMap; take one planned step."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from eaas.operator import collector, expert_step, naming, planning
from eaas.operator import rebalance as rebalance_plan
from eaas.operator.api.kinds import EXPERTPOOL
from eaas.operator.api.pools import ExpertPoolSpec
from eaas.operator.builders import expertpool as build
from eaas.operator.conditions import PROGRESSING, find
from eaas.operator.kube import KubeError
from eaas.operator.reconcile.context import Context, describe_validation_error
from eaas.operator.renewals import timestamp
from eaas.operator.status import invalid_spec
from eaas.runtime.placement.placement import Placement, PlacementError

log = logging.getLogger("eaas.operator.expertpool")


def resync(ctx: Context, body: Mapping[str, Any]) -> None:
    """The periodic reconcile: also considers a load-based rebalance (at most every interval)."""
    reconcile(ctx, body, rebalance=True)


def reconcile(ctx: Context, body: Mapping[str, Any], rebalance: bool = False) -> None:
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    selector = build.selector(name)
    base_status: dict[str, Any] = {
        "selector": naming.selector_string(selector),
        "placementConfigMap": naming.placement_config_map_name(name),
    }
    try:
        spec = ExpertPoolSpec.from_k8s(body.get("spec"))
    except ValidationError as error:
        ctx.write_status(EXPERTPOOL.kind, body, base_status, invalid_spec(describe_validation_error(error)))
        return

    ctx.kube.apply(build.headless_service(body, spec))
    ctx.kube.apply(build.disruption_budget(body, spec))
    pods = {}
    uids = {}
    pod_objects = ctx.kube.list("Pod", namespace, selector)
    blind = ctx.kube.unreadable_at  # nothing seen before then: heartbeats unknown until then
    for pod in pod_objects:
        ordinal = naming.ordinal_of(name, pod["metadata"]["name"])
        if ordinal is not None:
            pods[ordinal] = pod_state(ordinal, pod, time.time(), blind)
            uids[ordinal] = pod["metadata"]["uid"]
    config_map = ctx.kube.get("ConfigMap", namespace, naming.placement_config_map_name(name))
    committed, pending, placement_error = read_placements(config_map)
    leases = ctx.kube.list("Lease", namespace, {naming.POOL_LABEL: name})
    now = time.time()
    observed = expert_step.Observed(
        pool=name,
        desired_replicas=spec.replicas,
        shape=planning.PoolShape.of(spec),
        template_hash=build.template_hash(spec),
        pods=pods,
        committed=committed,
        pending=pending,
        reports=server_reports(name, leases, now, blind, ctx.renewals.ages(namespace, name, leases, now)),
        placement_error=placement_error,
        last_version=int((body.get("status") or {}).get("placementVersion") or 0),
        heartbeat_timeout_s=spec.heartbeat.timeout_seconds,
        client_versions=client_versions(ctx, body, now),
    )
    observed = second_opinion(ctx, name, pod_objects, spec.port, observed)
    step = expert_step.plan(observed)
    if rebalance and committed is not None and expert_step.idle(step):
        proposal = propose_rebalance(ctx, (namespace, name), spec, committed, pod_objects)
        if proposal is not None:
            observed = replace(observed, rebalance=proposal.placement, rebalance_message=proposal.message)
            step = expert_step.plan(observed)
            published = step.publish is not None and step.publish[1] is proposal.placement
            ctx.metrics.rebalances.labels("rebalanced" if published else "skipped").inc()

    # Act: publish first (a created pod must find its experts), then pods, then tell the world.
    if step.publish is not None:
        new_committed, new_pending = step.publish
        ctx.kube.apply(build.placement_config_map(body, new_committed, new_pending))
        ctx.metrics.placement_changes.labels("committed" if new_pending is None else "proposed").inc()
        committed, pending = new_committed, new_pending
    for ordinal in step.create_pods:
        ctx.kube.create(build.pod(body, spec, ordinal))
    for ordinal in step.delete_pods:
        ctx.kube.delete("Pod", namespace, naming.pod_name(name, ordinal), uid=uids.get(ordinal))
    for ordinal in step.release:
        release(ctx, body, ordinal, committed)
    acted = step.publish is not None or bool(step.create_pods or step.delete_pods)
    reported = find((body.get("status") or {}).get("conditions"), PROGRESSING) or {}
    for event in step.events:
        if not acted and (reported.get("reason"), reported.get("message")) == (event.reason, event.message):
            continue  # a standing problem (e.g. PlacementFailed) is reported once, not every resync
        ctx.post_event(body, event.type, event.reason, event.message)

    live = [n for n in pods if not pods[n].terminating]
    live_servers = {n for n in (committed.ordinals if committed else ()) if observed.is_serving(n)}
    status = {
        **base_status,
        "replicas": len(live),
        "readyReplicas": sum(1 for n in live if pods[n].ready),
        "placementVersion": committed.version if committed else 0,
        "servers": list(committed.ordinals) if committed else [],
        "downServers": sorted(set(committed.ordinals) - live_servers) if committed else [],
        "fewestLiveReplicas": expert_step.live_replicas(committed, live_servers) if committed else 0,
        "utilizationMilli": expert_step.serving_utilization(observed.reports, committed, pending),
        "tokensPerSecond": expert_step.serving_utilization(
            observed.reports, committed, pending, "tokens_per_second"
        ),
    }
    ctx.write_status(EXPERTPOOL.kind, body, status, step.conditions)


def second_opinion(
    ctx: Context, pool: str, pods: Sequence[Mapping[str, Any]], port: int, observed: expert_step.Observed
) -> expert_step.Observed:
    """Before a server counts as lost for its lapsed heartbeat (or its pod reading not Ready), ask
    its control port: one that answers is alive and only cut off from the API server (after an
    outage, the pods' path to it can come back later than the operator's), so it is not re-placed.
    A hung or dead server does not answer."""
    placed = observed.committed.ordinals if observed.committed is not None else ()
    suspects = [n for n in placed if observed.lost(n)]
    if not suspects:
        return observed
    urls = collector.pod_control_urls(pool, pods, port, ready_only=False)
    alive = frozenset(n for n in suspects if n in urls and ctx.answers(urls[n]))
    for n in sorted(alive):
        log.warning(
            "expert server %s-%d: %s, but it answers on its control port: alive, not re-placed",
            pool,
            n,
            observed.lost(n),
        )
    return replace(observed, answering=alive) if alive else observed


def client_versions(ctx: Context, body: Mapping[str, Any], now: float) -> tuple[int, ...]:
    """The placement versions the live attention clients of the pool's MoEService route by, from
    their Leases (none for a pool no MoEService made)."""
    metadata = body["metadata"]
    service = (metadata.get("labels") or {}).get(naming.SERVICE_LABEL)
    if not service:
        return ()
    selector = {naming.SERVICE_LABEL: service, naming.COMPONENT_LABEL: naming.ATTENTION_COMPONENT}
    versions = []
    for lease in ctx.kube.list("Lease", metadata["namespace"], selector):
        version = _int((lease["metadata"].get("annotations") or {}).get(naming.LOADED_VERSION_ANNOTATION))
        if version is not None and not lease_expired(lease, now):
            versions.append(version)
    return tuple(versions)


def release(ctx: Context, body: Mapping[str, Any], ordinal: int, committed: Placement | None) -> None:
    """Tells a leaving server, on its Lease, that no committed placement names it any more."""
    assert committed is not None
    metadata = body["metadata"]
    pod = naming.pod_name(metadata["name"], ordinal)
    patch = {"metadata": {"annotations": {naming.RELEASED_ANNOTATION: str(committed.version)}}}
    try:
        ctx.kube.merge_patch("Lease", metadata["namespace"], pod, patch)
    except KubeError as error:
        if error.status != 404:  # gone already: nothing to tell
            raise
        return
    ctx.post_event(
        body,
        "Normal",
        "ServerReleased",
        f"expert server {pod} may go: placement v{committed.version} does not name it (it exits once "
        "no client holds a slot on it)",
    )


def propose_rebalance(
    ctx: Context,
    key: tuple[str, str],
    spec: ExpertPoolSpec,
    committed: Placement,
    pod_objects: Sequence[Mapping[str, Any]],
) -> rebalance_plan.Decision | None:
    """A new placement for the servers' measured load, or None (not due, off, or no change)."""
    assert ctx.rebalancer is not None
    urls = ctx.server_urls(key[1], pod_objects, spec.port)
    decision = ctx.rebalancer.tick(
        key,
        committed,
        urls,
        spec.placement.policy,
        spec.placement.rebalance_interval_seconds,
        capacity=spec.expert_slots_per_server,
    )
    if decision is None or decision.placement is None:
        return None
    return decision


def pod_state(
    ordinal: int, pod: Mapping[str, Any], now: float, blind_until: float = 0.0
) -> expert_step.PodState:
    """The pod as observed; it counts as unready only since `blind_until` at the earliest (the
    node lifecycle controller marks pods not Ready across an API-server outage)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    condition: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
    ready = condition.get("status") == "True"
    since = timestamp(condition.get("lastTransitionTime")) if condition and not ready else None
    if since is not None:
        since = max(since, blind_until)
    annotations = pod["metadata"].get("annotations") or {}
    return expert_step.PodState(
        ordinal=ordinal,
        ready=ready,
        terminating=bool(pod["metadata"].get("deletionTimestamp")),
        template_hash=annotations.get(naming.TEMPLATE_HASH_ANNOTATION, ""),
        uid=str(pod["metadata"].get("uid") or ""),
        retiring=annotations.get(naming.RETIRE_ANNOTATION, "false").lower() != "false",
        unready_seconds=max(0.0, now - since) if since is not None else 0.0,
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
    )


def read_placements(config_map: Mapping[str, Any] | None) -> tuple[Placement | None, Placement | None, str]:
    """(committed, pending, error) from the placement ConfigMap (all None/empty when it is absent)."""
    if config_map is None:
        return None, None, ""
    data = config_map.get("data") or {}
    placements: list[Placement | None] = []
    for key in (naming.PLACEMENT_KEY, naming.PENDING_KEY):
        try:
            placements.append(Placement.from_json(data[key]) if key in data else None)
        except PlacementError as error:
            return None, None, f"ConfigMap {config_map['metadata']['name']} key {key}: {error}"
    return placements[0], placements[1], ""


def server_reports(
    pool: str,
    leases: Sequence[Mapping[str, Any]],
    now: float,
    blind_until: float = 0.0,
    ages: Mapping[str, float] | None = None,
) -> dict[int, expert_step.ServerReport]:
    """Heartbeats of the pool's servers from their Leases (named after their pods). A Lease the
    operator could not have seen renewed (it could not read the API server until `blind_until`,
    Unix seconds: an outage, or its own start) is unknown, not expired: every server gets a full
    Lease duration from then, as the node lifecycle controller gives nodes after an outage. With
    `ages` (:class:`RenewalClock`) a Lease's age is how long ago the operator saw its last renewal,
    not ``now - renewTime``."""
    reports = {}
    for lease in leases:
        ordinal = naming.ordinal_of(pool, lease["metadata"]["name"])
        if ordinal is None:
            continue
        if ages is not None and lease["metadata"]["name"] in ages:
            duration = (lease.get("spec") or {}).get("leaseDurationSeconds") or 0
            seen = now - ages[lease["metadata"]["name"]]
            expired = now > max(seen, blind_until) + duration
        else:
            expired = lease_expired(lease, now, blind_until)
        annotations = lease["metadata"].get("annotations") or {}
        owners = [
            r.get("uid") for r in lease["metadata"].get("ownerReferences") or [] if r.get("kind") == "Pod"
        ]
        reports[ordinal] = expert_step.ServerReport(
            expired=expired,
            loaded_version=_int(annotations.get(naming.LOADED_VERSION_ANNOTATION)),
            utilization_milli=_within(_int(annotations.get(naming.UTILIZATION_ANNOTATION)), 1000),
            tokens_per_second=_within(_int(annotations.get(naming.TOKEN_RATE_ANNOTATION))),
            owner_uid=owners[0] if owners else None,
            leaving=naming.LEAVING_ANNOTATION in annotations,
            released=naming.RELEASED_ANNOTATION in annotations,
        )
    return reports


def lease_expired(lease: Mapping[str, Any], now: float, blind_until: float = 0.0) -> bool:
    """Not renewed within its duration (``now``: Unix seconds), counted from `blind_until` at the
    earliest (what could not be seen before then is not held against it)."""
    spec = lease.get("spec") or {}
    renewed = timestamp(spec.get("renewTime") or spec.get("acquireTime"))
    if renewed is None:
        return now > blind_until + (spec.get("leaseDurationSeconds") or 0) if blind_until else True
    return now > max(renewed, blind_until) + (spec.get("leaseDurationSeconds") or 0)


def clients_expert_wait(leases: Sequence[Mapping[str, Any]], now: float) -> int | None:
    """Mean expert wait per decoder step (us) of the attention clients whose Leases are live and
    carry one (``metric: expertWait``); None when none does."""
    values = []
    for lease in leases:
        value = _int((lease["metadata"].get("annotations") or {}).get(naming.EXPERT_WAIT_ANNOTATION))
        if value is not None and value >= 0 and not lease_expired(lease, now):
            values.append(value)
    return round(sum(values) / len(values)) if values else None


def clients_tpot(leases: Sequence[Mapping[str, Any]], now: float) -> int | None:
    """The highest p99 time per output token (us) of the attention clients whose Leases are live
    and carry one: the SLO holds for the pool when it holds for its worst client (None when none
    does)."""
    values = [
        value
        for lease in leases
        if (value := _int((lease["metadata"].get("annotations") or {}).get(naming.TPOT_ANNOTATION)))
        is not None
        and value > 0
        and not lease_expired(lease, now)
    ]
    return max(values) if values else None


def _within(value: int | None, most: int | None = None) -> int | None:
    """A reading as the status may hold it: None when negative or above `most` (a garbled or
    foreign annotation must not make the ExpertPool's status write fail validation)."""
    if value is None or value < 0 or (most is not None and value > most):
        return None
    return value


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
