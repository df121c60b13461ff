"""MoEService reconcile: create/update its pools (a pair, two while a new model revision comes up:
:mod:`eaas.operator.reconcile.revisions`) and the API's Service, own ExpertPool replicas per the
autoscaling mode, and summarise the serving pools' status."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from eaas.operator import naming
from eaas.operator.api.kinds import ATTENTIONPOOL, EXPERTPOOL, MOESERVICE
from eaas.operator.api.moeservice import LearnedCapacity, MoEServiceSpec
from eaas.operator.autoscaler import HEADROOM, Autoscaler
from eaas.operator.builders import moeservice as build
from eaas.operator.builders.common import (
    data_token_secret,
    runtime_placement_role,
    runtime_placement_role_binding,
    runtime_role_binding,
    runtime_service_account,
)
from eaas.operator.builders.network import network_policies
from eaas.operator.conditions import PROGRESSING, Observation
from eaas.operator.kube import KubeError
from eaas.operator.reconcile import revisions
from eaas.operator.reconcile.context import Context, describe_validation_error
from eaas.operator.reconcile.expertpool import clients_expert_wait, clients_tpot
from eaas.operator.status import aggregate, invalid_spec
from eaas.runtime.contract import GROUP

logger = logging.getLogger("eaas.operator")
PERSIST_S = 60.0  # the learned capacity goes to the MoEService's status at most this often
PREREQUISITES_EVERY_S = 300.0  # the pods' ServiceAccount, RoleBinding and Secret: made sure of this often


def reconcile(ctx: Context, body: Mapping[str, Any]) -> None:
    try:
        spec = MoEServiceSpec.from_k8s(body.get("spec"))
    except ValidationError as error:
        ctx.write_status(
            MOESERVICE.kind, body, kept_status(body), invalid_spec(describe_validation_error(error))
        )
        return
    deleting = bool(body["metadata"].get("deletionTimestamp"))  # nothing new while it goes
    if not deleting:
        ensure_pod_prerequisites(ctx, body)  # before the pools: their pods use these
    try:
        slots = revisions.advance(ctx, body, spec, deleting)
        if not deleting:
            revisions.point_api_service(ctx, body, spec, slots.serving)
    except revisions.NotOurs as error:
        ctx.write_status(MOESERVICE.kind, body, kept_status(body), invalid_spec(str(error)))
        return
    experts, attention = slots.experts, slots.attention
    set_expert_replicas(ctx, body, spec, experts)
    if not deleting:
        apply_network_policies(ctx, body, spec)

    expert_status = experts.get("status") or {}
    status = {
        "attention": _counts(attention.get("status") or {}),
        "experts": _counts(expert_status),
        "placementVersion": int(expert_status.get("placementVersion") or 0),
        "endpoint": build.api_endpoint(body, spec),
        "revision": slots.revision,
        "servingSlot": slots.serving,
        "rollout": slots.rollout.to_k8s() if slots.rollout else None,
        "retiring": slots.retiring.to_k8s() if slots.retiring else None,
    }
    status["learnedCapacity"] = learned_capacity(ctx, body, spec, experts)
    observations = aggregate({EXPERTPOOL.kind: experts, ATTENTIONPOOL.kind: attention})
    if slots.rollout is not None:
        rollout = slots.rollout
        observations = [o for o in observations if o.type != PROGRESSING] + [
            Observation.of(
                PROGRESSING,
                True,
                "RevisionRollout",
                f"model revision {rollout.revision} coming up in slot {rollout.slot}: {rollout.message}",
            )
        ]
    ctx.write_status(MOESERVICE.kind, body, status, observations)


def kept_status(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a status written while the spec is refused keeps: the learned capacity (the spec
    fixed, the autoscaler goes on from it) and which slot serves which revision."""
    old = body.get("status") or {}
    kept = ("learnedCapacity", "servingSlot", "revision", "endpoint", "rollout", "retiring")
    return {key: old.get(key) for key in kept}


