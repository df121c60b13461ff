"""Elastic placement changes (add / drain) and the ExpertPool step planner."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaas.operator import planning
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY
from eaas.operator.expert_step import Observed, PodState, ServerReport, live_replicas, plan
from eaas.runtime.placement.placement import Placement, PlacementError

SHAPE = planning.PoolShape(layers=(0, 1, 2), num_experts=8, replication=2)
HASH = "t1"


def placement(servers: int, shape: planning.PoolShape = SHAPE) -> Placement:
    return planning.initial(shape, dict.fromkeys(range(servers)), {n: f"p-{n}" for n in range(servers)})


def check_invariants(result: Placement, shape: planning.PoolShape) -> None:
    counts = result.replica_counts()
    assert counts.shape == (len(shape.layers), shape.num_experts)
    assert counts.min() >= shape.replication


def test_initial_placement_covers_every_expert_r_times() -> None:
    first = placement(3)
    assert first.version == 1 and first.ordinals == (0, 1, 2)
    check_invariants(first, SHAPE)
    assert sorted(first.used_slots().values()) == [16, 16, 16]


def test_add_server_takes_a_fair_share_and_moves_little() -> None:
    before = placement(3)
    after = planning.add_server(before, SHAPE, 3, "p-3", None)
    check_invariants(after, SHAPE)
    assert after.version == before.version + 1 and after.ordinals == (0, 1, 2, 3)
    assert sorted(after.used_slots().values()) == [12, 12, 12, 12]
    assert before.diff(after).num_moves == 12  # only the new server loads anything


def test_drain_server_rehomes_its_experts_keeping_r() -> None:
    before = placement(4)
    after = planning.drain_server(before, SHAPE, 3)
    check_invariants(after, SHAPE)
    assert after.ordinals == (0, 1, 2)
    moved = before.diff(after)
    assert moved.removed_servers == (3,)
    assert moved.num_moves == len(before.experts_of(3))  # exactly the drained pairs are re-homed


def test_drain_below_r_is_refused() -> None:
    with pytest.raises(PlacementError, match="replication R=2 needs at least 2"):
        planning.drain_server(placement(2), SHAPE, 1)


def test_fixed_slots_are_respected() -> None:
    shape = replace(SHAPE, slots_per_server=16)
    first = placement(3, shape)
    assert {server.capacity for server in first.servers} == {16}
    with pytest.raises(PlacementError, match="capacity"):
        planning.drain_server(first, shape, 2)  # 48 slots cannot fit into 2 x 16


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(1, 3))
def test_any_sequence_of_scaling_keeps_every_expert_served(grow: list[bool], replication: int) -> None:
    shape = replace(SHAPE, replication=replication)
    current = planning.initial(shape, dict.fromkeys(range(replication)), {})
    for step in grow:
        if step:
            current = planning.add_server(current, shape, max(current.ordinals) + 1, None, None)
        elif current.num_servers > replication:
            current = planning.drain_server(current, shape, max(current.ordinals))
        check_invariants(current, shape)
        used = np.array(list(current.used_slots().values()))
        assert used.max() - used.min() <= max(2, used.mean() * 0.5)  # stays roughly balanced


# -- the step planner --------------------------------------------------------------------------


def observed(**overrides: object) -> Observed:
    base = {
        "pool": "p",
        "desired_replicas": 3,
        "shape": SHAPE,
        "template_hash": HASH,
        "pods": {},
        "committed": None,
        "pending": None,
    }
    return Observed(**(base | overrides))  # type: ignore[arg-type]


def pods(*ordinals: int, ready: bool = True, template: str = HASH) -> dict[int, PodState]:
    return {n: PodState(n, ready=ready, template_hash=template) for n in ordinals}


def conditions(step: object) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in step.conditions}  # type: ignore[attr-defined]


def test_a_new_pool_publishes_a_pending_placement_and_creates_all_pods() -> None:
    step = plan(observed())
    assert step.create_pods == [0, 1, 2]
    committed, pending = step.publish  # type: ignore[misc]
    assert committed is None and pending is not None and pending.ordinals == (0, 1, 2)
    assert conditions(step)[READY] == ("False", "PlacementPending")
    assert conditions(step)[PROGRESSING] == ("True", "Creating")
    rebuilt = plan(observed(pods=pods(0, 1, 2), last_version=7))  # the ConfigMap was deleted
    assert rebuilt.create_pods == [] and rebuilt.publish is not None
    assert rebuilt.publish[1] is not None and rebuilt.publish[1].version == 8  # versions never go back


def test_pending_is_committed_only_when_every_server_loaded_it() -> None:
    pending = placement(3)
    waiting = plan(
        observed(pods=pods(0, 1, 2), pending=pending, reports={1: ServerReport(False, loaded_version=0)})
    )
    assert waiting.publish is None and "waiting for servers [1]" in waiting.progress_message
    not_ready = plan(observed(pods=pods(0, 1) | pods(2, ready=False), pending=pending))
    assert not_ready.publish is None
    done = plan(
        observed(pods=pods(0, 1, 2), pending=pending, reports={1: ServerReport(False, loaded_version=1)})
    )
    assert done.publish == (pending, None)
    assert [event.reason for event in done.events] == ["PlacementCommitted"]


def test_steady_pool_is_ready_and_does_nothing() -> None:
    step = plan(observed(pods=pods(0, 1, 2), committed=placement(3)))
    assert (step.create_pods, step.delete_pods, step.publish) == ([], [], None)
    assert conditions(step) == {
        READY: ("True", "ExpertsServed"),
        PROGRESSING: ("False", "Stable"),
        DEGRADED: ("False", "AllServersLive"),
    }


def test_scale_up_adds_one_server_at_a_time() -> None:
    committed = placement(3)
    step = plan(observed(desired_replicas=5, pods=pods(0, 1, 2), committed=committed))
    assert step.create_pods == [3]
    assert step.publish is not None and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 1, 2, 3)  # only one more, though 5 are desired
    assert conditions(step)[READY][0] == "True"  # still serving while scaling


def test_scale_down_drains_before_it_deletes() -> None:
    committed = placement(4)
    drain = plan(observed(desired_replicas=3, pods=pods(0, 1, 2, 3), committed=committed))
    assert drain.delete_pods == [] and drain.publish is not None
    assert drain.publish[1] is not None and drain.publish[1].ordinals == (0, 1, 2)
    drained = drain.publish[1]
    commit = plan(observed(desired_replicas=3, pods=pods(0, 1, 2, 3), committed=committed, pending=drained))
    assert commit.publish == (drained, None) and commit.delete_pods == []
    delete = plan(observed(desired_replicas=3, pods=pods(0, 1, 2, 3), committed=drained))
    assert delete.delete_pods == [3] and delete.publish is None


def test_never_below_r() -> None:
    step = plan(observed(desired_replicas=1, pods=pods(0, 1), committed=placement(2)))
    assert step.publish is None and step.delete_pods == []


def test_a_lost_pod_is_recreated_and_the_pool_reports_degraded() -> None:
    step = plan(observed(pods=pods(0, 2), committed=placement(3)))
    assert step.create_pods == [1]
    assert conditions(step)[DEGRADED] == ("True", "ServersUnavailable")
    assert conditions(step)[READY] == ("True", "ExpertsServed")  # R=2: every expert still has a replica


def test_expired_heartbeat_counts_as_down() -> None:
    step = plan(
        observed(
            pods=pods(0, 1, 2), committed=placement(3), reports={0: ServerReport(True), 1: ServerReport(True)}
        )
    )
    assert conditions(step)[READY] == ("False", "ExpertUnavailable")  # some experts lived only on 0 and 1


def test_changed_template_rolls_one_live_server_at_a_time() -> None:
    old = pods(0, 1, 2, template="t0")
    step = plan(observed(pods=old, committed=placement(3)))
    assert step.delete_pods == [2] and step.progressing == "RollingUpdate"
    waiting = plan(observed(pods=old | pods(1, ready=False, template=HASH), committed=placement(3)))
    assert waiting.delete_pods == []  # server 1 is being replaced; wait for it
    stale = plan(observed(pods=pods(0, 1, 2, ready=False, template="t0"), pending=placement(3)))
    assert stale.delete_pods == [0, 1, 2]  # not serving anyway: replace at once


def test_changed_replication_factor_replans() -> None:
    step = plan(observed(shape=replace(SHAPE, replication=3), pods=pods(0, 1, 2), committed=placement(3)))
    assert step.publish is not None and step.publish[1] is not None
    assert step.publish[1].replication == 3 and step.progressing == "Replanning"


def test_unreadable_placement_is_reported_not_overwritten() -> None:
    step = plan(observed(pods=pods(0, 1, 2), placement_error="bad json"))
    assert (step.create_pods, step.delete_pods, step.publish) == ([], [], None)
    assert conditions(step)[DEGRADED] == ("True", "PlacementInvalid")


def test_live_replicas() -> None:
    first = placement(3)
    assert live_replicas(first, {0, 1, 2}) == 2
    assert live_replicas(first, {0}) == 0


def test_with_measured_load_the_cost_aware_operations_are_used() -> None:
    before = placement(3)
    load = np.ones((3, 8))
    load[0, :2] = 50.0  # two hot experts in layer 0
    grown = planning.add_server(before, SHAPE, 3, "p-3", None, load=load)
    check_invariants(grown, SHAPE)
    assert grown.ordinals == (0, 1, 2, 3) and grown.version == before.version + 1
    assert before.diff(grown).loads_by_server().keys() <= {3}  # only the new server loads weights
    shrunk = planning.drain_server(grown, SHAPE, 3, load=load)
    check_invariants(shrunk, SHAPE)
    assert shrunk.ordinals == (0, 1, 2)
