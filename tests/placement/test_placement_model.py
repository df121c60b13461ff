"""The `Placement` type: construction, invariants, queries, JSON form, round-robin, diff."""

from __future__ import annotations

import json

import numpy as np
import pytest
from placement_helpers import assert_invariants, domain_servers

from eaas.runtime.placement import (
    SCHEMA_VERSION,
    Move,
    Placement,
    PlacementError,
    Server,
    diff,
    num_moves,
    round_robin,
)


def two_servers() -> list[Server]:
    return [Server(0, capacity=4, name="a", domain="n0"), Server(1, capacity=4, name="b", domain="n1")]


def test_constructor_and_queries() -> None:
    placement = Placement(
        layers=[3, 5],
        num_experts=2,
        servers=[Server(1, 3), Server(0, 3)],
        hosted={0: [(3, 0), (5, 0), (5, 1)], 1: [(3, 1), (5, 0)]},
        version=4,
    )
    assert placement.ordinals == (0, 1)  # sorted by ordinal
    assert placement.experts_of(0) == [(3, 0), (5, 0), (5, 1)]
    assert placement.servers_of(5, 0) == [0, 1]
    assert placement.servers_of(3, 1) == [1]
    assert placement.replication == 1 and placement.version == 4
    assert placement.routing_table() == {3: [[0], [1]], 5: [[0, 1], [0]]}
    assert placement.replica_counts().tolist() == [[1, 1], [2, 1]]
    assert placement.used_slots() == {0: 3, 1: 2}
    assert placement.hosting_matrix().shape == (2, 2, 2)
    assert not placement.hosting_matrix().flags.writeable
    assert placement.layer_index(5) == 1 and placement.server(1).capacity == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hosted": {0: [(3, 0), (3, 1), (5, 0), (5, 1), (3, 0)]}}, "twice"),
        (
            {"hosted": {0: [(3, 0), (3, 1), (5, 0), (5, 1)], 1: [(3, 0), (3, 1)], 2: [(5, 0)]}},
            "not among the servers",
        ),
        ({"hosted": {0: [(3, 0), (3, 1), (5, 0), (5, 1)], 1: [(4, 0)]}}, "MoE layers are"),
        ({"hosted": {0: [(3, 0), (3, 1), (5, 0), (5, 1)], 1: [(3, 7)]}}, "expert ids are 0..1"),
        ({"hosted": {0: [(3, 0), (3, 1), (5, 0)], 1: [(3, 0)]}}, "(layer 5, expert 1) is hosted 0 time(s)"),
        ({"hosted": {0: [(3, 0), (3, 1), (5, 0), (5, 1)], 1: [(3, "x")]}}, "pair of ints"),
        ({"hosted": {}, "replication": 3}, "replication=3 needs at least 3 servers"),
        ({"hosted": {}, "replication": 0}, "replication must be an int >= 1"),
        ({"hosted": {}, "version": -1}, "version must be an int >= 0"),
        ({"hosted": {}, "layers": []}, "at least one MoE layer"),
        ({"hosted": {}, "layers": [3, 3]}, "unique"),
    ],
)
def test_bad_constructions_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"layers": [3, 5], "num_experts": 2, "servers": two_servers()} | kwargs
    with pytest.raises(PlacementError, match=_literal(message)):
        Placement(**args)  # type: ignore[arg-type]


def test_capacity_is_enforced() -> None:
    servers = [Server(0, capacity=3), Server(1, capacity=3)]
    with pytest.raises(PlacementError, match=r"server 0 hosts 4 .* capacity is 3"):
        Placement([0], 4, servers, {0: [(0, 0), (0, 1), (0, 2), (0, 3)], 1: []})


def test_total_capacity_too_small_for_replication() -> None:
    with pytest.raises(
        PlacementError, match=r"total capacity 6 slots < replication 2 x 1 layers x 4 experts = 8"
    ):
        round_robin(1, 4, [Server(0, 3), Server(1, 3)], replication=2)


def test_replication_larger_than_servers() -> None:
    with pytest.raises(PlacementError, match="replication=3 needs at least 3 servers"):
        round_robin(2, 4, 2, replication=3)