def ensure_pod_prerequisites(ctx: Context, body: Mapping[str, Any]) -> None:
    """What the pods need before they exist: their ServiceAccount, its RoleBinding to the runtime's
    ClusterRole and the Role (and RoleBinding) to read their placement ConfigMaps (both when the
    operator knows that ClusterRole) and the data-token Secret. Create-only (409 AlreadyExists when
    there), on the first pass and then every :data:`PREREQUISITES_EVERY_S`
    (:mod:`eaas.operator.refresh`), so a deleted one comes back (a Secret with a new token)."""
    name = body["metadata"]["name"]
    key = (MOESERVICE.kind, body["metadata"]["namespace"], name)
    if not ctx.refresh.due(key, PREREQUISITES_EVERY_S):
        return
    made = []
    if ctx.kube.create(runtime_service_account(body)) is not None:
        made.append(f"ServiceAccount {name}-runtime")
    if ctx.runtime_cluster_role and ctx.kube.create(runtime_role_binding(body, ctx.runtime_cluster_role)):
        made.append(f"RoleBinding {name}-runtime to ClusterRole {ctx.runtime_cluster_role}")
    if ctx.runtime_cluster_role:  # the operator manages the pods' access: their placement ConfigMaps too
        role = naming.runtime_placement_role_name(name)
        if ctx.kube.create(runtime_placement_role(body)) is not None:
            made.append(f"Role {role}")
        if ctx.kube.create(runtime_placement_role_binding(body)) is not None:
            made.append(f"RoleBinding {role}")
    if ctx.kube.create(data_token_secret(body)) is not None:
        made.append(f"Secret {name}-data-token")
    if made:
        ctx.event(body, "Normal", "Created", "created " + ", ".join(made))
    ctx.refresh.done(key)


def apply_network_policies(ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec) -> None:
    """The NetworkPolicies, server-side applied when they change (and every few minutes:
    :meth:`Context.apply_seldom`); removed when disabled."""
    for policy in network_policies(body, spec, ctx.operator_namespace):
        if spec.network_policy.enabled:
            ctx.apply_seldom(policy)
        else:
            ctx.delete_seldom("NetworkPolicy", policy["metadata"]["namespace"], policy["metadata"]["name"])


def set_expert_replicas(
    ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, pool: dict[str, Any]
) -> None:
    """Write ``ExpertPool.spec.replicas`` through ``/scale`` when this MoEService is its writer."""
    writer = build.replicas_writer(spec)
    current = int((pool.get("spec") or {}).get("replicas") or 0)
    metadata = pool["metadata"]
    key = (metadata["namespace"], metadata["name"])
    if writer == "external":
        ctx.rival_writers.discard(key)  # an HPA is welcome now
        return
    if rival := rival_autoscaler(ctx, *key):
        # Two writers would fight over the pool's size: leave it to the HPA and say so (once).
        if key not in ctx.rival_writers:
            ctx.rival_writers.add(key)
            ctx.event(
                body,
                "Warning",
                "ConflictingAutoscaler",
                f"HorizontalPodAutoscaler {rival} also scales ExpertPool {key[1]}: the operator leaves its "
                f"replicas alone while autoscaling.mode is {spec.autoscaling.mode}; delete the HPA or set "
                "spec.autoscaling.mode: external",
            )
        return
    if key in ctx.rival_writers:
        ctx.rival_writers.discard(key)
        ctx.event(body, "Normal", "AutoscalerConflictResolved", f"the operator scales {key[1]} again")
    reading = ""
    if writer == "moeservice":
        desired = spec.expert_pool.replicas
    else:
        autoscaler = ctx.autoscalers.get(key) or restored_autoscaler(ctx, body, spec, key)
        status = pool.get("status") or {}
        value, reading = autoscaling_metric(ctx, body, spec, status)
        tpot = None
        if spec.autoscaling.metric == "tokenRate" and spec.autoscaling.target_tokens_per_second is None:
            tpot = attention_leases(ctx, body, clients_tpot)
        desired = autoscaler.recommend(
            time.monotonic(), current, value, spec.autoscaling, carrying(status), tpot
        )
        if spec.autoscaling.metric == "tokenRate":
            reading += token_target_reading(autoscaler, spec, tpot)
    if desired == current:
        return
    ctx.kube.merge_patch(
        EXPERTPOOL.kind, metadata["namespace"], metadata["name"], {"spec": {"replicas": desired}}, "scale"
    )
    ctx.metrics.scale_writes.labels(writer).inc()
    pool.setdefault("spec", {})["replicas"] = desired
    reason = "ScaledUp" if desired > current else "ScaledDown"
    ctx.event(
        body,
        "Normal",
        reason,
        f"{metadata['name']}: {current} -> {desired} expert servers (writer: {writer}{reading})",
    )


