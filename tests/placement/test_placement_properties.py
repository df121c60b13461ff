"""Property tests: planners never return an invalid placement, whatever the instance and load."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_helpers import assert_invariants

from eaas.runtime.placement import (
    CostModel,
    Placement,
    PlacementError,
    Server,
    add_server,
    cost_aware,
    drain_server,
    predicted_seconds,
    recover,
    replicate_and_pack,
    round_robin,
)
from eaas.runtime.placement.cost import compute_peaks, forecast_loads
from eaas.runtime.placement.cost_aware import gain_bound
from eaas.runtime.placement.eplb import keep_in_place
from eaas.runtime.placement.search import search_for

# EAAS_PLACEMENT_EXAMPLES=1000 for a thorough local run; the default keeps the suite fast.
EXAMPLES = int(os.environ.get("EAAS_PLACEMENT_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instances(draw: st.DrawFn) -> tuple[Placement, np.ndarray]:
    """A random valid round-robin placement (uneven capacities, optional domains) and load."""
    num_layers = draw(st.integers(1, 3))
    num_experts = draw(st.integers(2, 8))
    num_servers = draw(st.integers(2, 6))
    replication = draw(st.integers(1, min(3, num_servers)))
    num_domains = draw(st.integers(0, num_servers))  # 0 = no domains
    pairs = num_layers * num_experts
    base = -(-replication * pairs // num_servers)
    spare = draw(st.lists(st.integers(0, 4), min_size=num_servers, max_size=num_servers))
    servers = [
        Server(i, min(base + spare[i], pairs), domain=f"d{i % num_domains}" if num_domains else None)
        for i in range(num_servers)
    ]
    load = np.array(
        draw(st.lists(st.floats(0, 1000, allow_nan=False), min_size=pairs, max_size=pairs)), dtype=np.float64
    ).reshape(num_layers, num_experts)
    return round_robin(num_layers, num_experts, servers, replication), load


COSTS = st.builds(
    CostModel,
    seconds_per_token=st.sampled_from([1e-7, 1e-6, 1e-5]),
    seconds_per_expert_load=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2]),
    load_error=st.sampled_from([0.0, 0.0, 0.1, 0.5]),
    failover_factor=st.sampled_from([0.0, 1.0, 1.3, 2.0]),
)


@SETTINGS
@given(instances(), COSTS, st.integers(1, 1000))
def test_cost_aware_output_is_valid_and_never_worse(
    instance: tuple[Placement, np.ndarray], cost: CostModel, horizon: int
) -> None:
    current, load = instance
    plan = cost_aware(current, load, cost, horizon_steps=horizon)
    assert_invariants(plan)
    if plan is not current:
        assert plan.version == current.version + 1
        keep = predicted_seconds(current, current, load, cost, horizon)
        assert predicted_seconds(current, plan, load, cost, horizon) < keep
    assert cost_aware(current, load, cost, horizon_steps=horizon) == plan


@SETTINGS
@given(instances(), COSTS, st.integers(1, 1000), st.booleans(), st.integers(0, 2**16))
def test_the_skip_bound_covers_every_gain_the_searches_find(
    instance: tuple[Placement, np.ndarray], cost: CostModel, horizon: int, replicated: bool, seed: int
) -> None:
    """`gain_bound` (which lets cost_aware skip the search) is at least what the searches save,
    also from a rebalanced placement that holds surplus replicas."""
    current, load = instance
    if replicated:
        current = cost_aware(current, load[:, ::-1].copy(), cost, horizon_steps=horizon)
        load = load * np.random.default_rng(seed).uniform(0.5, 1.5, load.shape)
    tokens = forecast_loads(current, load, cost.load_error)
    floor = load.sum(axis=1) / current.num_servers
    excess = compute_peaks(current, load, cost) - tokens.max(axis=1)
    bound = gain_bound(
        tokens, current.replica_counts(), current.replication, cost, horizon, floor=floor, excess=excess
    )
    keep = predicted_seconds(current, current, load, cost, horizon)
    fresh = keep_in_place(current, replicate_and_pack(current, load))
    found = [predicted_seconds(current, fresh, load, cost, horizon)]
    for step in (1, 8):
        found.append(search_for(current, load, cost, horizon).optimize(step=step))
    escaping = search_for(current, load, cost, horizon)
    escaping.optimize(step=1, stop_step=1)
    found.append(escaping.escape(8, seed, step=1, stop_step=1))
    gain = keep - min(found)  # 0 when no search moved anything (the bound is about changes)
    assert gain <= 1e-9 * keep or bound >= gain - 1e-9 * keep


@SETTINGS
@given(instances())
def test_eplb_output_is_valid(instance: tuple[Placement, np.ndarray]) -> None:
    current, load = instance
    plan = replicate_and_pack(current, load)
    assert_invariants(plan)
    assert replicate_and_pack(current, load) == plan
    aware = replicate_and_pack(current, load, failure_aware=True)
    assert_invariants(aware)
    assert replicate_and_pack(current, load, failure_aware=True) == aware


@SETTINGS
@given(instances(), st.data())
def test_elastic_outputs_keep_every_expert_served(
    instance: tuple[Placement, np.ndarray], data: st.DataObject
) -> None:
    current, load = instance
    if data.draw(st.booleans()):
        # Start from a rebalanced placement, whose spare slots hold extra replicas.
        current = cost_aware(current, load, CostModel(seconds_per_expert_load=0.0), horizon_steps=1000)
    grown = add_server(current, Server(99, data.draw(st.integers(0, 6)), domain="d0"), load)
    assert_invariants(grown)
    leaving = data.draw(st.sampled_from(current.ordinals))
    try:
        drained = drain_server(current, leaving, load)
    except PlacementError as error:
        assert "cannot drain" in str(error)
    else:
        assert_invariants(drained)
        assert leaving not in drained.ordinals and drained.replication == current.replication
    failed = data.draw(
        st.lists(st.sampled_from(current.ordinals), max_size=current.num_servers - 1, unique=True)
    )
    try:
        survivors = recover(current, failed, load)
    except PlacementError as error:
        assert "cannot recover" in str(error)
    else:
        assert_invariants(survivors)
        assert 1 <= survivors.replication <= current.replication
        assert not set(failed) & set(survivors.ordinals)
