"""The planners' one search (`eaas.runtime.placement.search`), on its own: every state it returns is
a valid placement, its bookkeeping matches a recomputation from that placement, and the objective
it reports is the real one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_helpers import assert_invariants, domain_servers, trace_load
from test_placement_properties import COSTS, SETTINGS, instances

from eaas.runtime.placement import (
    CostModel,
    Placement,
    Server,
    cost_aware,
    forecast_loads,
    predicted_seconds,
    round_robin,
)
from eaas.runtime.placement.cost import failover_shares
from eaas.runtime.placement.cost_aware import PORTFOLIO_MAX_CELLS
from eaas.runtime.placement.search import (
    _RELOCATE,
    _SWAP,
    SWAP_WEIGHT,
    Search,
    _first_seen,
    _rank_within,
    search_for,
)


def check_search(current: Placement, load: np.ndarray, cost: CostModel, horizon: int, step: int) -> Placement:
    """Run a search; check its result and bookkeeping; return the placement it found."""
    search = search_for(current, load, cost, horizon)
    keep = search.objective()
    assert keep == pytest.approx(predicted_seconds(current, current, load, cost, horizon), rel=1e-9)
    best = search.optimize(step=step)
    assert best <= keep
    found = Placement.from_matrix(
        current.layers, current.num_experts, current.servers, search.matrix(), current.replication, 1
    )
    assert_invariants(found)
    assert best == pytest.approx(predicted_seconds(current, found, load, cost, horizon), rel=1e-9, abs=1e-12)
    # The incremental state (after any rounds taken back) equals a fresh computation.
    np.testing.assert_allclose(
        search.tokens, forecast_loads(found, load, cost.load_error), rtol=1e-9, atol=1e-9
    )
    np.testing.assert_array_equal(search.count, found.replica_counts())
    if search.overlap is not None:  # the tokens each server takes over from each other one
        held = found.hosting_matrix().transpose(1, 0, 2).astype(np.float64)
        weights = failover_shares(search.share, search.count)[:, None, :]
        expected = (held * weights) @ held.transpose(0, 2, 1)
        diagonal = np.arange(found.num_servers)
        expected[:, diagonal, diagonal] = -np.inf  # a server takes nothing over from itself
        np.testing.assert_allclose(search.overlap, expected, atol=1e-9)
    used = found.used_slots()
    assert search.used.tolist() == [used[ordinal] for ordinal in found.ordinals]
    fresh = found.hosting_matrix() & ~current.hosting_matrix()
    assert search.new_loads.tolist() == fresh.reshape(len(found.ordinals), -1).sum(axis=1).tolist()
    for layer in range(len(found.layers)):
        for server in range(found.num_servers):
            hosted = sorted(int(e) for e in search.table[layer, server] if e >= 0)
            assert hosted == np.flatnonzero(found.hosting_matrix()[server, layer]).tolist()
            assert search.filled[layer, server] == len(hosted)
    return found


@SETTINGS
@given(instances(), COSTS, st.integers(1, 1000))
def test_every_step_size_gives_a_valid_placement_and_true_objective(
    instance: tuple[Placement, np.ndarray], cost: CostModel, horizon: int
) -> None:
    current, load = instance
    for step in (1, 2, 8):
        check_search(current, load, cost, horizon, step)


@pytest.mark.parametrize("replication", [1, 2])
def test_large_instance_uses_the_rounds_alone(replication: int) -> None:
    # 12 layers x 64 experts on 16 servers in 4 domains: above the portfolio threshold.
    servers = domain_servers(16, replication * 12 * 64 // 16 + 8, 4)
    current = round_robin(12, 64, servers, replication)
    assert current.hosting_matrix().size > PORTFOLIO_MAX_CELLS
    load = trace_load(12, 64, seed=3, steps=50)
    cost = CostModel()
    found = check_search(current, load, cost, 100, 8)
    plan = cost_aware(current, load, cost, horizon_steps=100)
    assert plan is not current and plan.same_assignment(found)
    keep = predicted_seconds(current, current, load, cost, 100)
    # (R = 2: the failover bound counts too, and a round-robin start is far over it.)
    assert predicted_seconds(current, plan, load, cost, 100) < (0.9 if replication == 1 else 0.95) * keep
    assert cost_aware(current, load, cost, horizon_steps=100) == plan  # deterministic


def test_move_budget_is_respected() -> None:
    current = round_robin(12, 64, domain_servers(16, 60, 4))
    load = trace_load(12, 64, seed=4)
    for budget in (1, 7, 40):
        search = search_for(current, load, CostModel(), 1000, max_moves=budget)
        start = search.objective()
        assert search.optimize() < start  # the budget still buys a gain
        assert 0 < search.moves <= budget
        # The budget counts (layer, expert, server) loads, as `diff` does.
        loaded = search.matrix() & ~current.hosting_matrix()
        assert int(loaded.sum()) == search.moves


@SETTINGS
@given(st.lists(st.integers(0, 9), max_size=60))
def test_first_seen_and_rank_within_match_a_loop(keys: list[int]) -> None:
    """The grant's bounded-range helpers agree with a plain loop over the events."""
    array = np.array(keys, dtype=np.int64)
    seen: dict[int, int] = {}
    first, rank = [], []
    for key in keys:
        first.append(key not in seen)
        rank.append(seen.get(key, 0))
        seen[key] = seen.get(key, 0) + 1
    np.testing.assert_array_equal(_first_seen(array, 10), np.array(first, dtype=bool))
    np.testing.assert_array_equal(_rank_within(array, 10), np.array(rank, dtype=np.int64))