def test_domain_spread_is_required_when_possible() -> None:
    servers = [Server(0, 4, domain="n0"), Server(1, 4, domain="n0"), Server(2, 4, domain="n1")]
    hosted = {0: [(0, 0), (0, 1)], 1: [(0, 0), (0, 1)], 2: []}
    with pytest.raises(
        PlacementError, match=r"failure domain\(s\) \['n0'\]; replication=2 needs them spread over 2"
    ):
        Placement([0], 2, servers, hosted, replication=2)
    # One domain only: spreading is impossible, so it is not required.
    same = [Server(0, 4, domain="n0"), Server(1, 4, domain="n0")]
    Placement([0], 2, same, {0: [(0, 0), (0, 1)], 1: [(0, 0), (0, 1)]}, replication=2)


def test_required_spread_degrades_to_what_the_domains_can_hold() -> None:
    # Two domains; replication 2 wants every pair in both.
    even = [
        Server(0, 8, domain="a"),
        Server(1, 8, domain="a"),
        Server(2, 8, domain="b"),
        Server(3, 8, domain="b"),
    ]
    assert round_robin(2, 4, even, replication=2).required_spread == 2
    # Domain "b" has 6 slots for 8 pairs: it cannot hold a replica of every pair, so the spread
    # requirement drops to 1 (replicas still on distinct servers).
    lopsided = [Server(0, 8, domain="a"), Server(1, 8, domain="a"), Server(2, 6, domain="b")]
    placement = round_robin(2, 4, lopsided, replication=2)
    assert placement.required_spread == 1
    assert_invariants(placement)
    # No domains at all: every server is its own domain, distinct servers are enough.
    assert round_robin(2, 4, 3, replication=2).required_spread == 2


def test_replica_shares_split_tokens_evenly() -> None:
    placement = Placement([0], 2, [Server(0, 2), Server(1, 2)], {0: [(0, 0), (0, 1)], 1: [(0, 0)]})
    shares = placement.replica_shares()
    assert shares.shape == (1, 2, 2)
    assert shares[0].tolist() == [[0.5, 0.5], [1.0, 0.0]]
    assert not shares.flags.writeable


def test_server_fields_are_validated() -> None:
    with pytest.raises(PlacementError, match="capacity must be an int >= 0"):
        Server(0, capacity=-1)
    with pytest.raises(PlacementError, match="ordinal must be an int >= 0"):
        Server(-2, capacity=1)
    with pytest.raises(PlacementError, match="domain must be a non-empty string"):
        Server(0, capacity=1, domain="")
    with pytest.raises(PlacementError, match="ordinals must be unique"):
        round_robin(1, 2, [Server(0, 2), Server(0, 2)])


def test_unknown_lookups_name_allowed_values() -> None:
    placement = round_robin([3, 4], 4, 2)
    with pytest.raises(PlacementError, match=r"no server with ordinal 9; servers are \[0, 1\]"):
        placement.experts_of(9)
    with pytest.raises(PlacementError, match=r"layer 7 is not a MoE layer; layers are \[3, 4\]"):
        placement.servers_of(7, 0)
    with pytest.raises(PlacementError, match=r"expert must be in 0..3"):
        placement.servers_of(3, 4)


def test_json_round_trip_is_stable() -> None:
    placement = round_robin(
        range(3, 9), 8, domain_servers(4, capacity=30, num_domains=2), replication=2, version=7
    )
    text = placement.to_json()
    again = Placement.from_json(text)
    assert again == placement
    assert again.to_json() == text
    data = json.loads(text)
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["version"] == 7
    assert data["servers"][1] == {
        "ordinal": 1,
        "name": "expert-1",
        "domain": "node-1",
        "capacity": 30,
        "experts": [list(pair) for pair in placement.experts_of(1)],
    }
    assert Placement.from_dict(placement.to_dict()) == placement


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=2), "schema_version is 2; this build reads schema_version 1"),
        (lambda d: d.pop("schema_version"), "schema_version is None"),
        (lambda d: d.pop("version"), "placement.version is missing"),
        (lambda d: d.update(version="3"), "placement.version must be an int"),
        (lambda d: d.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda d: d.update(layers="3,4"), "placement.layers must be a list of ints"),
        (lambda d: d.update(servers={}), "placement.servers must be a list"),
        (
            lambda d: d["servers"][0].update(experts=[[3]]),
            r"placement.servers\[0\].experts\[0\]: expected a \[layer, expert\]",
        ),
        (lambda d: d["servers"][1].update(capacity=1.5), r"placement.servers\[1\].capacity must be an int"),
        (lambda d: d["servers"][1].update(ordinal=0), r"placement.servers\[1\]: ordinal 0 appears twice"),
        (lambda d: d["servers"][0].update(colour="red"), r"placement.servers\[0\] has unknown field"),
        (lambda d: d["servers"][0].update(experts=[]), r"is hosted 0 time\(s\)"),
    ],
)
def test_malformed_json_is_rejected_with_the_field_named(mutate: object, message: str) -> None:
    data = round_robin([3, 4], 4, 2).to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(PlacementError, match=message):
        Placement.from_json(json.dumps(data))


