"""The latency model: hand-checked values, and its validation."""

from __future__ import annotations

import numpy as np
import pytest

from eaas.runtime.placement import (
    CostModel,
    Placement,
    PlacementError,
    Server,
    failover_loads,
    forecast_loads,
    imbalance,
    movement_seconds,
    predicted_seconds,
    prediction_error,
    server_loads,
    step_seconds,
)
from eaas.runtime.placement.cost import check_load

COST = CostModel(seconds_per_token=1e-6, seconds_per_layer=1e-4, seconds_per_expert_load=1e-3)


def pair_placement(hosted: dict[int, list[tuple[int, int]]], ordinals: tuple[int, ...] = (0, 1)) -> Placement:
    return Placement([0, 1], 2, [Server(o, 4) for o in ordinals], hosted)


def test_server_loads_split_an_expert_evenly_over_its_replicas() -> None:
    placement = pair_placement({0: [(0, 0), (0, 1), (1, 0)], 1: [(0, 0), (1, 1)]})
    load = np.array([[100.0, 10.0], [40.0, 60.0]])
    assert server_loads(placement, load).tolist() == [[60.0, 50.0], [40.0, 60.0]]
    batch = server_loads(placement, np.stack([load, 2 * load]))
    assert batch.shape == (2, 2, 2) and batch[1].tolist() == [[120.0, 100.0], [80.0, 120.0]]
    # Per layer max/mean: 60/55 and 60/50.
    assert imbalance(placement, load) == pytest.approx((60 / 55 + 60 / 50) / 2)
    # Sum over layers of (fixed + per-token x busiest server).
    assert step_seconds(placement, load, COST) == pytest.approx(2 * 1e-4 + 1e-6 * (60 + 60))


def test_failover_loads_move_a_lost_servers_share_to_the_other_replicas() -> None:
    # Layer 0: expert 0 on servers 0, 1, 2 (30 each of 90), expert 1 on servers 0 and 1 (5 each).
    # Layer 1: expert 0 on server 0 alone, expert 1 on servers 1 and 2 (10 each).
    servers = [Server(o, 4) for o in range(3)]
    placement = Placement(
        [0, 1], 2, servers, {0: [(0, 0), (0, 1), (1, 0)], 1: [(0, 0), (0, 1), (1, 1)], 2: [(0, 0), (1, 1)]}
    )
    load = np.array([[90.0, 10.0], [7.0, 20.0]])
    after = failover_loads(placement, load)
    assert after.shape == (3, 2)
    # Server 0 fails: expert 0 -> 45 on 1 and 2, expert 1 -> 10 on 1; layer 1 loses its only replica.
    assert after[0, 0] == pytest.approx(55.0) and after[0, 1] == float("inf")
    # Server 1 fails: server 0 serves 45 + 10, server 2 45; in layer 1 server 2 takes all 20.
    assert after[1].tolist() == pytest.approx([55.0, 20.0])
    # Server 2 fails: servers 0 and 1 serve 45 + 5; layer 1: server 1 takes 20 (server 0 keeps 7).
    assert after[2].tolist() == pytest.approx([50.0, 20.0])
    with pytest.raises(PlacementError, match="load has shape"):
        failover_loads(placement, np.zeros((3, 2)))


def test_movement_is_the_busiest_loader_and_ignores_new_servers() -> None:
    old = pair_placement({0: [(0, 0), (0, 1), (1, 0), (1, 1)], 1: [(0, 0)]})
    new = Placement(
        [0, 1], 2, [Server(0, 4), Server(1, 4), Server(2, 4)],
        {0: [(0, 0), (0, 1)], 1: [(0, 0), (1, 0), (1, 1)], 2: [(0, 1), (1, 0), (1, 1)]},
    )  # fmt: skip
    # Server 1 loads two experts, server 0 none; server 2 is new (loads before it serves).
    assert movement_seconds(old, new, COST) == pytest.approx(2e-3)
    load = np.ones((2, 2))
    expected = 10 * step_seconds(new, load, COST) + 2e-3 + 0.5
    assert predicted_seconds(
        old, new, load, CostModel(1e-6, 1e-4, 1e-3, planner_seconds=0.5), 10
    ) == pytest.approx(expected)
    # Keeping the current placement costs no movement and no planner time.
    assert predicted_seconds(old, old, load, CostModel(planner_seconds=0.5), 10) == pytest.approx(
        10 * step_seconds(old, load, CostModel())
    )


