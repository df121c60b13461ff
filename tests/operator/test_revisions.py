"""Model revisions, blue/green (`eaas.operator.reconcile.revisions`), through the MoEService reconcile:
the new revision's pair comes up beside the serving one, the API's Service moves when the pair is
settled, the old pair retires attention first; a revert before the switch drops the new pair, a
second revision supersedes the first. The API server is an in-memory stand-in (the real one, with
pods that run, is drill 5 in e2e/operator/system/test_drills.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from memory_kube import MemoryKube, patched
from prometheus_client import CollectorRegistry

from eaas.operator import naming
from eaas.operator.api import AttentionPoolSpec, MoEServiceSpec
from eaas.operator.builders import attentionpool as attention_build
from eaas.operator.builders.common import merge_patch
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile import moeservice
from eaas.operator.reconcile.context import Context


class Plane:
    """A MoEService in a MemoryKube, reconciled pass by pass; pools settle when told."""

    def __init__(self, service: dict[str, Any]) -> None:
        self.kube = MemoryKube()
        self.events: list[tuple[str, str]] = []
        self.ctx = Context(
            kube=self.kube,  # type: ignore[arg-type]
            metrics=OperatorMetrics(CollectorRegistry()),
            post_event=lambda obj, type_, reason, message: self.events.append((reason, message)),
        )
        service = copy.deepcopy(service)
        service["spec"]["autoscaling"] = {"mode": "off"}
        self.kube.objects[("MoEService", "tiny")] = service

    @property
    def service(self) -> dict[str, Any]:
        return self.kube.objects[("MoEService", "tiny")]

    def reconcile(self) -> dict[str, Any]:
        self.watch()
        moeservice.reconcile(self.ctx, copy.deepcopy(self.service))
        return self.service.get("status") or {}

    def watch(self) -> None:
        """What kopf's watch has delivered by the next pass: every pool as it is now, and the
        deletion of those gone (the stand-in keeps no resourceVersions: the newest is the stored one)."""
        for kind in ("ExpertPool", "AttentionPool"):
            for name in ("tiny-experts", "tiny-green-experts", "tiny-attention", "tiny-green-attention"):
                obj = self.kube.objects.get((kind, name))
                if obj is not None:
                    self.ctx.store.forget(kind, "ns", name)
                    self.ctx.store.saw(kind, obj)
                else:
                    self.ctx.store.forget(kind, "ns", name)

    def edit(self, **model: Any) -> None:
        spec = self.service["spec"]
        spec["model"] = {**spec["model"], **model}
        self.service["metadata"]["generation"] += 1

    def pool(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.kube.objects.get((kind, name))

    def settle(self, *names: str) -> None:
        """The pools report Ready, not progressing, not degraded, at their generation."""
        for name in names:
            kind = "ExpertPool" if name.endswith("-experts") else "AttentionPool"
            pool = self.kube.objects[(kind, name)]
            conditions = [
                {"type": "Ready", "status": "True", "reason": "Up"},
                {"type": "Progressing", "status": "False", "reason": "Stable"},
                {"type": "Degraded", "status": "False", "reason": "AllUp"},
            ]
            pool["status"] = {"observedGeneration": pool["metadata"]["generation"], "conditions": conditions}

    def api_selector(self) -> dict[str, str]:
        return self.kube.objects[("Service", "tiny")]["spec"]["selector"]


@pytest.fixture
def plane(moes_body: dict[str, Any]) -> Plane:
    """The tiny MoEService (autoscaling off), reconciled by nothing yet."""
    return Plane(moes_body)


BLUE = ("tiny-experts", "tiny-attention")
GREEN = ("tiny-green-experts", "tiny-green-attention")


def attention_selector(pool: str) -> dict[str, str]:
    return naming.pool_selector(pool, naming.ATTENTION_COMPONENT)


def model_of(plane: Plane, kind: str, name: str) -> dict[str, Any]:
    pool = plane.pool(kind, name)
    assert pool is not None, f"{kind} {name} missing"
    return pool["spec"]["model"]


def test_a_new_revision_comes_up_beside_the_serving_one_and_the_service_moves_when_it_settles(
    plane: Plane,
) -> None:
    status = plane.reconcile()
    first = MoEServiceSpec.from_k8s(plane.service["spec"]).model.revision_id
    assert first.startswith("ckpt-") and status["revision"] == first and status["servingSlot"] == "blue"
    assert plane.api_selector() == attention_selector("tiny-attention")
    assert status["endpoint"] == "http://tiny.ns.svc:8000/v1"
    plane.settle(*BLUE)
    plane.kube.merge_patch("ExpertPool", "ns", "tiny-experts", {"spec": {"replicas": 4}}, "scale")

    plane.edit(revision="r2")
    status = plane.reconcile()
    assert model_of(plane, "ExpertPool", "tiny-green-experts")["revision"] == "r2"
    assert model_of(plane, "AttentionPool", "tiny-green-attention")["revision"] == "r2"
    assert plane.pool("ExpertPool", "tiny-green-experts")["spec"]["replicas"] == 4  # the serving size
    assert model_of(plane, "ExpertPool", "tiny-experts").get("revision", "") == ""  # blue keeps its model
    green_attention = plane.pool("AttentionPool", "tiny-green-attention")
    assert green_attention["spec"]["expertPoolName"] == "tiny-green-experts"  # its own servers only
    assert status["servingSlot"] == "blue" and status["revision"] == first
    assert status["rollout"]["revision"] == "r2" and status["rollout"]["slot"] == "green"
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "RevisionRollout" and "status not observed yet" in progressing["message"]
    assert plane.api_selector() == attention_selector("tiny-attention")  # not before it settles

    plane.settle("tiny-green-experts")  # one pool settled is not enough
    assert plane.reconcile()["servingSlot"] == "blue"
    plane.settle(*GREEN)
    status = plane.reconcile()
    assert status["servingSlot"] == "green" and status["revision"] == "r2" and "rollout" not in status
    assert plane.api_selector() == attention_selector("tiny-green-attention")
    assert status["retiring"]["slot"] == "blue" and status["retiring"]["revision"] == first
    assert any(reason == "RevisionSwitched" for reason, _ in plane.events)

    # The old pair retires: attention first; its servers once no attention pod of it is left.
    attention_pod = {
        "kind": "Pod",
        "metadata": {"name": "tiny-attention-abc", "labels": attention_selector("tiny-attention")},
    }
    plane.kube.apply(attention_pod)
    status = plane.reconcile()
    assert plane.pool("AttentionPool", "tiny-attention") is None
    assert plane.pool("ExpertPool", "tiny-experts") is not None  # still serving the draining pods
    assert "1 attention pods finishing" in status["retiring"]["message"]
    assert "1 attention pods finishing" in plane.reconcile()["retiring"]["message"]
    del plane.kube.objects[("Pod", "tiny-attention-abc")]
    for ordinal in range(3):  # the blue servers' Leases (the green ones' must stay untouched)
        for pool in ("tiny-experts", "tiny-green-experts"):
            labels = {naming.POOL_LABEL: pool}
            plane.kube.apply({"kind": "Lease", "metadata": {"name": f"{pool}-{ordinal}", "labels": labels}})
    plane.reconcile()
    assert plane.pool("ExpertPool", "tiny-experts") is None
    for ordinal in range(3):  # told they may go at once on SIGTERM: no client is left
        blue = plane.kube.objects[("Lease", f"tiny-experts-{ordinal}")]["metadata"]
        assert blue["annotations"] == {naming.RELEASED_ANNOTATION: "retired"}
        assert "annotations" not in plane.kube.objects[("Lease", f"tiny-green-experts-{ordinal}")]["metadata"]
    assert plane.kube.deleted == [("AttentionPool", "tiny-attention"), ("ExpertPool", "tiny-experts")]
    # A server's own Lease write as its SIGTERM arrives may drop the word: the next pass says it again.
    del plane.kube.objects[("Lease", "tiny-experts-1")]["metadata"]["annotations"]
    status = plane.reconcile()
    assert "retiring" not in status and status["servingSlot"] == "green"
    assert (
        naming.RELEASED_ANNOTATION
        in plane.kube.objects[("Lease", "tiny-experts-1")]["metadata"]["annotations"]
    )
    assert plane.api_selector() == attention_selector("tiny-green-attention")

    # The next revision comes up in blue again.
    plane.edit(revision="r3")
    status = plane.reconcile()
    assert model_of(plane, "ExpertPool", "tiny-experts")["revision"] == "r3"
    assert status["rollout"]["slot"] == "blue" and status["servingSlot"] == "green"


def test_a_revert_before_the_switch_drops_the_new_pair(plane: Plane) -> None:
    plane.reconcile()
    plane.settle(*BLUE)
    plane.edit(revision="r2")
    plane.reconcile()
    assert plane.pool("ExpertPool", "tiny-green-experts") is not None
    plane.edit(revision="")
    status = plane.reconcile()
    assert plane.pool("ExpertPool", "tiny-green-experts") is None
    assert plane.pool("AttentionPool", "tiny-green-attention") is None
    assert status["servingSlot"] == "blue" and "rollout" not in status
    assert plane.api_selector() == attention_selector("tiny-attention")
    assert not any(reason == "RevisionSwitched" for reason, _ in plane.events)


def test_a_second_revision_supersedes_one_still_coming_up(plane: Plane) -> None:
    plane.reconcile()
    plane.settle(*BLUE)
    plane.edit(revision="r2")
    plane.reconcile()
    plane.edit(revision="r3")
    status = plane.reconcile()  # the r2 pair goes first
    assert plane.pool("ExpertPool", "tiny-green-experts") is None
    assert status["rollout"]["revision"] == "r3" and "to go" in status["rollout"]["message"]
    plane.reconcile()  # then r3 comes up in its place
    assert model_of(plane, "ExpertPool", "tiny-green-experts")["revision"] == "r3"
    plane.settle(*GREEN)
    assert plane.reconcile()["revision"] == "r3"


def test_other_changes_reach_the_serving_pair_during_a_rollout_and_its_model_stays(plane: Plane) -> None:
    plane.reconcile()
    plane.edit(revision="r2")
    plane.service["spec"]["expertPool"]["image"] = "eaas:next"
    plane.reconcile()
    blue = plane.pool("ExpertPool", "tiny-experts")
    assert blue["spec"]["image"] == "eaas:next" and blue["spec"]["model"].get("revision", "") == ""
    assert plane.pool("ExpertPool", "tiny-green-experts")["spec"]["image"] == "eaas:next"


def test_a_new_checkpoint_location_is_a_new_revision_unless_named_the_same(
    plane: Plane, moes_body: dict[str, Any]
) -> None:
    plane.reconcile()
    plane.edit(checkpoint={"hostPath": {"path": "/models/tiny-v2"}})
    assert plane.reconcile()["rollout"]["slot"] == "green"

    named = Plane(moes_body)
    named.edit(revision="2026-11-26")
    named.reconcile()
    named.edit(checkpoint={"hostPath": {"path": "/elsewhere"}})  # the same weights, moved
    status = named.reconcile()
    assert "rollout" not in status and named.pool("ExpertPool", "tiny-green-experts") is None
    assert model_of(named, "ExpertPool", "tiny-experts")["checkpoint"] == {
        "hostPath": {"path": "/elsewhere"},
        "subPath": "",
    }


def test_pools_stored_before_revisions_existed_are_the_same_revision(plane: Plane) -> None:
    """An ExpertPool written by an older operator has no ``model.revision``: the same checkpoint is
    the same revision, so an operator upgrade starts no rollout."""
    plane.reconcile()
    for kind, name in (("ExpertPool", "tiny-experts"), ("AttentionPool", "tiny-attention")):
        plane.pool(kind, name)["spec"]["model"].pop("revision", None)
    status = plane.reconcile()
    assert "rollout" not in status and plane.pool("ExpertPool", "tiny-green-experts") is None


def test_a_pool_of_the_other_slot_that_is_not_ours_is_reported(plane: Plane) -> None:
    plane.reconcile()
    plane.settle(*BLUE)
    stranger = {"kind": "ExpertPool", "metadata": {"name": "tiny-green-experts", "uid": "other"}, "spec": {}}
    plane.kube.objects[("ExpertPool", "tiny-green-experts")] = stranger
    plane.edit(revision="r2")
    status = plane.reconcile()
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (
        ready["status"] == "False" and "tiny-green-experts exists but is not controlled" in ready["message"]
    )
    assert plane.kube.objects[("ExpertPool", "tiny-green-experts")]["metadata"]["uid"] == "other"
    assert status["servingSlot"] == "blue"


def test_a_service_of_the_api_s_name_that_is_not_ours_is_left_alone_and_reported(plane: Plane) -> None:
    theirs = {
        "kind": "Service",
        "metadata": {"name": "tiny", "uid": "user-svc"},
        "spec": {"selector": {"a": "b"}},
    }
    plane.kube.objects[("Service", "tiny")] = copy.deepcopy(theirs)
    status = plane.reconcile()
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "Service tiny exists but is not controlled" in ready["message"]
    assert plane.kube.objects[("Service", "tiny")] == theirs


def test_pods_are_told_their_revision(moes_body: dict[str, Any], moes_spec: MoEServiceSpec) -> None:
    spec = moes_spec.model_copy(update={"model": moes_spec.model.model_copy(update={"revision": "r9"})})
    from eaas.operator.builders import moeservice as build

    pool = build.attention_pool(moes_body, spec, "green")
    deployment = attention_build.deployment(pool, AttentionPoolSpec.from_k8s(pool["spec"]))
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[naming.ENV_MODEL_REVISION] == "r9" and env[naming.ENV_EXPERT_SERVICE].startswith(
        "tiny-green-experts."
    )


@pytest.mark.parametrize("name", ["r2", "2026-11-26", "v1.2_rc", "a" * 63, "", "-x", "x-", "a b", "a" * 64])
def test_the_crd_and_the_runtime_accept_the_same_revision_names(name: str) -> None:
    import re

    import click

    from eaas.operator.api.common import REVISION
    from eaas.runtime.commands.options import check_revision

    crd = re.fullmatch(REVISION[1:-1], name) is not None and len(name) <= 63
    try:
        runtime = check_revision(None, None, name) == (name or None)  # type: ignore[arg-type]
    except click.BadParameter:
        runtime = False
    assert crd == runtime


def test_merge_patch_helper_matches_the_operators() -> None:
    old = {"a": 1, "b": {"c": 2}}
    new = {"b": {"c": 3}}
    assert patched(old, merge_patch(old, new)) == new