def carrying(pool_status: Mapping[str, Any]) -> int | None:
    """How many servers carry the pool's load now, from its status: the Ready pods, but at most
    the live servers of the committed placement (clients route by it). A server whose pod is
    Ready while the placement that adds it is still pending carries nothing yet: counting it
    would multiply the per-server reading by one server too many and overshoot (a drill saw
    2 -> 3 -> 4 at once, then back to 2, under a steady load that needed 3)."""
    ready = pool_status.get("readyReplicas")
    servers = pool_status.get("servers")
    if not isinstance(servers, list):
        return ready if isinstance(ready, int) else None
    live = len(servers) - len(pool_status.get("downServers") or [])
    return live if not isinstance(ready, int) else min(ready, live)


def learns_capacity(spec: MoEServiceSpec) -> bool:
    """The built-in autoscaler on tokenRate with a learned target."""
    scaling = spec.autoscaling
    return (
        build.replicas_writer(spec) == "autoscaler"
        and scaling.metric == "tokenRate"
        and scaling.target_tokens_per_second is None
    )


def restored_autoscaler(
    ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, key: tuple[str, str]
) -> Autoscaler:
    """A new autoscaler for pool `key`, with the capacity a previous operator learned at this
    SLO (``status.learnedCapacity``), so that its target holds across a restart."""
    autoscaler = ctx.autoscalers[key] = Autoscaler()
    kept = (body.get("status") or {}).get("learnedCapacity")
    if kept is None or not learns_capacity(spec):
        return autoscaler
    try:
        learned = LearnedCapacity.from_k8s(kept)
    except ValidationError as error:
        logger.warning("%s: status.learnedCapacity unreadable, learning afresh: %s", key[1], error)
        return autoscaler
    if learned.slo_time_per_output_token_micros == spec.autoscaling.slo_time_per_output_token_millis * 1000:
        autoscaler.restore(learned)
        logger.info("%s: took back the learned capacity (%d bands of readings)", key[1], len(learned.bands))
    return autoscaler


def learned_capacity(
    ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, pool: Mapping[str, Any]
) -> dict[str, Any] | None:
    """``status.learnedCapacity``: the autoscaler's readings, written at most every
    ``PERSIST_S`` (a restart loses at most that much learning); the status's own while this
    operator has learned nothing yet at the SLO; none unless the target is learned."""
    if not learns_capacity(spec):
        return None
    slo = spec.autoscaling.slo_time_per_output_token_millis * 1000
    kept = (body.get("status") or {}).get("learnedCapacity")
    if isinstance(kept, dict) and kept.get("sloTimePerOutputTokenMicros") != slo:
        kept = None
    autoscaler = ctx.autoscalers.get((pool["metadata"]["namespace"], pool["metadata"]["name"]))
    learned = autoscaler.learned(slo) if autoscaler is not None else None
    if learned is None or autoscaler is None:
        return kept
    now = time.monotonic()
    if kept is not None and autoscaler.persisted is not None and now - autoscaler.persisted < PERSIST_S:
        return kept
    autoscaler.persisted = now
    return learned