def test_forecast_tokens_weight_heavy_shares_by_the_load_error() -> None:
    # Layer 0: expert 0 (120 tokens) alone on server 0, experts 1..3 (40 each) on server 1: both
    # serve 120 tokens, but server 0's one heavy share counts more. Layer 1: expert 0 on both.
    placement = Placement(
        [0, 1], 4, [Server(0, 8), Server(1, 8)],
        {0: [(0, 0), (1, 0), (1, 1)], 1: [(0, 1), (0, 2), (0, 3), (1, 0), (1, 2), (1, 3)]},
    )  # fmt: skip
    load = np.array([[120.0, 40.0, 40.0, 40.0], [80.0, 20.0, 30.0, 30.0]])
    assert forecast_loads(placement, load, 0.0).tolist() == server_loads(placement, load).tolist()
    rho = 0.3
    forecast = forecast_loads(placement, load, rho)
    # A share x of a layer with m tokens per server counts x * (1 + rho * x / m).
    assert forecast[0].tolist() == pytest.approx([120 * (1 + rho), 3 * 40 * (1 + rho * 40 / 120)])
    # Layer 1: 80 tokens per server; server 0 serves 40 (half of expert 0) + 20, server 1 40 + 30 + 30.
    assert forecast[1].tolist() == pytest.approx(
        [
            40 * (1 + rho * 40 / 80) + 20 * (1 + rho * 20 / 80),
            40 * (1 + rho * 40 / 80) + 2 * 30 * (1 + rho * 30 / 80),
        ]
    )
    cost = CostModel(
        seconds_per_token=1e-6, seconds_per_layer=0.0, seconds_per_expert_load=0.0, load_error=rho
    )
    assert predicted_seconds(placement, placement, load, cost, 10) == pytest.approx(
        10 * 1e-6 * float(forecast.max(axis=1).sum())
    )


def test_prediction_error_recovers_a_known_drift_under_sampling_noise() -> None:
    rng = np.random.default_rng(7)
    predicted = rng.lognormal(5.0, 0.7, (20, 256))  # ~150 tokens per expert per step
    drifted = predicted * (1 + 0.2 * rng.standard_normal(predicted.shape))
    exact = float(np.sqrt(((drifted - predicted) ** 2).sum() / (predicted**2).sum()))
    assert prediction_error(predicted, drifted, 100, 10**9) == pytest.approx(exact, rel=1e-3)
    # Means of Poisson counts: 100 steps for the forecast, 10 for the actual; the noise is removed.
    forecast = rng.poisson(predicted, (100, *predicted.shape)).mean(axis=0)
    actual = rng.poisson(np.maximum(drifted, 0), (10, *predicted.shape)).mean(axis=0)
    assert prediction_error(forecast, actual, 100, 10) == pytest.approx(exact, abs=0.01)
    assert prediction_error(forecast, forecast, 100, 100) == 0.0  # below the noise: clamped to 0
    assert prediction_error(np.zeros((2, 2)), np.ones((2, 2)), 1, 1) == 0.0
    with pytest.raises(PlacementError, match=r"both be \[L, E\] tokens per step"):
        prediction_error(np.ones((2, 2)), np.ones((2, 3)), 1, 1)
    with pytest.raises(PlacementError, match="actual_steps must be an int >= 1"):
        prediction_error(np.ones((2, 2)), np.ones((2, 2)), 1, 0)
    with pytest.raises(PlacementError, match="finite token counts >= 0"):
        prediction_error(np.ones((2, 2)), np.full((2, 2), np.nan), 1, 1)


def test_inputs_are_validated() -> None:
    with pytest.raises(PlacementError, match=r"load has shape \(3,\); expected \[L, E\] = \(2, 2\)"):
        check_load(np.ones(3), 2, 2)
    with pytest.raises(PlacementError, match="finite token counts >= 0"):
        check_load(np.array([[1.0, -1.0], [0.0, 0.0]]), 2, 2)
    with pytest.raises(PlacementError, match="finite token counts >= 0"):
        check_load(np.array([[1.0, np.nan], [0.0, 0.0]]), 2, 2)
    with pytest.raises(PlacementError, match="seconds_per_expert_load must be a finite number >= 0"):
        CostModel(seconds_per_expert_load=-1.0)
    with pytest.raises(PlacementError, match="load_error must be a finite number >= 0"):
        CostModel(load_error=-0.1)
    with pytest.raises(PlacementError, match="load_error must be a finite number >= 0"):
        CostModel(load_error=float("inf"))
    with pytest.raises(PlacementError, match="seconds_per_token must be > 0"):
        CostModel(seconds_per_token=0.0)
    placement = pair_placement({0: [(0, 0), (0, 1), (1, 0), (1, 1)]})
    with pytest.raises(PlacementError, match="horizon_steps must be an int >= 1"):
        predicted_seconds(placement, placement, np.ones((2, 2)), COST, 0)
