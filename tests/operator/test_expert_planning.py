"""Elastic placement changes (add / drain) and the ExpertPool step planner."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaas.operator import planning
from eaas.operator.collector import Probe
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY
from eaas.operator.expert_step import (
    Observed,
    PodState,
    ServerReport,
    live_replicas,
    plan,
    serving_utilization,
)
from eaas.runtime.placement.diff import diff
from eaas.runtime.placement.placement import Placement, PlacementError, Server

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
    assert diff(before, after).num_moves == 12  # only the new server loads anything


def layer_spread(result: Placement) -> int:
    """Largest difference, over layers, between the servers holding most and fewest of that layer."""
    matrix = result.hosting_matrix()  # [servers, L, E]
    per_layer = matrix.sum(axis=2, dtype=int)  # [servers, L]
    return int((per_layer.max(axis=0) - per_layer.min(axis=0)).max())


def test_a_grown_pool_shares_every_layer_not_just_the_slot_count() -> None:
    # A layer's tokens wait for the busiest server that hosts the layer: a new server that took
    # whole layers would add capacity to those layers only.
    shape = planning.PoolShape(layers=tuple(range(8)), num_experts=16, replication=2)
    current = placement(2, shape)
    for new in (2, 3, 4, 5):
        current = planning.add_server(current, shape, new, None, None)
        check_invariants(current, shape)
        assert layer_spread(current) <= 1, f"{current.num_servers} servers"
    for _ in range(4):  # a drain moves only the leaving server's pairs, so it may leave one more
        current = planning.drain_server(current, shape, max(current.ordinals))
        check_invariants(current, shape)
        assert layer_spread(current) <= 2, f"{current.num_servers} servers"


def test_drain_server_rehomes_its_experts_keeping_r() -> None:
    before = placement(4)
    after = planning.drain_server(before, SHAPE, 3)
    check_invariants(after, SHAPE)
    assert after.ordinals == (0, 1, 2)
    moved = diff(before, after)
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
        assert layer_spread(current) <= 2  # and so does every layer


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


def test_scale_up_adds_what_is_missing_in_one_change() -> None:
    committed = placement(3)
    step = plan(observed(desired_replicas=5, pods=pods(0, 1, 2), committed=committed))
    assert step.create_pods == [3, 4]
    assert step.publish is not None and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 1, 2, 3, 4)
    assert conditions(step)[READY][0] == "True"  # still serving while scaling


def test_max_servers_per_change_bounds_a_scale_up() -> None:
    committed = placement(3)
    one = plan(
        observed(desired_replicas=5, pods=pods(0, 1, 2), committed=committed, max_servers_per_change=1)
    )
    assert one.create_pods == [3]
    assert one.publish is not None and one.publish[1] is not None
    assert one.publish[1].ordinals == (0, 1, 2, 3)  # only one more, though 5 are desired


def test_a_scale_up_at_most_doubles_the_pool_by_default() -> None:
    step = plan(observed(desired_replicas=20, pods=pods(*range(4)), committed=placement(4)))
    assert step.create_pods == [4, 5, 6, 7]
    assert "4 servers 4..7 (4 -> 20)" in step.progress_message


def test_a_scale_down_at_most_halves_the_pool_and_drains_the_highest_ordinals() -> None:
    committed = placement(8)
    drain = plan(observed(desired_replicas=2, pods=pods(*range(8)), committed=committed))
    assert drain.publish is not None and drain.publish[1] is not None
    assert drain.publish[1].ordinals == (0, 1, 2, 3) and drain.delete_pods == []
    check_invariants(drain.publish[1], SHAPE)
    delete = plan(observed(desired_replicas=2, pods=pods(*range(8)), committed=drain.publish[1]))
    assert delete.delete_pods == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("layers", "experts", "replication", "domains"), [(3, 8, 2, 0), (6, 32, 3, 4), (4, 64, 2, 2)]
)
def test_batched_changes_keep_r_and_balance_as_single_ones_do(
    layers: int, experts: int, replication: int, domains: int
) -> None:
    """Steps shaped like 64 -> 320 -> 64 at a small size (doubling, the rest, halving twice), each
    in one change, against the same steps made one server at a time."""
    shape = planning.PoolShape(layers=tuple(range(layers)), num_experts=experts, replication=replication)

    def domain(n: int) -> str | None:
        return f"node-{n % domains}" if domains else None

    first = {n: domain(n) for n in range(4)}
    current = single = planning.initial(shape, first, {n: f"p-{n}" for n in first})
    for target in (8, 20, 10, 5):
        have = list(current.ordinals)
        if target > len(have):
            # As the operator adds them: their nodes are not known yet (None), the commit spreads them.
            new = {n: (f"p-{n}", None) for n in range(max(have) + 1, max(have) + 1 + target - len(have))}
            after = planning.add_servers(current, shape, new)
            assert diff(current, after).num_moves == sum(
                after.used_slots()[n] for n in new
            )  # new servers load
            for n, (name, where) in new.items():
                single = planning.add_server(single, shape, n, name, where)
        else:
            after = planning.drain_servers(current, shape, have[target:])
            for n in have[target:]:
                single = planning.drain_server(single, shape, n)
        check_invariants(after, shape)
        assert after.version == current.version + 1 and after.ordinals == single.ordinals
        used = list(after.used_slots().values())
        assert (
            max(used) - min(used) <= max(single.used_slots().values()) - min(single.used_slots().values()) + 1
        )
        assert layer_spread(after) <= max(layer_spread(single), 1)
        if domains:
            named = {s.ordinal: str(s.domain or f"<server {s.ordinal}>") for s in after.servers}
            assert planning.spread_shortfall(after, named) <= planning.spread_shortfall(single, named)
        current = after


def test_a_batch_drain_refuses_to_go_below_r() -> None:
    with pytest.raises(PlacementError, match=r"cannot drain servers \[1, 2\]: 1 servers would remain"):
        planning.drain_servers(placement(3), SHAPE, [1, 2])
    with pytest.raises(PlacementError, match="servers \\[5, 6\\] are not in placement"):
        planning.drain_servers(placement(3), SHAPE, [5, 6])
    with pytest.raises(PlacementError, match="server 1 is already in placement"):
        planning.add_servers(placement(3), SHAPE, {1: ("p-1", None)})


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


def test_the_pool_utilization_counts_only_servers_that_carry_and_keep_the_load() -> None:
    busy = {n: ServerReport(False, utilization_milli=milli) for n, milli in {0: 600, 1: 800, 2: 0}.items()}
    two = placement(2)
    growing = planning.add_server(two, SHAPE, 2, None, None)  # server 2 not committed yet: idle
    assert serving_utilization(busy, two, growing) == 700
    three = planning.add_server(two, SHAPE, 2, None, None)
    draining = planning.drain_server(three, SHAPE, 2)  # server 2 committed, leaving
    assert serving_utilization(busy, three, draining) == 700
    assert serving_utilization(busy, three, None) == 467  # committed and staying: it counts
    silent = busy | {1: ServerReport(True, utilization_milli=800), 0: ServerReport(False)}
    assert serving_utilization(silent, two, None) is None  # expired and unreported do not count
    assert serving_utilization(busy, None, None) is None
    tokens = {n: ServerReport(False, tokens_per_second=t) for n, t in {0: 300, 1: 500}.items()}
    assert serving_utilization(tokens, two, None, "tokens_per_second") == 400  # the same mean, of tokens


def test_with_measured_load_the_cost_aware_operations_are_used() -> None:
    before = placement(3)
    load = np.ones((3, 8))
    load[0, :2] = 50.0  # two hot experts in layer 0
    grown = planning.add_server(before, SHAPE, 3, "p-3", None, load=load)
    check_invariants(grown, SHAPE)
    assert grown.ordinals == (0, 1, 2, 3) and grown.version == before.version + 1
    assert diff(before, grown).loads_by_server().keys() <= {3}  # only the new server loads weights
    shrunk = planning.drain_server(grown, SHAPE, 3, load=load)
    check_invariants(shrunk, SHAPE)
    assert shrunk.ordinals == (0, 1, 2)


# -- lost servers: re-placed on the survivors, then replaced ------------------------------------


def leased(*ordinals: int, expired: tuple[int, ...] = (), loaded: int = 1) -> dict[int, ServerReport]:
    return {n: ServerReport(n in expired, loaded_version=loaded, owner_uid=f"uid-{n}") for n in ordinals}


def with_uids(states: dict[int, PodState]) -> dict[int, PodState]:
    return {n: replace(state, uid=f"uid-{n}") for n, state in states.items()}


def test_a_lost_server_is_drained_onto_the_survivors_before_its_pod_goes() -> None:
    committed = placement(4)
    world = observed(desired_replicas=4, pods=with_uids(pods(0, 1, 2, 3)), committed=committed)
    step = plan(replace(world, reports=leased(0, 1, 2, 3, expired=(1,))))
    assert step.delete_pods == [] and step.create_pods == []  # drain before delete, as for scale-down
    assert step.publish is not None and step.publish[0] is committed
    pending = step.publish[1]
    assert pending is not None and pending.ordinals == (0, 2, 3) and pending.version == 2
    check_invariants(pending, SHAPE)  # R restored on the survivors
    assert [(e.reason, e.type) for e in step.events] == [("ServerLost", "Warning")]
    assert "p-1 (its Lease was not renewed for 10 s)" in step.events[0].message
    assert conditions(step)[DEGRADED][0] == "True" and "pairs below R" in step.conditions[2].message

    # The survivors load it and it is committed; then the lost pod is deleted; then a new server.
    loading = plan(replace(world, pending=pending, reports=leased(0, 1, 2, 3, expired=(1,), loaded=2)))
    assert loading.publish == (pending, None)
    drained = plan(replace(world, committed=pending, reports=leased(0, 2, 3, loaded=2)))
    assert drained.delete_pods == [1]
    grown = plan(replace(world, pods=with_uids(pods(0, 2, 3)), committed=pending))
    assert grown.publish is not None and grown.publish[1] is not None
    assert grown.publish[1].ordinals == (0, 2, 3, 4) and grown.create_pods == [4]


def test_a_pod_unready_past_the_heartbeat_timeout_is_lost_once_it_has_served() -> None:
    committed = placement(3)
    sick = {1: PodState(1, ready=False, template_hash=HASH, uid="uid-1", unready_seconds=30.0)}
    world = observed(pods=with_uids(pods(0, 2)) | sick, committed=committed, reports=leased(0, 1, 2))
    assert plan(world).progressing == "ReplacingLost"
    briefly = {1: replace(sick[1], unready_seconds=3.0)}  # shorter than the 10 s timeout
    assert plan(replace(world, pods=world.pods | briefly)).publish is None
    loading = plan(replace(world, reports=leased(0, 2)))  # no Lease yet: still loading its experts
    assert loading.publish is None and loading.progressing != "ReplacingLost"


def test_the_expired_lease_of_an_earlier_pod_of_that_name_is_not_a_loss() -> None:
    committed = placement(3)
    reports = leased(0, 1, 2, expired=(1,)) | {1: ServerReport(True, loaded_version=1, owner_uid="old-uid")}
    step = plan(observed(pods=with_uids(pods(0, 1, 2)), committed=committed, reports=reports))
    assert step.publish is None and step.progressing != "ReplacingLost"


def test_most_servers_silent_at_once_is_blamed_on_the_control_plane() -> None:
    committed = placement(3)
    step = plan(
        observed(pods=with_uids(pods(0, 1, 2)), committed=committed, reports=leased(0, 1, 2, expired=(0, 1)))
    )
    assert step.publish is None and step.delete_pods == [] and step.create_pods == []
    assert step.progressing == "HeartbeatsLost" and step.events[0].type == "Warning"


def test_when_the_survivors_cannot_keep_r_the_lost_pod_is_recreated_in_place() -> None:
    committed = placement(2)
    step = plan(
        observed(
            desired_replicas=2,
            pods=with_uids(pods(0, 1)),
            committed=committed,
            reports=leased(0, 1, expired=(1,)),
        )
    )
    assert step.publish is None and step.delete_pods == [1]
    assert "R cannot be kept" in step.events[0].message
    recreated = plan(observed(desired_replicas=2, pods=with_uids(pods(0)), committed=committed))
    assert recreated.create_pods == [1]


def test_a_loss_during_a_scale_up_abandons_it_for_a_newer_placement() -> None:
    committed = placement(3)
    growing = planning.add_server(committed, SHAPE, 3, "p-3", None)
    step = plan(
        observed(
            desired_replicas=4,
            pods=with_uids(pods(0, 1, 2, 3)),
            committed=committed,
            pending=growing,
            reports=leased(0, 1, 2, 3, expired=(2,), loaded=1),
        )
    )
    assert step.publish is not None and step.publish[1] is not None
    replacement = step.publish[1]
    assert replacement.ordinals == (0, 1) and replacement.version > growing.version
    assert "abandoned" in step.events[0].message


def simulate(world: Observed, max_steps: int = 20, deleted: list[int] | None = None) -> list[str]:
    """Applies planned steps to a model of the cluster (pods start Ready and load at once) until
    nothing is left to do; returns the Progressing reasons (and fills ``deleted`` with the pods
    deleted, in order). Every committed placement keeps R."""
    history = []
    for _ in range(max_steps):
        step = plan(world)
        history.append(step.progressing or "Stable")
        if not (step.publish or step.create_pods or step.delete_pods):
            return history
        pods_now = dict(world.pods)
        reports = dict(world.reports)
        committed, pending = world.committed, world.pending
        if step.publish is not None:
            committed, pending = step.publish
        if committed is not None:
            check_invariants(committed, world.shape)
        for n in step.delete_pods:
            if deleted is not None:
                deleted.append(n)
            pods_now.pop(n)
            reports.pop(n, None)
        for n in step.create_pods:
            pods_now[n] = PodState(n, ready=True, template_hash=HASH, uid=f"uid-{n}-new")
        version = (pending or committed).version  # type: ignore[union-attr]
        for n in pods_now:
            if not reports.get(n, ServerReport(False)).expired:
                reports[n] = ServerReport(False, loaded_version=version, owner_uid=pods_now[n].uid)
        world = replace(world, pods=pods_now, reports=reports, committed=committed, pending=pending)
    raise AssertionError(f"no steady state after {max_steps} steps: {history}")


def test_a_lost_server_ends_replaced_with_the_pool_back_to_its_size() -> None:
    world = observed(
        desired_replicas=4,
        pods=with_uids(pods(0, 1, 2, 3)),
        committed=placement(4),
        reports=leased(0, 1, 2, 3, expired=(2,)),
    )
    deleted: list[int] = []
    history = simulate(world, deleted=deleted)
    assert history[0] == "ReplacingLost" and history[-1] == "Stable" and deleted == [2]
    assert "ScalingUp" in history


def test_a_retired_server_is_replaced_first_then_drained_and_only_it_leaves() -> None:
    marked = with_uids(pods(0, 1, 2, 3)) | {1: PodState(1, ready=True, template_hash=HASH, retiring=True)}
    world = observed(desired_replicas=4, pods=marked, committed=placement(4))
    first = plan(world)
    assert first.progressing == "ScalingUp" and first.create_pods == [4]  # make before break
    assert first.publish is not None and first.publish[1] is not None
    assert first.publish[1].ordinals == (0, 1, 2, 3, 4)
    grown = first.publish[1]
    drain = plan(replace(world, pods=marked | with_uids(pods(4)), committed=grown))
    assert drain.progressing == "Retiring" and drain.delete_pods == []
    assert drain.publish is not None and drain.publish[1] is not None
    assert drain.publish[1].ordinals == (0, 2, 3, 4)
    check_invariants(drain.publish[1], SHAPE)
    assert "p-1 as asked" in drain.events[0].message
    deleted: list[int] = []
    history = simulate(world, deleted=deleted)
    assert history[-1] == "Stable" and "Retiring" in history and deleted == [1]


def test_retiring_while_scaling_down_retires_the_chosen_server_not_the_highest() -> None:
    marked = with_uids(pods(0, 1, 2, 3)) | {1: PodState(1, ready=True, template_hash=HASH, retiring=True)}
    step = plan(observed(desired_replicas=3, pods=marked, committed=placement(4)))
    assert step.progressing == "Retiring"
    assert step.publish is not None and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 2, 3)


def test_scaling_a_deepseek_v3_sized_pool_is_quick() -> None:
    # 58 MoE layers x 256 experts x R=2 (29,696 replicas) on 8 -> 9 -> 8 servers: the operator
    # plans this inside a reconcile. ~0.3 s here; a quadratic search took minutes.
    shape = planning.PoolShape(layers=tuple(range(3, 61)), num_experts=256, replication=2)
    first = placement(8, shape)
    started = time.perf_counter()
    grown = planning.add_server(first, shape, 8, None, None)
    shrunk = planning.drain_server(grown, shape, 8)
    assert time.perf_counter() - started < 10.0
    check_invariants(grown, shape)
    check_invariants(shrunk, shape)
    assert layer_spread(grown) <= 1 and layer_spread(shrunk) <= 2


def leaving_report(ordinal: int, loaded: int = 1) -> ServerReport:
    return ServerReport(False, loaded_version=loaded, owner_uid=f"uid-{ordinal}", leaving=True)


def test_a_deleted_server_serves_on_while_its_experts_move_then_the_pool_grows_back() -> None:
    """``kubectl delete pod``, an eviction or a drain: the pod is terminating, its server announced
    on its Lease that it is leaving and serves on. Its experts move to the others (R kept) before
    it goes; nothing counts as down meanwhile; then a new server brings the pool back."""
    committed = placement(4)
    going = {1: PodState(1, ready=False, terminating=True, template_hash=HASH, uid="uid-1")}
    world = observed(
        desired_replicas=4,
        pods=with_uids(pods(0, 2, 3)) | going,
        committed=committed,
        reports=leased(0, 2, 3) | {1: leaving_report(1)},
    )
    step = plan(world)
    assert step.progressing == "ReleasingLeaving" and not (step.delete_pods or step.create_pods)
    assert step.publish is not None and step.publish[0] is committed
    pending = step.publish[1]
    assert pending is not None and pending.ordinals == (0, 2, 3) and pending.version == 2
    check_invariants(pending, SHAPE)
    assert (
        step.events[0].reason == "ServerLeaving"
        and "p-1 (its pod is being deleted)" in step.events[0].message
    )
    # It still serves: every expert has R serving replicas, nothing is down.
    assert conditions(step)[READY] == ("True", "ExpertsServed")
    assert conditions(step)[DEGRADED] == ("False", "AllServersLive")

    loading = plan(replace(world, pending=pending, reports=world.reports | leased(0, 2, 3, loaded=2)))
    assert loading.publish == (pending, None)  # committed without it; it was never waited for
    assert loading.release == []  # still named by the committed placement: not yet
    after = plan(replace(world, committed=pending, reports=world.reports | leased(0, 2, 3, loaded=2)))
    assert after.delete_pods == []  # it exits on its own once no client routes to it
    assert after.release == [1]  # told so on its Lease (its mounted placement is frozen)
    # ... but not while an attention client still routes by the placement that named it (its
    # mounted placement lags): it could still attach to the server
    lagging = replace(world, committed=pending, reports=world.reports | leased(0, 2, 3, loaded=2))
    assert plan(replace(lagging, client_versions=(2, 1))).release == []
    assert plan(replace(lagging, client_versions=(2, 2))).release == [1]
    assert after.progressing == "ScalingUp" and after.create_pods == [4]
    told = {1: replace(leaving_report(1), released=True)}
    assert plan(replace(world, committed=pending, reports=world.reports | told)).release == []


def test_a_server_that_announced_sigterm_on_its_lease_is_drained_and_its_pod_deleted() -> None:
    """SIGTERM that did not come from a pod deletion (a node's graceful shutdown): the Lease says
    so; the server is drained the same way and its pod deleted once the change is committed."""
    committed = placement(4)
    world = observed(
        desired_replicas=4,
        pods=with_uids(pods(0, 2, 3)) | with_uids(pods(1, ready=False)),
        committed=committed,
        reports=leased(0, 2, 3) | {1: leaving_report(1)},
    )
    step = plan(world)
    assert step.publish is not None and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 2, 3) and "it received SIGTERM" in step.events[0].message
    after = plan(replace(world, committed=step.publish[1]))
    assert after.delete_pods == [1]
    # The announcement of an earlier pod of the name means nothing for this one.
    stale = {1: ServerReport(False, loaded_version=1, owner_uid="old-uid", leaving=True)}
    assert (
        plan(replace(world, pods=with_uids(pods(0, 1, 2, 3)), reports=leased(0, 2, 3) | stale)).publish
        is None
    )


def test_a_leaving_server_the_survivors_cannot_replace_gets_a_replacement_in_the_same_change() -> None:
    """One survivor cannot hold R=2 copies: a new server is added in the pending placement that
    drains the leaving one (one change to load and commit, which fits its grace period)."""
    going = {1: PodState(1, ready=False, terminating=True, template_hash=HASH, uid="uid-1")}
    world = observed(
        desired_replicas=2,
        pods=with_uids(pods(0)) | going,
        committed=placement(2),
        reports=leased(0) | {1: leaving_report(1)},
    )
    step = plan(world)
    assert step.create_pods == [2] and step.publish is not None and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 2) and step.progressing == "ReleasingLeaving"
    check_invariants(step.publish[1], SHAPE)
    assert "adding p-2" in step.events[0].message
    after = plan(replace(world, pods=with_uids(pods(0, 2)) | going, committed=step.publish[1]))
    assert after.release == [1] and not (after.create_pods or after.delete_pods)  # told it may go
    gone = plan(replace(world, pods=with_uids(pods(0)), reports=leased(0)))
    assert gone.create_pods == [1]  # one that went before it could be replaced is recreated in place


def test_a_server_leaving_during_a_scale_up_hands_its_experts_to_the_new_one_too() -> None:
    """A drain evicts the next server while the replacement of the one before is still loading:
    the new pending placement keeps the server being added (it takes part of the share)."""
    committed = placement(3)
    growing = planning.add_server(committed, SHAPE, 3, "p-3", None)
    going = {2: PodState(2, ready=False, terminating=True, template_hash=HASH, uid="uid-2")}
    step = plan(
        observed(
            desired_replicas=4,
            pods=with_uids(pods(0, 1, 3)) | going,
            committed=committed,
            pending=growing,
            reports=leased(0, 1, 3) | {2: leaving_report(2)},
        )
    )
    assert step.publish is not None and step.publish[0] is committed and step.publish[1] is not None
    assert step.publish[1].ordinals == (0, 1, 3) and step.publish[1].version > growing.version
    check_invariants(step.publish[1], SHAPE)
    assert "replaces pending v2" in step.events[0].message


def on_nodes(states: dict[int, PodState], nodes: dict[int, str]) -> dict[int, PodState]:
    return {n: replace(state, node=nodes[n]) for n, state in states.items()}


def test_once_its_servers_are_scheduled_every_expert_gets_replicas_on_distinct_nodes() -> None:
    """Three servers on two nodes, R = 2: the load-blind first placement put some experts on the
    two servers of one node only; losing that node would lose them. Once the pods are scheduled the
    operator records the nodes and deals again, the lone node's server taking one replica of
    everything. Then nothing more happens."""
    nodes = {0: "node-a", 1: "node-a", 2: "node-b"}
    committed = placement(3)
    assert planning.spread_shortfall(committed, nodes) > 0
    world = observed(pods=on_nodes(with_uids(pods(0, 1, 2)), nodes), committed=committed)
    step = plan(world)
    assert step.progressing == "Spreading" and step.events[0].reason == "FailureDomains"
    assert step.publish is not None and step.publish[1] is not None
    spread = step.publish[1]
    assert planning.spread_shortfall(spread, nodes) == 0 and spread.version == committed.version + 1
    assert {server.domain for server in spread.servers} == {"node-a", "node-b"}
    assert all(2 in spread.servers_of(layer, e) for layer in spread.layers for e in range(spread.num_experts))
    assert plan(replace(world, committed=spread)).publish is None  # steady
    # One node only: the nodes are recorded, nothing moves.
    single = plan(
        observed(pods=on_nodes(with_uids(pods(0, 1, 2)), dict.fromkeys(nodes, "n")), committed=committed)
    )
    assert single.publish is not None and single.publish[1] is not None
    assert {server.domain for server in single.publish[1].servers} == {"n"}
    assert np.array_equal(single.publish[1].hosting_matrix(), committed.hosting_matrix())
    # Not yet scheduled, or not all live: nothing.
    assert plan(observed(pods=with_uids(pods(0, 1, 2)), committed=committed)).publish is None


def test_a_whole_node_lost_is_not_mistaken_for_a_control_plane_outage() -> None:
    """Two of three servers silent at once, both on one node, while the server on the other node
    renews: a node was lost. More than half silent across nodes is still blamed on the view."""
    nodes = {0: "node-a", 1: "node-a", 2: "node-b"}
    committed = planning.spread(placement(3), SHAPE, nodes)
    states = on_nodes(with_uids(pods(0, 1, 2)), nodes)
    node_lost = plan(observed(pods=states, committed=committed, reports=leased(0, 1, 2, expired=(0, 1))))
    assert node_lost.progressing == "RecreatingLost"  # one survivor cannot hold R = 2: back in place
    assert node_lost.delete_pods == [0, 1]
    spread_out = on_nodes(with_uids(pods(0, 1, 2)), {0: "node-a", 1: "node-b", 2: "node-c"})
    blind = plan(observed(pods=spread_out, committed=committed, reports=leased(0, 1, 2, expired=(0, 1))))
    assert blind.progressing == "HeartbeatsLost"


def test_a_server_that_answers_on_its_control_port_is_not_lost_for_a_lapsed_heartbeat() -> None:
    """After an API-server outage a server's path to the API can come back later than the
    operator's: its Lease lapses while it serves. The operator asked its control port first."""
    world = observed(
        pods=with_uids(pods(0, 1, 2)), committed=placement(3), reports=leased(0, 1, 2, expired=(1,))
    )
    assert plan(world).progressing == "ReplacingLost"
    vouched = plan(replace(world, probes={1: "answers"}))
    assert vouched.publish is None and vouched.progressing != "ReplacingLost"


def silent_for(seconds: dict[int, float], *ordinals: int) -> dict[int, ServerReport]:
    """Live Leases of `ordinals`, each unrenewed for `seconds` (0 where not given)."""
    return {n: replace(report, silent_s=seconds.get(n, 0.0)) for n, report in leased(*ordinals).items()}


def three_serving(silent: dict[int, float], **more: object) -> Observed:
    """Servers 0-2 serving placement v1, 1 s heartbeats (5 s timeout), Leases unrenewed for `silent`."""
    return observed(
        pods=with_uids(pods(0, 1, 2)),
        committed=placement(3),
        reports=silent_for(silent, 0, 1, 2),
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
        **more,
    )


def test_a_server_its_clients_fail_over_is_lost_at_once_when_its_port_refuses() -> None:
    """SIGKILL: the clients' sockets close, they fail it over and say so on their Leases; the
    operator's probe of its control port is refused (nothing listens): lost now, though its Lease
    was renewed a moment ago and would not expire for seconds."""
    world = three_serving({1: 0.2})
    assert plan(world).publish is None  # nobody reported it: the Lease alone decides
    assert plan(replace(world, probes={1: "refused"})).publish is None  # a refusal nobody reported
    step = plan(replace(world, reported=frozenset({1}), probes={1: "refused"}))
    assert step.progressing == "ReplacingLost"
    assert step.publish is not None and step.publish[1] is not None and step.publish[1].ordinals == (0, 2)
    check_invariants(step.publish[1], SHAPE)
    assert "p-1 (its attention clients failed it over and its control port refuses" in step.events[0].message


def test_a_hung_server_its_clients_fail_over_is_lost_once_its_lease_is_late_by_half_an_interval() -> None:
    """SIGSTOP: the port accepts but nothing answers (silent). Lost once its Lease has gone
    unrenewed for more than 1.5 intervals, not after the whole timeout; until then the operator
    asks to look again when that time comes."""
    late = three_serving({1: 1.2}, reported=frozenset({1}), probes={1: "silent"})
    assert plan(late).publish is None and late.lost(1) == ""
    assert late.suspect_in(1) == pytest.approx(0.3)
    later = replace(late, reports=silent_for({1: 1.6}, 0, 1, 2))
    step = plan(later)
    assert step.progressing == "ReplacingLost" and later.suspect_in(1) is None
    assert (
        "its Lease has not been renewed for 1.6 s and its control port does not answer"
        in step.events[0].message
    )
    # Unasked (no probe yet: no URL), or silent without a client's word: not lost before the timeout.
    assert plan(replace(later, probes={})).publish is None
    assert plan(replace(later, reported=frozenset())).publish is None


def test_a_slow_server_its_clients_fail_over_is_not_lost_while_it_renews_or_answers() -> None:
    """A server whose batches take long (or whose data path is cut) but whose process runs: its
    heartbeat renews on time and its control port answers, so a client's word alone moves nothing."""
    renewing = three_serving({1: 0.9}, reported=frozenset({1}), probes={1: "silent"})
    assert plan(renewing).publish is None  # its Lease keeps being renewed: never 1.5 intervals late
    answering = replace(renewing, reports=silent_for({1: 30.0}, 0, 1, 2), probes={1: "answers"})
    assert plan(answering).publish is None and answering.suspect_in(1) is None


def test_refused_servers_are_acted_on_even_when_more_than_half_are_silent() -> None:
    """The outage guard holds back what rests on heartbeats; a refused connection is the server's
    host answering, so those are re-placed, and only those."""
    world = observed(
        desired_replicas=5,
        pods=with_uids(pods(0, 1, 2, 3, 4)),
        committed=placement(5),
        reports=leased(0, 1, 2, 3, 4, expired=(0, 1, 2, 3)),
    )
    assert plan(world).progressing == "HeartbeatsLost"
    probes: dict[int, Probe] = {0: "refused", 1: "silent", 2: "silent", 3: "silent"}
    refused = plan(replace(world, reported=frozenset({0}), probes=probes))
    assert refused.progressing == "ReplacingLost"
    assert refused.publish is not None and refused.publish[1] is not None
    assert refused.publish[1].ordinals == (1, 2, 3, 4)
    assert [e.reason for e in refused.events] == ["HeartbeatsLost", "ServerLost"]


def test_a_pending_placement_is_spread_over_its_servers_nodes_before_it_is_committed() -> None:
    """A scale-up places the new server before it is scheduled; once it is, the pending placement
    records the nodes (and deals again where needed) before the commit: one change, not two."""
    nodes = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    committed = planning.spread(placement(3), SHAPE, {0: "node-a", 1: "node-a", 2: "node-b"})
    growing = planning.add_server(committed, SHAPE, 3, "p-3", None)
    states = on_nodes(with_uids(pods(0, 1, 2, 3)), nodes)
    world = observed(
        desired_replicas=4,
        pods=states,
        committed=committed,
        pending=growing,
        reports=leased(0, 1, 2, 3, loaded=growing.version),
    )
    step = plan(world)
    assert step.progressing == "Spreading" and step.publish is not None and step.publish[0] is committed
    spread = step.publish[1]
    assert spread is not None and spread.version == growing.version + 1
    assert {s.ordinal: s.domain for s in spread.servers} == nodes and planning.spread_shortfall(
        spread, nodes
    ) == 0
    loaded = plan(replace(world, pending=spread, reports=leased(0, 1, 2, 3, loaded=spread.version)))
    assert loaded.publish == (spread, None)  # committed as is


def test_draining_a_server_that_holds_an_extra_replica_of_a_hot_expert_drops_it() -> None:
    """A rebalance may give a hot expert more than R replicas, here one on every server: draining
    any server leaves R of it, so nothing needs a new home (a fresh-clone run found the drain
    crashing on it, which kept a leaving server from being drained)."""
    committed = placement(3)
    matrix = committed.hosting_matrix().copy()
    matrix[:, 0, 0] = True  # (first layer, expert 0) on all three servers
    servers = [Server(s.ordinal, s.capacity + 1, s.name, s.domain) for s in committed.servers]
    hot = Placement.from_matrix(
        committed.layers, committed.num_experts, servers, matrix, 2, committed.version
    )
    drained = planning.drain_server(hot, SHAPE, 1)
    assert drained.ordinals == (0, 2) and sorted(drained.servers_of(committed.layers[0], 0)) == [0, 2]
    check_invariants(drained, SHAPE)
