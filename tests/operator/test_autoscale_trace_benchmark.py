"""The pure part of benchmarks/autoscale_trace.py: the compressed day, its requests, the GPU-seconds
and SLO-window accounting, and the simulated device's timing (no servers, no processes)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import ModuleType

import numpy as np
import pytest

from eaas.operator.planning import PoolShape, add_server, initial
from eaas.runtime.placement.placement import Placement, Server


@pytest.fixture(scope="module")
def trace(import_benchmark: Callable[[str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with import_benchmark("autoscale_trace") as module:
        yield module


def test_compressed_day_has_one_rate_per_second_and_the_peak_asked_for(trace: ModuleType) -> None:
    rates = trace.rate_trace(6.0, 240, seed=0)
    assert rates.shape == (240,)
    assert rates.max() == pytest.approx(6.0)
    assert 3.0 < rates.max() / rates.min() < 4.5  # the diurnal peak / trough
    assert 120 <= int(rates.argmax()) <= 160  # the afternoon peak (14:00 is second 140)
    assert np.array_equal(rates, trace.rate_trace(6.0, 240, seed=0))
    assert not np.array_equal(rates, trace.rate_trace(6.0, 240, seed=1))


def test_requests_follow_the_rates_and_repeat_with_the_seed(trace: ModuleType) -> None:
    rates = np.array([0.0, 50.0, 5.0])
    requests = trace.trace_requests(rates, seed=3, vocab=100)
    assert requests == trace.trace_requests(rates, seed=3, vocab=100)
    arrivals = [arrival for arrival, _, _ in requests]
    assert arrivals == sorted(arrivals) and all(1.0 <= a < 3.0 for a in arrivals)
    in_second = sum(1 for a in arrivals if a < 2.0)
    assert 30 <= in_second <= 70 and len(requests) - in_second <= 15
    for _, prompt, max_tokens in requests:
        assert 8 <= len(prompt) <= 48 and all(0 <= t < 100 for t in prompt) and 8 <= max_tokens <= 64


def test_gpu_seconds_count_each_server_from_start_to_stop_within_the_replay(trace: ModuleType) -> None:
    lifetimes = [(0.0, None), (0.0, None), (5.0, 8.0), (-3.0, 2.0), (12.0, 20.0)]
    # Within [1, 11]: two servers throughout (20), one from 5 to 8 (3), one until 2 (1), one never.
    assert trace.gpu_seconds(lifetimes, 1.0, 11.0) == pytest.approx(24.0)
    assert trace.gpu_seconds([], 0.0, 10.0) == 0.0
    assert trace.saved(70.0, 100.0) == pytest.approx(0.30)


def result(arrival: float, first: float, end: float, count: int) -> dict[str, float]:
    return {"arrival": arrival, "start": arrival, "first": first, "end": end, "count": count}


def test_slo_windows_flag_a_p99_above_the_target(trace: ModuleType) -> None:
    origin = 100.0
    results = [
        result(100.5, 101.0, 101.9, 10),  # window 0: 0.1 s per token
        result(103.0, 103.1, 103.55, 10),  # window 0: 0.05
        result(111.0, 111.1, 113.8, 10),  # window 1: 0.3 (over)
        result(112.0, 112.1, 112.2, 1),  # window 1: one token, no TPOT
        {"arrival": 125.0, "error": "boom"},  # window 2: failed
    ]
    windows = trace.slo_windows(results, origin, window_s=10.0, duration_s=30.0, slo_s=0.2)
    assert [w["requests"] for w in windows] == [2, 2, 1]
    assert [w["violating"] for w in windows] == [False, True, False]
    assert windows[0]["p99_tpot_s"] == pytest.approx(0.1) and windows[2]["p99_tpot_s"] is None
    assert trace.summarize(windows) == {
        "requests": 5,
        "violating_windows": 1,
        "requests_in_violating_windows": 2,
        "requests_over_slo": 1,
        "failed": 1,
    }
    assert trace.tpot(results[1]) == pytest.approx(0.05) and trace.tpot(results[3]) is None


def test_layer_balance_sees_a_layer_crowded_onto_few_servers(trace: ModuleType) -> None:
    shape = PoolShape((0, 1, 2, 3), 8, 2)
    two = initial(shape, {0: None, 1: None}, {})  # both servers host every expert
    assert trace.layer_balance(two, top_k=2, tokens=16) > 0.8
    spread = initial(shape, dict.fromkeys(range(4)), {})  # every layer over all four servers
    every = [(layer, expert) for layer in shape.layers for expert in range(8)]
    crowded = Placement(  # layers 0-1 on servers 0 and 1, layers 2-3 on servers 2 and 3
        shape.layers,
        8,
        [Server(n, 32) for n in range(4)],
        {n: [pair for pair in every if (pair[0] < 2) == (n < 2)] for n in range(4)},
        replication=2,
    )
    assert trace.layer_balance(crowded, 2, 16) < trace.layer_balance(spread, 2, 16) - 0.1
    # The operator's load-blind add_server spreads a new server over every layer (it once handed
    # it whole layers: 0.47 here, as crowded as `crowded`; now 0.72, against 0.75 for `spread`).
    grown = add_server(add_server(two, shape, 2, None, None), shape, 3, None, None)
    assert trace.layer_balance(grown, 2, 16) > trace.layer_balance(crowded, 2, 16) + 0.15


def test_oracle_saving_holds_whole_servers_in_proportion_to_the_rate(trace: ModuleType) -> None:
    rates = np.array([1.0, 2.0, 4.0, 4.0])  # needs 1, 2, 4, 4 of 4 servers; the floor makes it 2, 2, 4, 4
    assert trace.oracle_saving(rates, min_servers=2, fixed_servers=4) == pytest.approx(1 - 12 / 16)
    assert trace.oracle_saving(rates, min_servers=1, fixed_servers=4) == pytest.approx(1 - 11 / 16)
    assert trace.oracle_saving(np.full(5, 3.0), 2, 4) == 0.0


def test_controller_ceiling_runs_the_autoscaler_on_an_ideal_metric(trace: ModuleType) -> None:
    # Always at the peak: the pool is raised to the fixed size at the first reading, nothing saved.
    assert trace.controller_ceiling(np.full(60, 1.5), 2, 6, 6) == 0.0
    # Half a day at the peak, half at a quarter of it: what is saved is the second half, less the
    # metric's 10 s window and the scale-down window; never more than the oracle's third.
    step = np.r_[np.full(120, 1.5), np.full(120, 0.375)]
    oracle = trace.oracle_saving(step, 2, 6)
    assert oracle == pytest.approx((1 - 2 / 6) / 2)
    at_once = trace.controller_ceiling(step, 2, 6, 6, scale_down_window_s=0)
    windowed = trace.controller_ceiling(step, 2, 6, 6, scale_down_window_s=20)
    assert 0.25 < at_once <= oracle and 0.2 < windowed < at_once
    # Allowed 8 servers, the target's headroom takes them at the peak: 2 more for half the day.
    beyond = trace.controller_ceiling(step, 2, 8, 6, scale_down_window_s=0)
    assert beyond == pytest.approx(at_once - 2 * 120 / (6 * 240), abs=0.01)
    # The compressed day against 6 servers: below the oracle (headroom, whole servers, windows).
    day = trace.rate_trace(1.5, 180, seed=0)
    assert 0.2 < trace.controller_ceiling(day, 2, 6, 6) < trace.oracle_saving(day, 2, 6) - 0.05


def test_finer_experts_keep_a_tokens_expert_flops(trace: ModuleType) -> None:
    base = trace.serving_config()  # the benchmark's own import of _load's model
    fine = trace.model_config(base, experts=64, top_k=8)
    assert (fine.num_experts, fine.top_k) == (64, 8)
    assert fine.top_k * fine.expert_intermediate_size == base.top_k * base.expert_intermediate_size
    assert fine.hidden_size == base.hidden_size and fine.num_layers == base.num_layers
    assert trace.model_config(base, None, None) == base


def test_the_token_rate_target_is_the_headroom_of_the_fixed_pools_rate(trace: ModuleType) -> None:
    """``--metric token-rate --hand-set-target``: the spec a user would write after the load test,
    as the operator reads it (``metric: tokenRate``), at ``--headroom`` x what a server of the fixed
    pool carried."""
    args = argparse.Namespace(
        min_servers=2,
        max_servers=6,
        scale_down_window_s=10,
        metric="token-rate",
        headroom=0.9,
        hand_set_target=True,
    )
    spec, aim, headroom = trace.autoscaling(args, {"tokens_per_server_s": 410.5}, 0.2)
    assert spec.metric == "tokenRate" and spec.target_tokens_per_second == 369
    assert (spec.min_replicas, spec.max_replicas, spec.scale_down_stabilization_seconds) == (2, 6, 10)
    assert "369 tokens/s per server" in aim and abs(headroom - 369 / 410.5) < 1e-9


def test_the_learned_token_rate_starts_from_the_sizing_runs_and_has_its_own_ceiling(
    trace: ModuleType,
) -> None:
    """The default arm learns its target at the run's SLO: the operator has seen the sizing runs
    (tokens/s per server against p99 TPOT), so the arm starts with a capacity where they cross the
    SLO; its ceiling runs the token rate's policy on the ideal metric."""
    args = argparse.Namespace(
        metric="token-rate",
        hand_set_target=False,
        min_servers=2,
        max_servers=4,
        scale_down_window_s=20,
        headroom=0.85,
    )
    spec, aim, headroom = trace.autoscaling(args, {"tokens_per_server_s": 500.0}, 0.2)
    assert spec.metric == "tokenRate" and spec.target_tokens_per_second is None
    assert spec.slo_time_per_output_token_millis == 200 and "learned" in aim and headroom == 0.9
    sizing = [
        {"servers": 2, "tokens_per_server_s": 300.0, "tpot_p99_s": 0.08, "failed": 0},  # the trough
        {"servers": 2, "tokens_per_server_s": 900.0, "tpot_p99_s": 0.40, "failed": 0},
        {"servers": 3, "tokens_per_server_s": 600.0, "tpot_p99_s": 0.16, "failed": 0},
        {"servers": 4, "tokens_per_server_s": 450.0, "tpot_p99_s": 0.50, "failed": 2},  # failed: left out
    ]
    capacity, how = trace.learned_from_sizing(sizing, spec).estimate()
    assert capacity == pytest.approx(600 + 300 * (0.2 - 0.16) / (0.40 - 0.16)) and "crosses" in how
    args.hand_set_target = True
    spec, aim, _ = trace.autoscaling(args, {"tokens_per_server_s": 500.0}, 0.2)
    assert spec.target_tokens_per_second == 425  # HEADROOM (0.85) x the fixed pool's
    step = np.r_[np.full(120, 1.5), np.full(120, 0.375)]
    token = trace.controller_ceiling(step, 2, 6, 6, 0.9, scale_down_window_s=0, metric="tokenRate")
    assert 0.25 < token <= trace.oracle_saving(step, 2, 6)


