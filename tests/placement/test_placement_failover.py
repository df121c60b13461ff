"""The failover term of the planners' objective (`CostModel.failover_factor`): the busiest survivor
after any single failure is kept within a bound of each layer's mean, with hot experts given more
replicas where a failure would overload their partners."""

from __future__ import annotations

import numpy as np
import pytest

from eaas.runtime.placement import (
    CostModel,
    Placement,
    PlacementError,
    Server,
    cost_aware,
    failover_loads,
    predicted_seconds,
    round_robin,
    server_loads,
)
from eaas.runtime.placement.cost import compute_peaks, failover_limits

SERVERS, LAYERS, EXPERTS = 8, 2, 16


def paired() -> tuple[Placement, np.ndarray]:
    """Servers 2i and 2i+1 host the same experts (each failure doubles its partner's load), with
    spare slots; the load has one expert per layer three times as hot as the others."""
    servers = [Server(i, 2 * LAYERS * EXPERTS // SERVERS + 2) for i in range(SERVERS)]
    matrix = np.zeros((SERVERS, LAYERS, EXPERTS), dtype=bool)
    for expert in range(EXPERTS):
        first = (expert % (SERVERS // 2)) * 2
        matrix[first : first + 2, :, expert] = True
    load = np.random.default_rng(0).uniform(50, 150, (LAYERS, EXPERTS))
    load[:, 0] *= 3
    return Placement.from_matrix(range(LAYERS), EXPERTS, servers, matrix, 2), load


def test_rebalancing_bounds_the_busiest_survivor_of_any_failure() -> None:
    current, load = paired()
    mean = load.sum(axis=1) / SERVERS
    cheap = CostModel(seconds_per_expert_load=1e-5)
    healthy_only = cost_aware(
        current, load, CostModel(seconds_per_expert_load=1e-5, failover_factor=0.0), horizon_steps=1000
    )
    planned = cost_aware(current, load, cheap, horizon_steps=1000)
    # Without the term the search balances the healthy state and keeps the pairs: a failure
    # doubles the partner's load.
    assert (failover_loads(healthy_only, load).max(axis=0) / mean > 1.9).all()
    # With it, the worst failure leaves every layer's busiest survivor near 1.3x the mean (the
    # bound; each token over it counts as a token of the healthy peak) ...
    after_failure = failover_loads(planned, load).max(axis=0) / mean
    assert (after_failure < 1.4).all(), after_failure
    # ... for a few percent of healthy balance, and the hot experts got replicas for it.
    assert (server_loads(planned, load).max(axis=1) / mean < 1.06).all()
    assert (planned.replica_counts()[:, 0] >= 4).all()
    assert predicted_seconds(current, planned, load, cheap, 1000) < predicted_seconds(
        current, healthy_only, load, cheap, 1000
    )


def test_the_term_counts_only_tokens_over_the_bound() -> None:
    current, load = paired()
    mean = load.sum(axis=1) / SERVERS
    peaks = server_loads(current, load).max(axis=1)
    worst = failover_loads(current, load).max(axis=0)
    counted = compute_peaks(current, load, CostModel(failover_factor=1.3))
    np.testing.assert_allclose(counted, peaks + np.maximum(0.0, worst - 1.3 * mean))
    loose = compute_peaks(current, load, CostModel(failover_factor=10.0))
    np.testing.assert_allclose(loose, peaks)


def test_the_bound_is_what_a_layer_can_reach() -> None:
    counts = np.full((1, 256), 2)
    # 256 experts x 2 on 64 servers: 8 other replicas per server, 1 + 1/8 < 1.3.
    assert failover_limits(1.3, counts, 64, 2) == pytest.approx([1.3])
    # On 4 servers each server's 128 other replicas lie on 3 survivors, 43 on the busiest.
    assert failover_limits(1.3, counts, 4, 2) == pytest.approx([1 + 43 / 128])
    # 8 experts on 4 servers: 4 other replicas on 3 survivors, 2 on one: 1.5.
    assert failover_limits(1.3, np.full((1, 8), 2), 4, 2) == pytest.approx([1.5])
    assert failover_limits(0.0, counts, 64, 2) is None
    assert failover_limits(1.3, counts, 1, 2) is None


def test_no_term_without_a_second_replica() -> None:
    current = round_robin(2, 8, 4, 1, capacity=6)
    load = np.random.default_rng(1).uniform(0, 100, (2, 8))
    with_term = predicted_seconds(current, current, load, CostModel(), 100)
    assert with_term == predicted_seconds(current, current, load, CostModel(failover_factor=0.0), 100)


@pytest.mark.parametrize("factor", [0.5, -1.0, float("nan")])
def test_a_bad_factor_is_refused(factor: float) -> None:
    with pytest.raises(PlacementError, match="failover_factor"):
        CostModel(failover_factor=factor)
