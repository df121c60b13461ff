"""ExpertPool reconcile: observe pods, Leases and the placement ConfigMap; take one planned step."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from eaas.operator import collector, expert_step, naming, planning
from eaas.operator import rebalance as rebalance_plan
from eaas.operator.api.kinds import EXPERTPOOL
from eaas.operator.api.pools import ExpertPoolSpec
from eaas.operator.builders import expertpool as build
from eaas.operator.conditions import DEGRADED, PROGRESSING, Observation, find
from eaas.operator.kube import KubeError
from eaas.operator.reconcile.context import Context, describe_validation_error
from eaas.operator.renewals import timestamp
from eaas.operator.status import invalid_spec, pod_problem
from eaas.runtime.placement import stored
from eaas.runtime.placement.placement import Placement, PlacementError

log = logging.getLogger("eaas.operator.expertpool")

RECHECK_MARGIN_S = 0.05  # a reconcile scheduled for when a reported server's silence suffices
MAX_REPORTED = 1024  # ordinals read from one client's word
PLACEMENT_TOO_LARGE = "PlacementTooLarge"  # the reason when a placement cannot be stored
PROBE_REUSE_S = 1.0  # a control port's answer this recent (and within a heartbeat interval) stands


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

    ctx.apply_seldom(build.headless_service(body, spec))
    ctx.apply_seldom(build.disruption_budget(body, spec))
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
    committed, pending, placement_error = read_placements(config_map, ctx.placements)
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
        heartbeat_interval_s=spec.heartbeat.interval_seconds,
        max_servers_per_change=spec.max_servers_per_change,
    )
    versions, failed = clients(ctx, body, now)
    observed = replace(observed, client_versions=versions, reported=failed)
    observed = second_opinion(ctx, name, pod_objects, spec.port, observed)
    step = expert_step.plan(observed)
    waits = [w for n in observed.reported if (w := observed.suspect_in(n)) is not None]
    if waits:  # a server its clients fail over may count as lost soon: look again then
        ctx.recheck(EXPERTPOOL.kind, namespace, name, min(waits) + RECHECK_MARGIN_S)
    # The timer's pass scrapes and submits a plan; any pass picks a finished plan up (a finished
    # job asks for a reconcile of its pool: ``Context.recheck``).
    assert ctx.rebalancer is not None
    due = rebalance or ctx.rebalancer.has_plan((namespace, name))
    if due and committed is not None and expert_step.idle(step):
        proposal = propose_rebalance(ctx, (namespace, name), spec, committed, pod_objects)
        if proposal is not None:
            observed = replace(observed, rebalance=proposal.placement, rebalance_message=proposal.message)
            step = expert_step.plan(observed)
            published = step.publish is not None and step.publish[1] is proposal.placement
            ctx.metrics.rebalances.labels("rebalanced" if published else "skipped").inc()

    # Act: publish first (a created pod must find its experts), then pods, then tell the world.
    if step.publish is not None:
        new_committed, new_pending = step.publish
        unstored = publish(ctx, body, new_committed, new_pending)
        if unstored:
            step = not_stored(step, unstored, committed, pending)
        else:
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
        if (
            not acted
            and reported.get("reason") == event.reason
            and expert_step.tells(reported, event.message)
        ):
            continue  # a standing problem (e.g. PlacementFailed) is reported once, not every resync
        ctx.event(body, event.type, event.reason, event.message)
        log.log(
            logging.WARNING if event.type == "Warning" else logging.INFO,
            "ExpertPool %s/%s: %s: %s",
            namespace,
            name,
            event.reason,
            event.message,
        )

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
    """Ask the control port of each server that its heartbeat alone would call lost (a lapsed
    Lease, a pod reading not Ready) and of each server its clients fail over. One that answers
    is alive (cut off from the API server: after an outage, the pods' path to it can come back
    later than the operator's; or slow), so it is not re-placed; one whose host refuses the
    connection has no process listening; a hung one does not answer (``silent``). An answer the
    operator got within the last heartbeat interval (at most :data:`PROBE_REUSE_S`) is taken
    again rather than asked anew."""
    if observed.committed is None:
        return observed
    # The servers of the placement being loaded, else served: one a pending change leaves out
    # already is not acted on, so asking it would only slow the reconcile down.
    placed = (observed.pending or observed.committed).ordinals
    suspects = [n for n in placed if observed.lost(n) or n in observed.reported]
    if not suspects:
        return observed
    urls = collector.pod_control_urls(pool, pods, port, ready_only=False)
    asked = [n for n in suspects if n in urls]
    reuse = min(PROBE_REUSE_S, observed.heartbeat_interval_s)
    with ThreadPoolExecutor(max_workers=min(8, len(asked) or 1)) as pool_:
        probes = dict(zip(asked, pool_.map(lambda n: ctx.ask(urls[n], reuse), asked), strict=True))
    for n in sorted(asked):
        if probes[n] == "answers" and (why := observed.lost(n)):
            log.warning(
                "expert server %s-%d: %s, but it answers on its control port: alive, not re-placed",
                pool,
                n,
                why,
            )
    return replace(observed, probes=probes)


def clients(ctx: Context, body: Mapping[str, Any], now: float) -> tuple[tuple[int, ...], frozenset[int]]:
    """What the live attention clients of the pool's MoEService say on their Leases: the placement
    versions they route by, and the servers they fail over now (none for a pool no MoEService
    made). During a blue/green rollout only the clients of the pool's own slot: the other slot's
    clients route by the other ExpertPool's placements and ordinals."""
    metadata = body["metadata"]
    service = (metadata.get("labels") or {}).get(naming.SERVICE_LABEL)
    if not service:
        return (), frozenset()
    selector = {naming.SERVICE_LABEL: service, naming.COMPONENT_LABEL: naming.ATTENTION_COMPONENT}
    for slot in naming.SLOTS:
        if metadata["name"] == naming.expert_pool_name(service, slot):
            selector[naming.POOL_LABEL] = naming.attention_pool_name(service, slot)
    versions = []
    reported: set[int] = set()
    for lease in ctx.kube.list("Lease", metadata["namespace"], selector):
        if lease_expired(lease, now):
            continue
        annotations = lease["metadata"].get("annotations") or {}
        version = _int(annotations.get(naming.LOADED_VERSION_ANNOTATION))
        if version is not None:
            versions.append(version)
        reported |= failed_over(annotations.get(naming.FAILED_OVER_ANNOTATION))
    return tuple(versions), frozenset(reported)


def failed_over(value: str | None) -> frozenset[int]:
    """The ordinals of a client's FAILED_OVER_ANNOTATION (what does not parse is left out: a
    garbled word of one client must not make the operator act, nor stop it)."""
    ordinals = (_int(part.strip()) for part in (value or "").split(",")[:MAX_REPORTED])
    return frozenset(n for n in ordinals if n is not None and n >= 0)


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
    ctx.event(
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
        failover_factor=spec.placement.failover_factor_percent / 100,
        max_moves=spec.placement.max_expert_moves_per_rebalance,
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
        problem=pod_problem(pod),
    )


def publish(
    ctx: Context, body: Mapping[str, Any], committed: Placement | None, pending: Placement | None
) -> str:
    """Write the placement ConfigMap; "" when written, else why it cannot be stored (too large for
    a ConfigMap, by our count or the API server's). Other API errors are raised."""
    newest = pending if pending is not None else committed
    version = newest.version if newest is not None else 0
    name = naming.placement_config_map_name(body["metadata"]["name"])
    try:
        config_map = build.placement_config_map(body, committed, pending)
    except stored.PlacementTooLarge as error:
        return f"placement v{version} cannot be stored: {error} (ConfigMap {name})"
    try:
        ctx.kube.apply(config_map)
    except KubeError as error:
        if not too_large(error):
            raise
        size = sum(len(base64.b64decode(value)) for value in config_map["binaryData"].values())
        return (
            f"placement v{version} cannot be stored: the placement ConfigMap would hold {size} bytes; "
            f"the API server refused it ({error.status} {error.reason}: {error.api_message})"
        )
    return ""


def too_large(error: KubeError) -> bool:
    """The API server refused an object for its size (a ConfigMap's 1 MiB, or etcd's request limit)."""
    message = error.api_message.lower()
    return (
        error.status == 413
        or (error.status == 422 and "too long" in message)
        or "request is too large" in message
    )


def not_stored(
    step: expert_step.Step, why: str, committed: Placement | None, pending: Placement | None
) -> expert_step.Step:
    """The rest of `step` when its placement could not be written: pods of servers the stored
    placements name are still created (the others would find no experts), deletions and releases
    stand (they never depend on the new placement), and the pool says why in its conditions and
    one Warning Event. The next pass plans again from what is stored: re-homing a lost server
    never waits behind a change that cannot be written."""
    placed = set(committed.ordinals if committed else ()) | set(pending.ordinals if pending else ())
    conditions = [c for c in step.conditions if c.type not in (PROGRESSING, DEGRADED)]
    return replace(
        step,
        publish=None,
        create_pods=[n for n in step.create_pods if n in placed],
        events=[expert_step.Event(PLACEMENT_TOO_LARGE, why, "Warning")],
        conditions=[
            *conditions,
            Observation.of(PROGRESSING, False, PLACEMENT_TOO_LARGE, why),
            Observation.of(DEGRADED, True, PLACEMENT_TOO_LARGE, why),
        ],
        progressing=PLACEMENT_TOO_LARGE,
        progress_message=why,
    )


Placements = tuple[Placement | None, Placement | None, str]  # (committed, pending, error)


def read_placements(
    config_map: Mapping[str, Any] | None, parsed: dict[tuple[str, str], tuple[str, Placements]] | None = None
) -> Placements:
    """(committed, pending, error) from the placement ConfigMap (all None/empty when it is absent).
    With `parsed` ((namespace, name) -> (resourceVersion, result): :attr:`Context.placements`) a
    ConfigMap whose resourceVersion was read before is not decoded again (a DeepSeek-V3 placement
    of 64 servers takes milliseconds to decode, on every resync of every pool); Placements are
    immutable, so one object serves every pass."""
    if config_map is None:
        return None, None, ""
    metadata = config_map.get("metadata") or {}
    key, version = (
        (metadata.get("namespace") or "", metadata.get("name") or ""),
        metadata.get("resourceVersion"),
    )
    if parsed is not None and version and (known := parsed.get(key)) is not None and known[0] == version:
        return known[1]
    try:
        committed, pending = stored.read_config_map(config_map)
        result: Placements = (committed, pending, "")
    except PlacementError as error:
        result = (None, None, str(error))
    if parsed is not None and version:
        parsed[key] = (version, result)
    return result


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
            spec = lease.get("spec") or {}
            seen = timestamp(spec.get("renewTime") or spec.get("acquireTime")) or 0.0
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
            silent_s=max(0.0, now - max(seen, blind_until)),
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
