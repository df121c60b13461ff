"""Model revisions, blue/green: which pair of pools (slot) of a MoEService serves, and the moves
between them.

A MoEService has two slots for a pair of pools (:data:`eaas.operator.naming.SLOTS`). One serves:
the API's Service selects its attention pods. A change of the model's revision (``spec.model``:
``revision`` or ``checkpoint``, see ``ModelSpec.revision_id``) brings the new revision up in the
other slot, beside the serving pair, which keeps serving its own revision (other spec changes,
a new image, still reach it). When the new pair is settled (every pool Ready, nothing rolling,
no server down) the Service's selector moves to it: the switch. The old pair then retires in
order: its attention pods first (they finish the requests in flight, then go), its expert
servers once no attention pod of the pair is left. Reverting the revision before the switch
drops the new pair; after it, the revert is a rollout of its own. An answer never mixes
revisions: each attention pool routes to its own expert pool, and a client refuses servers of
another revision (``EAAS_MODEL_REVISION``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from eaas.operator import naming
from eaas.operator.api.common import ModelSpec
from eaas.operator.api.kinds import ATTENTIONPOOL, EXPERTPOOL
from eaas.operator.api.moeservice import MoEServiceSpec, SlotRevision
from eaas.operator.builders import moeservice as build
from eaas.operator.builders.common import merge_patch
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY, find
from eaas.operator.kube import KubeError
from eaas.operator.reconcile.context import APPLY_EVERY_S, Context


class NotOurs(Exception):
    """A child with the expected name exists but another object controls it."""


@dataclass
class Slots:
    """What a pass decided: the serving slot and its pools, and the other slot's pair if any."""

    serving: naming.Slot
    experts: dict[str, Any]
    attention: dict[str, Any]
    revision: str  # the serving revision
    rollout: SlotRevision | None = None  # a new revision coming up in the other slot
    retiring: SlotRevision | None = None  # the previous revision's pair, going


def serving_slot(body: Mapping[str, Any]) -> naming.Slot:
    slot = (body.get("status") or {}).get("servingSlot")
    return slot if slot in naming.SLOTS else "blue"


def advance(ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, deleting: bool) -> Slots:
    """Create or update the serving pair, bring a new revision up beside it, switch, retire."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    serving = serving_slot(body)
    other = naming.other_slot(serving)
    desired = spec.model.revision_id
    current = ctx.current(EXPERTPOOL.kind, namespace, naming.expert_pool_name(name, serving))
    serving_model = pool_model(current)
    if serving_model is None or serving_model.revision_id == desired:
        experts, attention = ensure_pair(ctx, body, spec, serving)
        retiring = None if deleting else retire(ctx, body, other, desired)
        return Slots(serving, experts, attention, desired, retiring=retiring)

    # A new revision: the serving pair keeps its model; everything else of the spec still applies.
    ctx.refresh.forget(("retired", namespace, name, other))  # the other slot fills: look at it again
    kept = spec.model_copy(update={"model": serving_model})
    experts, attention = ensure_pair(ctx, body, kept, serving)
    revision = serving_model.revision_id
    if deleting:
        return Slots(serving, experts, attention, revision)

    def coming(message: str) -> Slots:
        """The serving pair serves on while the new revision's pair comes up (`message`: why not yet)."""
        rollout = SlotRevision(revision=desired, slot=other, message=message)
        return Slots(serving, experts, attention, revision, rollout=rollout)

    pending = [
        pool
        for pool in (
            ctx.kube.get(EXPERTPOOL.kind, namespace, naming.expert_pool_name(name, other)),
            ctx.kube.get(ATTENTIONPOOL.kind, namespace, naming.attention_pool_name(name, other)),
        )
        if pool is not None
    ]
    stale = [p for p in pending if is_deleting(p) or (pool_model(p) or serving_model).revision_id != desired]
    if stale:  # a rollout superseded (or the previous pair still going): clear the slot first
        for pool in stale:
            delete_pool(ctx, body, pool)
        return coming(
            "waiting for " + ", ".join(f"{p['kind']} {p['metadata']['name']}" for p in stale) + " to go"
        )
    size = int((experts.get("spec") or {}).get("replicas") or spec.expert_pool.replicas)
    starting = spec.model_copy(update={"expert_pool": spec.expert_pool.model_copy(update={"replicas": size})})
    new_experts, new_attention = ensure_pair(ctx, body, starting, other)
    waiting = [
        f"{p['kind']} {p['metadata']['name']}: {why}"
        for p in (new_experts, new_attention)
        if (why := unsettled(p))
    ]
    if waiting:
        return coming("; ".join(waiting))
    ctx.event(
        body,
        "Normal",
        "RevisionSwitched",
        f"model revision {desired} serves (pools {new_attention['metadata']['name']}, "
        f"{new_experts['metadata']['name']}); revision {revision} drains",
    )
    retiring = SlotRevision(
        revision=revision, slot=serving, message="its attention pods finish their requests"
    )
    return Slots(other, new_experts, new_attention, desired, retiring=retiring)