def test_the_sizing_replays_the_traces_peak_after_a_lead_in(trace: ModuleType) -> None:
    """The fixed pool is sized on the trace's own requests around its peak: the SLO windows at
    >= 0.8 x the peak rate, replayed after the window before them."""
    day = trace.rate_trace(1.5, 180, seed=0)
    start, judged_from, end = trace.peak_segment(day, 15.0)
    assert (start, judged_from) == (judged_from - 15.0, judged_from)
    assert judged_from <= int(day.argmax()) < end and (end - judged_from) % 15.0 == 0
    for first in np.arange(judged_from, end, 15.0):
        assert day[int(first) : int(first) + 15].mean() >= 0.8 * day.max()
    for outside in (judged_from - 15.0, end):  # the windows beside the judged ones are lighter
        assert day[int(outside) : int(outside) + 15].mean() < 0.8 * day.max()
    # A flat day is judged whole, after no lead-in; a single busy second still gets its window.
    assert trace.peak_segment(np.full(60, 1.0), 15.0) == (0.0, 0.0, 60.0)
    spike = np.r_[np.full(40, 0.1), [5.0], np.full(19, 0.1)]
    assert trace.peak_segment(spike, 15.0) == (15.0, 30.0, 45.0)
    requests = trace.trace_requests(day, seed=0, vocab=100)
    replayed = trace.segment(requests, start, end)
    assert replayed == [(a - start, p, m) for a, p, m in requests if start <= a < end]
    assert replayed and all(0.0 <= a < end - start for a, _, _ in replayed)


