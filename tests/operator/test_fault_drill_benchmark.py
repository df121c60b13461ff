"""The pure part of benchmarks/fault_drill.py: the step-cost model, the simulated 64-server drill's
arithmetic on a small shape, the monolith's outage windows (no servers, no processes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import ModuleType

import numpy as np
import pytest

from eaas.runtime.placement import Placement, round_robin


@pytest.fixture(scope="module")
def drill(import_benchmark: Callable[[str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with import_benchmark("fault_drill") as module:
        yield module


def test_moe_tokens_moves_a_lost_servers_share_to_its_replicas(drill: ModuleType) -> None:
    # 1 layer, 4 experts, 4 servers, R = 2 in a ring: server s hosts experts s - 1 and s.
    ring = {s: [(0, (s - 1) % 4), (0, s)] for s in range(4)}
    placement = Placement([0], 4, round_robin([0], 4, 4, replication=2).servers, ring, replication=2)
    load = np.array([[8.0, 8.0, 8.0, 8.0]])
    assert drill.moe_tokens(placement, load) == pytest.approx(8.0)  # every server: two halves
    # Server 1 hosts experts 0 and 1: expert 0 goes whole to server 0 (12 tokens with its half of
    # expert 3), expert 1 whole to server 2 (12 with its half of expert 2).
    assert drill.moe_tokens(placement, load, (1,)) == pytest.approx(12.0)
    assert math.isinf(drill.moe_tokens(placement, load, (1, 2)))  # expert 1 has no replica left


def test_relative_throughput_and_windows(drill: ModuleType) -> None:
    assert drill.relative_throughput(0.4, 1.0) == pytest.approx(1.0)
    assert drill.relative_throughput(0.5, 1.5) == pytest.approx(1 / 1.25)
    assert drill.relative_throughput(0.0, 9.0) == pytest.approx(1.0)  # no expert time: no loss
    assert drill.relative_throughput(0.5, math.inf) == 0.0
    assert drill.window_average(0.5, 10.0, 1.0, 60.0) == pytest.approx((5 + 50) / 60)
    assert drill.window_average(0.5, 90.0, 1.0, 60.0) == pytest.approx(0.5)
    assert drill.monolith_window(15.0, 60.0) == pytest.approx(0.75)
    assert drill.monolith_window(348.0, 60.0) == 0.0
    # A 10 s window at 100 tok/s, down from 4 s to 7 s: 70 tok/s.
    assert drill.outage_rate(100.0, 0.0, 10.0, 4.0, 7.0) == pytest.approx(70.0)
    assert drill.outage_rate(100.0, 0.0, 10.0, 12.0, 15.0) == pytest.approx(100.0)


def test_window_counts_tokens_and_the_longest_gap(drill: ModuleType) -> None:
    stamps = [0.1, 0.2, 0.3, 1.5, 1.6]
    rate, gap = drill.window(stamps, 0.25, 1.75)
    assert rate == pytest.approx(3 * drill.BATCH / 1.5)
    assert gap == pytest.approx(1.2)  # 0.3 ... 1.5
    assert drill.timeline(stamps, 0.0, 1.0) == [3 * drill.BATCH / drill.BIN_S, 0.0]


def test_simulated_drill_on_a_small_shape(drill: ModuleType) -> None:
    load = drill.simulation_load(seed=0, layers=4, experts=32)
    assert load.shape == (4, 32) and np.allclose(load.sum(axis=1), 4096 * 8)
    start: Placement = drill.simulation_start(load, servers=16)
    assert start.num_servers == 16 and int(start.replica_counts().min()) >= 2
    rows = drill.drill(start, load, [3, 7], expert_fraction=0.4, degraded_s=10.0, interval_s=60.0)
    assert [row["lost_gpus"] for row in rows] == [1, 2]
    assert rows[0]["replication_after"] == 2  # 15 survivors have room for R = 2 (14 do not)
    for row in rows:
        assert not row["unavailable"]
        # The failover state is the slowest: survivors carry the lost share until the re-plan.
        assert 0 < row["failover_throughput"] <= row["window_throughput"] <= 1.0
        assert row["failover_throughput"] <= row["replanned_throughput"] <= 1.0 + 1e-9
        assert row["window_loss_per_gpu"] == pytest.approx((1 - row["window_throughput"]) / row["lost_gpus"])
    none = drill.drill(start, load, [3], expert_fraction=0.0, degraded_s=10.0, interval_s=60.0)
    assert none[0]["window_throughput"] == pytest.approx(1.0)  # no expert time: nothing to lose


def test_the_failure_aware_start_spreads_a_lost_servers_load(drill: ModuleType) -> None:
    """Part B's two arms on a small shape: the same load, the failure-aware packing's start loses
    less throughput to any one failure than the plain packing's, at a balance within 2%."""
    load = drill.simulation_load(seed=0, layers=4, experts=32)
    starts = [drill.simulation_start(load, servers=16, failure_aware=aware) for aware in (False, True)]
    healthy = [drill.moe_tokens(start, load) for start in starts]
    assert healthy[1] <= 1.02 * healthy[0]
    worst = [
        max(drill.moe_tokens(start, load, (o,)) for o in start.ordinals) / tokens
        for start, tokens in zip(starts, healthy, strict=True)
    ]
    assert worst[1] < worst[0]
