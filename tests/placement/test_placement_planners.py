"""Planners: EPLB baseline, cost-aware rebalance, ILP oracle — invariants, quality, determinism."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from placement_helpers import assert_invariants, domain_servers, trace_load

from eaas.runtime.placement import (
    CostModel,
    Placement,
    PlacementError,
    Server,
    SyntheticTrace,
    TraceConfig,
    cost_aware,
    failover_loads,
    ilp,
    imbalance,
    layer_quotas,
    num_moves,
    predicted_seconds,
    replicate_and_pack,
    round_robin,
)
from eaas.runtime.placement.cost import server_loads
from eaas.runtime.placement.cost_aware import gain_bound
from eaas.runtime.placement.diff import diff
from eaas.runtime.placement.eplb import keep_in_place
from eaas.runtime.placement.search import search_for


def mid_instance(seed: int = 0) -> tuple[Placement, np.ndarray]:
    """8 layers x 64 experts on 16 servers in 4 nodes, R=1, 12.5% redundant slots (like DSV3's 32/256)."""
    servers = domain_servers(16, capacity=36, num_domains=4)  # 8 x 72 / 16
    return round_robin(range(3, 11), 64, servers), trace_load(8, 64, seed=seed, steps=50)


# -- replicate_and_pack (EPLB) -------------------------------------------------------------------


def test_layer_quotas_rotate_the_remainder() -> None:
    quotas = layer_quotas([261] * 64, 58, 288, 256)
    assert quotas.shape == (58, 64)
    assert (quotas.sum(axis=1) == 288).all()
    assert (quotas.sum(axis=0) <= 261).all() and quotas.sum() == 58 * 288
    assert set(np.unique(quotas)) == {4, 5}
    uneven = layer_quotas([10, 20, 30], 4, 12, 8)
    assert (uneven.sum(axis=1) == 12).all() and (uneven.sum(axis=0) <= [10, 20, 30]).all()
    with pytest.raises(PlacementError, match="exceed the servers' usable capacity"):
        layer_quotas([4, 4], 2, 5, 8)


def test_eplb_balances_and_uses_every_slot() -> None:
    current, load = mid_instance()
    plan = replicate_and_pack(current, load, slots_per_layer=72)
    assert_invariants(plan)
    assert plan.version == current.version + 1
    counts = plan.replica_counts()
    assert (counts.sum(axis=1) == 72).all()
    # The hottest expert of every layer gets the most replicas.
    assert (counts[np.arange(8), load.argmax(axis=1)] == counts.max(axis=1)).all()
    before, after = imbalance(current, load), imbalance(plan, load)
    assert before > 1.5 and after < 1.1
    assert replicate_and_pack(current, load, slots_per_layer=72) == plan  # deterministic


def test_eplb_hierarchical_keeps_groups_on_one_node() -> None:
    current, load = mid_instance()
    plan = replicate_and_pack(current, load, slots_per_layer=72, num_groups=8)
    assert_invariants(plan)
    for layer in plan.layers:
        for group in range(8):
            nodes = {
                plan.server(o).domain
                for e in range(group * 8, group * 8 + 8)
                for o in plan.servers_of(layer, e)
            }
            assert len(nodes) == 1, (layer, group, nodes)
    assert imbalance(plan, load) < imbalance(current, load)
    # 8 groups do not divide over 3 nodes: the global policy is used instead.
    three_nodes = round_robin(range(8), 64, domain_servers(15, capacity=40, num_domains=3))
    assert_invariants(replicate_and_pack(three_nodes, load, num_groups=8))


def test_eplb_with_replication_spreads_over_domains() -> None:
    current = round_robin(4, 8, domain_servers(4, capacity=18, num_domains=2), replication=2)
    for seed in range(6):
        plan = replicate_and_pack(current, trace_load(4, 8, seed=seed))
        assert_invariants(plan)


def test_failure_aware_packing_spreads_each_servers_partners() -> None:
    """Plain heaviest-first packing pairs servers: an expert's two replicas (equal shares) land on
    two servers tied in load, which stay tied, so they end up sharing most of their experts and
    one's failure doubles the other's load. The failure-aware packing keeps the balance (within 5%
    on this small shape, 4.5 slots per server and layer) and spreads each server's experts' other
    replicas over many servers: the load after the worst single failure (every failure, exactly
    as `failover_loads` computes it, checked against dropping the server) is much lower."""
    current = round_robin(4, 32, [Server(o, 36) for o in range(16)], replication=2)
    for seed in range(6):
        load = trace_load(4, 32, seed=seed, steps=50)
        plain = replicate_and_pack(current, load, slots_per_layer=72)
        aware = replicate_and_pack(current, load, slots_per_layer=72, failure_aware=True)
        assert_invariants(aware)
        assert (aware.replica_counts() == plain.replica_counts()).all()  # the same replication
        healthy = [server_loads(p, load).max(axis=1).sum() for p in (plain, aware)]
        assert healthy[1] <= 1.05 * healthy[0], seed
        after = [failover_loads(p, load).sum(axis=1) for p in (plain, aware)]
        assert after[1].max() / healthy[1] < 0.9 * after[0].max() / healthy[0], seed
        assert after[1].mean() / healthy[1] < after[0].mean() / healthy[0], seed
        for placement, expected in zip((plain, aware), after, strict=True):
            for index in range(placement.num_servers):
                matrix = placement.hosting_matrix().copy()
                matrix[index] = False
                dropped = Placement.from_matrix(placement.layers, 32, placement.servers, matrix)
                assert server_loads(dropped, load).max(axis=1).sum() == pytest.approx(expected[index])


def test_eplb_bad_inputs() -> None:
    current, load = mid_instance()
    with pytest.raises(PlacementError, match="slots_per_layer must be an int >= replication x experts = 64"):
        replicate_and_pack(current, load, slots_per_layer=60)
    with pytest.raises(PlacementError, match="num_groups must divide num_experts=64"):
        replicate_and_pack(current, load, num_groups=7)
    with pytest.raises(PlacementError, match=r"load has shape \(8, 32\); expected \[L, E\] = \(8, 64\)"):
        replicate_and_pack(current, load[:, :32])
    replicated = round_robin(8, 64, domain_servers(16, capacity=72, num_domains=4), replication=2)
    with pytest.raises(PlacementError, match="hierarchical packing keeps an expert group on one node"):
        replicate_and_pack(replicated, load, num_groups=8)


# -- cost_aware ---------------------------------------------------------------------------------


def test_cost_aware_skips_when_balanced() -> None:
    current, _ = mid_instance()
    uniform = np.full((8, 64), 50.0)
    assert cost_aware(current, uniform) is current


def test_cost_aware_returns_current_when_the_gain_does_not_pay() -> None:
    current, load = mid_instance()
    expensive = CostModel(seconds_per_expert_load=5.0)
    assert cost_aware(current, load, expensive, horizon_steps=10) is current
    slow_planner = CostModel(planner_seconds=1e3)
    assert cost_aware(current, load, slow_planner, horizon_steps=100) is current


def test_the_skip_bound_charges_the_loads_a_balance_needs() -> None:
    """16 layers where half of the 8 servers carry 1100 tokens and half 900: a perfect balance gains
    100 tokens per layer per step, but 4 servers per layer must shed an expert (64 loads, 8 on the
    busiest loader). The bound takes the best depth per layer: 4 servers for 2.5 ms of compute
    over 100 steps, charged 4/8 of a 1 ms load."""
    servers = [Server(s, 20) for s in range(8)]
    current = Placement(range(16), 8, servers, {s: [(layer, s) for layer in range(16)] for s in range(8)})
    load = np.tile([1100.0] * 4 + [900.0] * 4, (16, 1))
    cost = CostModel()
    bound = gain_bound(server_loads(current, load), current.replica_counts(), 1, cost, 100)
    assert bound == pytest.approx(16 * (100 * 100 * cost.seconds_per_token - 4 / 8 * 1e-3))
    assert bound < 16 * 100 * 100 * cost.seconds_per_token - 1e-3  # the perfect-balance bound
    assert cost_aware(current, load, replace(cost, planner_seconds=bound), horizon_steps=100) is current


def test_cost_aware_improves_the_objective_with_few_moves() -> None:
    current, load = mid_instance()
    cost = CostModel()
    plan = cost_aware(current, load, cost, horizon_steps=100)
    assert_invariants(plan)
    assert plan.version == current.version + 1
    baseline = replicate_and_pack(current, load, slots_per_layer=72)
    keep = predicted_seconds(current, current, load, cost, 100)
    ours = predicted_seconds(current, plan, load, cost, 100)
    eplb = predicted_seconds(current, baseline, load, cost, 100)
    assert ours < keep and ours < eplb
    assert imbalance(plan, load) < 1.1 * imbalance(baseline, load)
    assert num_moves(current, plan) < 0.3 * num_moves(current, baseline)
    assert cost_aware(current, load, cost, horizon_steps=100) == plan  # deterministic


def test_cost_aware_escapes_a_local_optimum() -> None:
    # 2 layers x 8 experts on 4 full-ish servers: layer 1's hottest expert alone is the peak, and
    # replicating it onto any server raises that server above the peak unless something leaves it
    # first (a neutral step, which no improving move takes). The kicks of the iterated local
    # search find it.
    servers = [Server(i, 5, domain=f"node-{i % 2}") for i in range(4)]
    current = round_robin(2, 8, servers)
    trace = SyntheticTrace(TraceConfig(num_layers=2, num_experts=8, tokens_per_step=8 * 128, seed=101))
    load = trace.loads(0, 100).mean(axis=0).astype(np.float64)
    cost = CostModel()
    search = search_for(current, load, cost, 100)
    settled = search.optimize(step=1, stop_step=1)
    escaped = search.escape(32, step=1, stop_step=1)
    assert escaped < 0.99 * settled
    # On an instance this small cost_aware runs the escape too (its portfolio).
    plan = cost_aware(current, load, cost, horizon_steps=100)
    assert_invariants(plan)
    assert predicted_seconds(current, plan, load, cost, 100) <= escaped * (1 + 1e-9)


def test_cost_aware_longer_horizons_buy_more_balance() -> None:
    current, load = mid_instance(seed=1)
    short = cost_aware(current, load, horizon_steps=20)
    long = cost_aware(current, load, horizon_steps=2000)
    assert num_moves(current, short) <= num_moves(current, long)
    assert imbalance(long, load) <= imbalance(short, load)


def test_cost_aware_respects_the_move_budget() -> None:
    current, load = mid_instance()
    plan = cost_aware(current, load, horizon_steps=100, max_moves=10)
    assert 0 < num_moves(current, plan) <= 10  # loads, a swap's two included
    assert cost_aware(current, load, max_moves=0) is current
    with pytest.raises(PlacementError, match="max_moves must be an int >= 0"):
        cost_aware(current, load, max_moves=-1)


def test_cost_aware_keeps_replication_and_domains(small: tuple[Placement, np.ndarray]) -> None:
    current, load = small
    plan = cost_aware(current, load, horizon_steps=1000)
    assert plan is not current
    assert_invariants(plan)
    assert plan.replication == 2


def test_cost_aware_from_a_balanced_start_moves_little() -> None:
    current, load = mid_instance()
    balanced = cost_aware(current, load, horizon_steps=100)
    # Slightly different load (next window): an incremental rebalance, not a reshuffle.
    drifted = load * np.random.default_rng(0).uniform(0.9, 1.1, size=load.shape)
    again = cost_aware(balanced, drifted, horizon_steps=100)
    reshuffle = replicate_and_pack(balanced, drifted, slots_per_layer=72)
    assert again is not balanced  # it pays to rebalance (here by dropping surplus replicas)
    keep = predicted_seconds(balanced, balanced, drifted, CostModel(), 100)
    assert predicted_seconds(balanced, again, drifted, CostModel(), 100) < keep
    assert num_moves(balanced, again) < 0.2 * num_moves(balanced, reshuffle)


def concentration(placement: Placement, load: np.ndarray) -> float:
    """Mean over layers of the largest sqrt(sum of squared shares) of a server: how far the busiest
    server swings when every expert's load drifts by the same relative amount."""
    shares = placement.replica_shares() * load[:, :, None]  # [L, E, S]
    return float(np.sqrt((shares**2).sum(axis=1)).max(axis=1).mean())


def test_cost_aware_with_a_load_error_spreads_heavy_shares() -> None:
    current, load = mid_instance()
    plain = cost_aware(current, load, horizon_steps=100)
    hedged_cost = CostModel(load_error=0.3)
    hedged = cost_aware(current, load, hedged_cost, horizon_steps=100)
    assert_invariants(hedged)
    assert concentration(hedged, load) < 0.95 * concentration(plain, load)
    # It still balances the forecast, and by its own (forecast-token) objective it beats the plain plan.
    assert imbalance(hedged, load) < 1.1
    assert predicted_seconds(current, hedged, load, hedged_cost, 100) < predicted_seconds(
        current, plain, load, hedged_cost, 100
    )


def test_keep_in_place_exchanges_equal_servers_to_move_less() -> None:
    current, load = mid_instance()
    current = cost_aware(current, load, horizon_steps=100)
    later = trace_load(8, 64, seed=3, steps=50)
    packed = replicate_and_pack(current, later)
    kept = keep_in_place(current, packed)
    assert_invariants(kept)
    assert num_moves(current, kept) < 0.9 * num_moves(current, packed)
    new, old = kept.hosting_matrix(), packed.hosting_matrix()
    assert (new.sum(axis=2) == old.sum(axis=2)).all()  # every server keeps its slots per layer
    for layer in range(new.shape[1]):  # the same replica sets, on other servers
        assert sorted(map(tuple, new[:, layer].tolist())) == sorted(map(tuple, old[:, layer].tolist()))
    assert imbalance(kept, later) == pytest.approx(imbalance(packed, later))
    assert keep_in_place(packed, packed) is packed
    with pytest.raises(PlacementError, match="same servers, layers and experts"):
        keep_in_place(round_robin(1, 4, 2), round_robin(1, 4, 3))
    with pytest.raises(PlacementError, match="same servers, layers and experts"):
        keep_in_place(round_robin(1, 4, 2), round_robin(1, 6, 2))


def test_keep_in_place_keeps_the_packing_when_an_exchange_breaks_the_domain_spread() -> None:
    # Found by search: here the best exchange puts both replicas of (0, 3) in domain d0.
    rng = np.random.default_rng(8)
    num_servers = int(rng.integers(3, 7))
    num_domains, layers = int(rng.integers(2, num_servers)), int(rng.integers(1, 3))
    experts = int(rng.integers(2, 7))
    capacity = -(-2 * layers * experts // num_servers) + int(rng.integers(0, 3))
    servers = [Server(i, capacity, domain=f"d{i % num_domains}") for i in range(num_servers)]
    current = round_robin(layers, experts, servers, 2)
    # (The placement cost_aware finds without the failover bound.)
    current = cost_aware(
        current, rng.uniform(0, 100, (layers, experts)), CostModel(failover_factor=0.0), horizon_steps=1000
    )
    packed = replicate_and_pack(current, rng.uniform(0, 100, (layers, experts)))
    assert not packed.same_assignment(current)
    assert keep_in_place(current, packed) is packed
    assert_invariants(packed)


def test_cost_aware_takes_a_fresh_packing_when_the_search_is_stuck() -> None:
    """An aged DeepSeek-V3-shaped placement at a long horizon: the move-little search ends in a
    local optimum that a fresh packing, kept in place, beats by the same objective."""
    trace = SyntheticTrace(TraceConfig(seed=0))
    servers = [Server(i, 261, domain=f"node-{i // 8}") for i in range(64)]
    aged = cost_aware(
        round_robin(range(3, 61), 256, servers), trace.loads(0, 100).mean(axis=0), horizon_steps=1000
    )
    load = trace.loads(1000, 1100).mean(axis=0).astype(np.float64)
    plan = cost_aware(aged, load, horizon_steps=1000)
    fresh = keep_in_place(aged, replicate_and_pack(aged, load, failure_aware=True))
    assert plan.same_assignment(fresh) and plan.version == aged.version + 1
    searched = search_for(aged, load, CostModel(), 1000).optimize()
    assert predicted_seconds(aged, plan, load, CostModel(), 1000) < searched
    assert num_moves(aged, plan) < num_moves(aged, replicate_and_pack(aged, load))
    # A move budget rules the fresh packing out.
    budgeted = cost_aware(aged, load, horizon_steps=1000, max_moves=500)
    assert num_moves(aged, budgeted) <= 500


# -- ilp ----------------------------------------------------------------------------------------


def test_ilp_is_a_lower_bound_for_the_heuristics() -> None:
    servers = [Server(i, 4, domain=f"n{i % 2}") for i in range(3)]
    current = round_robin(1, 10, servers)
    load = trace_load(1, 10, seed=5) * np.linspace(3.0, 0.2, 10)
    cost = CostModel()
    solution = ilp(current, load, cost, horizon_steps=100, time_limit_seconds=20)
    assert solution.is_optimal
    assert_invariants(solution.placement)
    best = solution.predicted_seconds
    assert best == pytest.approx(predicted_seconds(current, solution.placement, load, cost, 100))
    for plan in (
        current,
        cost_aware(current, load, cost, horizon_steps=100),
        replicate_and_pack(current, load),
    ):
        assert best <= predicted_seconds(current, plan, load, cost, 100) + 1e-12
    assert best < predicted_seconds(current, current, load, cost, 100)
    # The bound cost_aware skips by covers the optimum's gain.
    keep = predicted_seconds(current, current, load, cost, 100)
    bound = gain_bound(server_loads(current, load), current.replica_counts(), current.replication, cost, 100)
    assert bound >= keep - best - 1e-12


def test_ilp_keeps_current_when_nothing_pays() -> None:
    current = round_robin(1, 4, 2, capacity=3)
    solution = ilp(current, np.full((1, 4), 10.0), horizon_steps=1)
    assert solution.placement is current and solution.is_optimal


def test_ilp_refuses_large_instances() -> None:
    current = round_robin(20, 64, 16)
    with pytest.raises(PlacementError, match="oracle for small instances"):
        ilp(current, np.ones((20, 64)))
    with pytest.raises(PlacementError, match="time_limit_seconds must be > 0"):
        ilp(round_robin(1, 4, 2), np.ones((1, 4)), time_limit_seconds=0)
    with pytest.raises(PlacementError, match=r"ilp models the forecast itself \(CostModel.load_error = 0\)"):
        ilp(round_robin(1, 4, 2), np.ones((1, 4)), CostModel(load_error=0.1))


def test_diff_of_a_rebalance_names_every_load() -> None:
    current, load = mid_instance()
    plan = cost_aware(current, load)
    change = diff(current, plan)
    for move in change.loads:
        assert move.server in plan.servers_of(move.layer, move.expert)
        assert move.server not in current.servers_of(move.layer, move.expert)