def autoscaling_metric(
    ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, pool_status: Mapping[str, Any]
) -> tuple[int | None, str]:
    """The built-in autoscaler's input in ``autoscaler.target``'s units, and how it reads for an
    Event. ``busy``: the ExpertPool's ``utilizationMilli``; ``tokenRate``: its ``tokensPerSecond``;
    ``expertWait``: the mean over this MoEService's live attention clients' Leases (None, so the
    size holds, when none reports one or they cannot be listed)."""
    scaling = spec.autoscaling
    if scaling.metric == "busy":
        milli = pool_status.get("utilizationMilli")
        shown = f", busy {milli / 1000:.2f}" if milli is not None else ", no busy fraction reported"
        return milli, f"{shown}, target {scaling.target_utilization_milli / 1000:.2f}"
    if scaling.metric == "tokenRate":
        rate = pool_status.get("tokensPerSecond")
        return rate, f", {rate} tokens/s per server" if rate is not None else ", no token rate reported"
    micros = attention_leases(ctx, body, clients_expert_wait)
    shown = (
        f", expert wait {micros / 1000:.1f} ms per step"
        if micros is not None
        else ", no expert wait reported"
    )
    return micros, f"{shown}, target {scaling.target_expert_wait_millis} ms"


def attention_leases(
    ctx: Context, body: Mapping[str, Any], read: Callable[[Sequence[Mapping[str, Any]], float], int | None]
) -> int | None:
    """`read` (``clients_expert_wait``, ``clients_tpot``) of this MoEService's attention clients'
    Leases; None when they cannot be listed."""
    metadata = body["metadata"]
    selector = {naming.COMPONENT_LABEL: naming.ATTENTION_COMPONENT, naming.SERVICE_LABEL: metadata["name"]}
    try:
        return read(ctx.kube.list("Lease", metadata["namespace"], selector), time.time())
    except KubeError as error:
        logger.warning("cannot list the attention clients' Leases of %s: %s", metadata["name"], error)
        return None


def token_target_reading(autoscaler: Autoscaler, spec: MoEServiceSpec, tpot: int | None) -> str:
    """How an Event names the tokenRate target: hand-set, or learned (from what, or why not yet)."""
    scaling = spec.autoscaling
    if scaling.target_tokens_per_second is not None:
        return f", target {scaling.target_tokens_per_second}"
    slo = scaling.slo_time_per_output_token_millis
    shown = (
        f"clients' p99 time per output token {tpot / 1000:.1f} ms" if tpot else "no time per token reported"
    )
    if autoscaler.per_server is None:
        return f", {shown}; no target learned yet ({autoscaler.reason})"
    capacity = autoscaler.per_server / HEADROOM
    return (
        f", {shown}; target {autoscaler.per_server:.0f} = {HEADROOM:g} x {capacity:.0f} tokens/s a server "
        f"carries at the SLO ({slo} ms), learned: {autoscaler.reason}"
    )


def rival_autoscaler(ctx: Context, namespace: str, pool: str) -> str | None:
    """The name of a HorizontalPodAutoscaler (KEDA's included) that targets ExpertPool `pool`, if
    any. When they cannot be listed (an older chart without the grant) none is assumed."""
    try:
        autoscalers = ctx.kube.list("HorizontalPodAutoscaler", namespace, {})
    except KubeError as error:
        logger.info("cannot list HorizontalPodAutoscalers in %s: %s", namespace, error)
        return None
    for hpa in autoscalers:
        target = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(target.get("apiVersion", "")).split("/")[0]
        if target.get("kind") == EXPERTPOOL.kind and target.get("name") == pool and group == GROUP:
            return str(hpa["metadata"]["name"])
    return None


def _counts(status: Mapping[str, Any]) -> dict[str, int]:
    return {
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": int(status.get("readyReplicas") or 0),
    }