def test_the_fixed_pool_is_the_smallest_that_met_the_slo_through_the_peak(trace: ModuleType) -> None:
    def row(servers: int, p50: float, p99: float, violating: int, failed: int = 0) -> dict[str, float]:
        return {
            "servers": servers,
            "tpot_p50_s": p50,
            "tpot_p99_s": p99,
            "violating_windows": violating,
            "failed": failed,
        }

    sizing = [row(2, 0.8, 1.2, 2), row(3, 0.2, 0.21, 1), row(4, 0.1, 0.15, 0, failed=1), row(5, 0.1, 0.14, 0)]
    assert trace.fixed_size(sizing)[0] == 5  # 4 met the time but failed a request
    # None met: 3 is within 10% of the best in both p50 and p99, so more servers bought no latency.
    flat = [row(2, 0.8, 1.2, 2), row(3, 0.150, 0.30, 1), row(4, 0.145, 0.28, 1), row(5, 0.140, 0.275, 2)]
    servers, rule = trace.fixed_size(flat)
    assert servers == 3 and rule.startswith("none met")
    # The p99 of 5 is within 10% of 6's, but its p50 is not: the sixth server bought latency.
    tail = [row(4, 0.239, 0.288, 2), row(5, 0.173, 0.224, 1), row(6, 0.147, 0.215, 1)]
    assert trace.fixed_size(tail)[0] == 6