def point_api_service(ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, slot: naming.Slot) -> None:
    """The MoEService's API Service, selecting `slot`'s attention pods (server-side applied when
    it changes, and every few minutes: :meth:`Context.apply_seldom`). A Service of that name that
    this MoEService does not control is left alone and reported."""
    desired = build.api_service(body, spec, slot)
    metadata = desired["metadata"]

    def ours() -> None:
        existing = ctx.kube.get("Service", metadata["namespace"], metadata["name"])
        if existing is not None:
            check_owner(body, {**existing, "kind": "Service"})

    ctx.apply_seldom(desired, first=ours)


def ensure_pair(
    ctx: Context, body: Mapping[str, Any], spec: MoEServiceSpec, slot: naming.Slot
) -> tuple[dict[str, Any], dict[str, Any]]:
    experts = ensure_child(ctx, body, build.expert_pool(body, spec, slot), ignore=("replicas",))
    attention = ensure_child(ctx, body, build.attention_pool(body, spec, slot), ignore=())
    return experts, attention


def retire(
    ctx: Context, body: Mapping[str, Any], slot: naming.Slot, serving_revision: str = ""
) -> SlotRevision | None:
    """Take down `slot`'s pair if it exists: the AttentionPool first, the ExpertPool once none of
    the attention pods is left (they finish their requests on the servers). None when gone.

    Once the slot was found empty (no pools, no server Leases left) while `serving_revision`
    serves, it is looked at again only every :data:`APPLY_EVERY_S`: the slot is filled only by a
    new revision's rollout, which changes the serving revision."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    cleared = ("retired", namespace, name, slot)
    if not ctx.refresh.due(cleared, APPLY_EVERY_S, serving_revision):
        return None
    attention_name = naming.attention_pool_name(name, slot)
    attention = ctx.kube.get(ATTENTIONPOOL.kind, namespace, attention_name)
    experts_name = naming.expert_pool_name(name, slot)
    experts = ctx.kube.get(EXPERTPOOL.kind, namespace, experts_name)
    if attention is None and experts is None:
        # Its servers may still be going (garbage collection): tell them again, every pass, that no
        # placement needs them. A server's own Lease write as SIGTERM arrives may drop the word.
        if not release_servers(ctx, namespace, experts_name):
            ctx.refresh.done(cleared, serving_revision)  # nothing left of the pair
        return None
    revision = next(
        (model.revision_id for model in map(pool_model, (experts, attention)) if model is not None), ""
    )
    if attention is not None:
        delete_pool(ctx, body, attention)
    pods = ctx.kube.list("Pod", namespace, naming.pool_selector(attention_name, naming.ATTENTION_COMPONENT))
    if pods:
        return SlotRevision(
            revision=revision, slot=slot, message=f"{len(pods)} attention pods finishing their requests"
        )
    if experts is None:
        return None
    release_servers(ctx, namespace, experts_name)
    delete_pool(ctx, body, experts)
    return SlotRevision(
        revision=revision, slot=slot, message=f"ExpertPool {experts['metadata']['name']} going"
    )


def release_servers(ctx: Context, namespace: str, name: str) -> int:
    """Tell a retiring pool's (`name`) servers, on their Leases, that no placement needs them: on
    SIGTERM they exit once no client holds a slot (none does: the pair's attention pods are gone),
    instead of serving nobody until their drain timeout. Returns how many Leases it has left."""
    released = {"metadata": {"annotations": {naming.RELEASED_ANNOTATION: "retired"}}}
    leases = ctx.kube.list("Lease", namespace, {naming.POOL_LABEL: name})
    for lease in leases:
        if naming.RELEASED_ANNOTATION in (lease["metadata"].get("annotations") or {}):
            continue
        try:
            ctx.kube.merge_patch("Lease", namespace, lease["metadata"]["name"], released)
        except KubeError as error:
            if error.status != 404:  # gone already: nothing to tell
                raise
    return len(leases)


def delete_pool(ctx: Context, body: Mapping[str, Any], pool: Mapping[str, Any]) -> None:
    """Delete one of this MoEService's pools (once: a pool already going is left to go)."""
    metadata = pool["metadata"]
    check_owner(body, pool)
    if is_deleting(pool):
        return
    if ctx.kube.delete(pool["kind"], metadata["namespace"], metadata["name"], metadata.get("uid")):
        ctx.event(body, "Normal", "Deleted", f"deleted {pool['kind']} {metadata['name']}")


def ensure_child(
    ctx: Context, owner: Mapping[str, Any], desired: dict[str, Any], ignore: tuple[str, ...]
) -> dict[str, Any]:
    """Create the pool, or merge-patch its spec to the desired one (except the `ignore`d fields)."""
    kind, namespace, name = desired["kind"], desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = ctx.current(kind, namespace, name)
    if current is None:
        created = ctx.kube.create(desired)
        if created is not None:
            ctx.store.saw(kind, created)
            ctx.event(owner, "Normal", "Created", f"created {kind} {name}")
            return created
        current = ctx.kube.get(kind, namespace, name) or desired
    check_owner(owner, current)
    old_spec = {k: v for k, v in (current.get("spec") or {}).items() if k not in ignore}
    new_spec = {k: v for k, v in desired["spec"].items() if k not in ignore}
    patch: dict[str, Any] = {}
    spec_patch = merge_patch(old_spec, new_spec)
    if spec_patch:
        patch["spec"] = spec_patch
    labels = current["metadata"].get("labels") or {}
    missing_labels = {k: v for k, v in desired["metadata"]["labels"].items() if labels.get(k) != v}
    if missing_labels:
        patch["metadata"] = {"labels": missing_labels}
    if patch:
        current = ctx.kube.merge_patch(kind, namespace, name, patch)
        ctx.store.saw(kind, current)
    return current


def check_owner(owner: Mapping[str, Any], child: Mapping[str, Any]) -> None:
    owners = [ref for ref in child["metadata"].get("ownerReferences") or [] if ref.get("controller")]
    if not any(ref.get("uid") == owner["metadata"]["uid"] for ref in owners):
        kind, name = child.get("kind", "object"), child["metadata"]["name"]
        raise NotOurs(f"{kind} {name} exists but is not controlled by this MoEService; rename or delete it")


def pool_model(pool: Mapping[str, Any] | None) -> ModelSpec | None:
    """The model a pool serves (None: no pool, or a spec that does not parse)."""
    if pool is None:
        return None
    try:
        return ModelSpec.from_k8s((pool.get("spec") or {}).get("model"))
    except ValidationError:
        return None


def is_deleting(pool: Mapping[str, Any]) -> bool:
    return bool(pool["metadata"].get("deletionTimestamp"))


def unsettled(pool: Mapping[str, Any]) -> str:
    """Why `pool` may not take the traffic yet ("" when it may): its status must be of its
    current generation, Ready, not progressing and not degraded."""
    status = pool.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(pool["metadata"].get("generation") or 0):
        return "status not observed yet"
    conditions = status.get("conditions")
    for type_, wanted in ((READY, "True"), (PROGRESSING, "False"), (DEGRADED, "False")):
        condition = find(conditions, type_)
        if condition is None or condition.get("status") != wanted:
            shown = (
                f"{condition.get('reason')}: {condition.get('message', '')}" if condition else "not reported"
            )
            return f"{type_} is not {wanted} ({shown})"
    return ""