@SETTINGS
@given(instances(), COSTS, st.integers(1, 1000), st.integers(0, 2**16))
def test_escape_is_valid_and_never_worse(
    instance: tuple[Placement, np.ndarray], cost: CostModel, horizon: int, seed: int
) -> None:
    """The iterated local search's kicks are taken back unless they lead somewhere better."""
    current, load = instance
    search = search_for(current, load, cost, horizon)
    settled = search.optimize(step=1, stop_step=1)
    best = search.escape(8, seed, step=1, stop_step=1)
    assert best <= settled + 1e-12
    assert abs(best - search.objective()) <= 1e-9 * max(1.0, best)
    found = Placement.from_matrix(
        current.layers, current.num_experts, current.servers, search.matrix(), current.replication
    )
    assert_invariants(found)
    assert best == pytest.approx(predicted_seconds(current, found, load, cost, horizon), rel=1e-9, abs=1e-12)


def test_a_binding_budget_buys_the_best_gain_per_load() -> None:
    """Two proposals in different layers: a swap (two loads) of larger gain and a relocation (one
    load). With one load left the relocation is granted; with no budget, both."""
    current = round_robin(2, 8, [Server(i, 8) for i in range(4)], replication=1)
    load = np.ones((2, 8))

    def proposals(search: Search) -> tuple[np.ndarray, ...]:
        e, f = int(search.table[0, 0, 0]), int(search.table[0, 1, 0])  # layer 0: e on 0, f on 1
        g = int(search.table[1, 2, 0])  # layer 1: g on 2, relocated to 3
        swap, relocate = SWAP_WEIGHT * 4.0, 2.5  # unweighted: 2.0 and 2.5 per load
        return tuple(
            np.array(column)
            for column in zip(
                (swap, _SWAP, 0, e, f, 0, 1), (relocate, _RELOCATE, 1, g, -1, 2, 3), strict=True
            )
        )

    for budget, granted in (
        (1, [_RELOCATE]),
        (2, [_RELOCATE]),
        (3, [_RELOCATE, _SWAP]),
        (None, [_SWAP, _RELOCATE]),
    ):
        search = search_for(current, load, CostModel(), 100, max_moves=budget)
        kinds = search._grant(proposals(search), allowance=10)[0]
        assert sorted(kinds.tolist()) == sorted(granted), budget