def test_not_json_at_all() -> None:
    with pytest.raises(PlacementError, match="not valid JSON"):
        Placement.from_json("{nope")
    with pytest.raises(PlacementError, match="must be a JSON object"):
        Placement.from_json("[]")


def test_round_robin_deals_evenly_and_spreads_domains() -> None:
    placement = round_robin(range(3, 61), 256, domain_servers(64, capacity=261, num_domains=8))
    assert_invariants(placement)
    assert set(placement.used_slots().values()) == {232}  # 58 x 256 / 64
    replicated = round_robin(4, 16, domain_servers(6, capacity=32, num_domains=3), replication=3)
    assert_invariants(replicated)
    for layer in replicated.layers:
        for expert in range(16):
            domains = {replicated.server(o).domain for o in replicated.servers_of(layer, expert)}
            assert len(domains) == 3


def test_round_robin_with_uneven_capacities_and_counts() -> None:
    servers = [Server(0, 12), Server(1, 2), Server(2, 12), Server(3, 8)]
    placement = round_robin(2, 8, servers, replication=2)
    assert_invariants(placement)
    assert placement.used_slots()[1] <= 2
    auto = round_robin([0, 1], 5, 3, replication=2)
    assert [s.capacity for s in auto.servers] == [7, 7, 7]  # ceil(2 * 10 / 3)
    with pytest.raises(PlacementError, match="capacity= applies only when servers is a count"):
        round_robin(1, 2, [Server(0, 2)], capacity=3)


def test_diff_lists_loads_and_unloads() -> None:
    old = Placement([0], 3, [Server(0, 3), Server(1, 3)], {0: [(0, 0), (0, 1)], 1: [(0, 2)]}, version=1)
    new = Placement(
        [0], 3, [Server(1, 3), Server(2, 3)], {1: [(0, 2), (0, 0)], 2: [(0, 1), (0, 0)]}, version=2
    )
    change = diff(old, new)
    assert change.loads == (Move(1, 0, 0), Move(2, 0, 0), Move(2, 0, 1))
    assert change.unloads == (Move(0, 0, 0), Move(0, 0, 1))
    assert change.added_servers == (2,) and change.removed_servers == (0,)
    assert change.num_moves == 3 == num_moves(old, new)
    assert change.loads_by_server() == {1: [(0, 0)], 2: [(0, 0), (0, 1)]}
    assert change.max_loads_per_server() == 2
    assert diff(old, old).is_empty
    with pytest.raises(PlacementError, match="different models"):
        diff(old, round_robin([1], 3, 2))


def test_with_version_and_equality() -> None:
    placement = round_robin([0, 1], 4, 2)
    bumped = placement.with_version(5)
    assert bumped.version == 5 and bumped.same_assignment(placement) and bumped != placement
    assert hash(placement) == hash(round_robin([0, 1], 4, 2))
    assert "Placement(version=0" in repr(placement)


def test_from_matrix_checks_shape_and_values() -> None:
    servers = [Server(0, 4), Server(1, 4)]
    with pytest.raises(PlacementError, match=r"shape \(2, 1, 3\); expected \[S, L, E\] = \(2, 1, 2\)"):
        Placement.from_matrix([0], 2, servers, np.ones((2, 1, 3), dtype=bool))
    with pytest.raises(PlacementError, match="only 0/1"):
        Placement.from_matrix([0], 2, servers, np.full((2, 1, 2), 2))
    ok = Placement.from_matrix([0], 2, servers, np.array([[[1, 0]], [[0, 1]]]))
    assert ok.experts_of(1) == [(0, 1)]


def _literal(text: str) -> str:
    import re

    return re.escape(text)
