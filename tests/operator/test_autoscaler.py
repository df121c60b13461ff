"""The built-in autoscaler's tokenRate policy with a learned target, step by step as the operator
calls it (every 10 s), against a pool whose p99 time per output token is a known curve of each
server's load: what it learns, and the invariants it keeps at every step."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from eaas.operator.api.moeservice import AutoscalingSpec
from eaas.operator.autoscaler import EXPLORE, HEADROOM, SETTLE_S, Autoscaler, Capacity, isotonic

CAPACITY = 1000.0  # routed tokens/s one server carries at the SLO (the truth the policy must learn)
SLO_MS = 100
STEP_S = 10
READY_S = 120.0  # an added server's time to serve
SPEC = AutoscalingSpec(
    mode="builtin",
    min_replicas=4,
    max_replicas=4096,
    slo_time_per_output_token_millis=SLO_MS,
    scale_up_stabilization_seconds=120,
)


def tpot_micros(load: float) -> int:
    """p99 time per output token of a server at `load` x its capacity: 30 ms idle, convex, the SLO
    at 1.0 (a queue that fills faster near saturation)."""
    return round(1000 * (30 + 70 * load**2))


def run(
    demand: np.ndarray,
    start: int,
    spec: AutoscalingSpec = SPEC,
    tpot=tpot_micros,
    noise: np.ndarray | None = None,
) -> tuple[Autoscaler, np.ndarray, np.ndarray]:
    """The autoscaler over `demand` [S] (in capacities at the SLO), `start` servers serving at
    first. Returns it, and per step the replicas held (ready or starting) and the ready ones [S]."""
    scaler = Autoscaler()
    ready, starting = start, []  # starting: times at which added servers serve
    held, serving = [], []
    for step, load in enumerate(demand):
        now = step * STEP_S
        ready += sum(1 for at in starting if at <= now)
        starting = [at for at in starting if at > now]
        current = ready + len(starting)
        per_server = float(load) / ready
        reading = tpot(per_server) * (1.0 + (noise[step] if noise is not None else 0.0))
        wanted = scaler.recommend(now, current, round(per_server * CAPACITY), spec, ready, round(reading))
        while wanted < current and starting:
            starting.pop()
            current -= 1
        starting += [now + READY_S] * max(0, wanted - current)
        ready -= max(0, current - wanted - 0)
        held.append(ready + len(starting))
        serving.append(ready)
    return scaler, np.array(held), np.array(serving)


def day(peak: float, steps: int = 8640) -> np.ndarray:
    """A smooth diurnal day [steps], peak / trough 3."""
    phase = 2 * np.pi * np.arange(steps) / steps
    return np.asarray(peak * (2 - np.cos(phase)) / 3)


def test_isotonic_fit_pools_a_dip() -> None:
    assert isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([5.0, 1.0], [3, 1]).tolist() == [4.0, 4.0]


def test_capacity_from_readings_on_both_sides_of_the_slo() -> None:
    capacity = Capacity(SLO_MS * 1000)
    assert capacity.estimate() == (None, "no readings yet")
    for load in (0.3, 0.5, 0.7, 0.9, 1.1, 1.3):
        for _ in range(3):
            capacity.observe(load * CAPACITY, tpot_micros(load))
    estimate, how = capacity.estimate()
    assert estimate == pytest.approx(CAPACITY, rel=0.05) and "crosses the SLO" in how


def test_capacity_below_the_slo_is_extrapolated_but_never_far() -> None:
    """Readings only well below the SLO: the line through them reaches it far out; the estimate
    stops at EXPLORE x the highest rate seen, so the pool learns by running a little higher."""
    capacity = Capacity(SLO_MS * 1000)
    for load in (0.2, 0.3, 0.4):
        capacity.observe(load * CAPACITY, tpot_micros(load))
    estimate, how = capacity.estimate()
    assert estimate == pytest.approx(EXPLORE * 0.4 * CAPACITY, rel=0.03) and "highest rate" in how


def test_a_slo_the_expert_servers_cannot_meet_stops_the_pool_growing() -> None:
    """Missed at every rate over a 1.5x span with no fall in the time per token: fewer tokens per
    server did not help, so scaling the expert pool up would not either; the estimate is the
    busiest rate seen (the pool neither grows on nor stays large when the load falls) and the
    reason says why. Where the time did fall, the line through the readings finds the SLO."""
    capacity = Capacity(SLO_MS * 1000)
    capacity.observe(800.0, 150_000)
    estimate, _ = capacity.estimate()
    assert estimate == pytest.approx(800 * 100 / 150)  # one band: proportional, corrected by the next
    capacity.observe(350.0, 160_000)
    estimate, how = capacity.estimate()
    assert estimate == pytest.approx(800.0) and "not the expert servers' load" in how
    # In a run: the time per token never falls with more servers. The pool grows while the
    # evidence is one-sided, then stops, and goes back to the floor without load.
    demand = np.r_[np.full(600, 20.0), np.full(300, 0.0)]
    scaler, held, _ = run(demand, start=20, tpot=lambda load: 150_000)
    assert held[:600].max() <= 2 * 20 / HEADROOM + 1 and held[-1] == SPEC.min_replicas
    assert "not the expert servers' load" in scaler.reason
    falling = Capacity(SLO_MS * 1000)  # 50 ms + 100 ms per 1000 tokens/s: the SLO at 500
    falling.observe(1500.0, 200_000)
    falling.observe(675.0, 117_500)
    estimate, how = falling.estimate()
    assert estimate == pytest.approx(500.0) and "extrapolated down" in how


def test_a_knee_just_below_the_slo_is_not_extrapolated_past() -> None:
    """A time per token that is flat and then turns steeply up shortly before the SLO (what Part A
    of benchmarks/elasticity.py measures on a CPU server): a pool that runs at its target reads
    mostly the flat part. After two days of 3%-noisy readings the capacity it learned is within 3%
    above the truth (a line through the flat part as well would put it 6-11% above, and a step
    that rises faster than the headroom then violates the SLO)."""

    def knee(load: float) -> int:
        at = 0.985 * load  # the curve's SLO crossing scaled to load 1.0
        return round(1000 * (30 + 40 * at if at <= 0.9 else 66 + 400 * (at - 0.9)))

    for seed in range(3):
        demand = np.r_[day(60.0), day(60.0)]
        noise = np.random.default_rng(seed).normal(0.0, 0.03, demand.size)
        scaler, _, ready = run(demand, start=64, tpot=knee, noise=noise)
        assert scaler.capacity is not None
        estimate, _ = scaler.capacity.estimate()
        assert estimate is not None and CAPACITY <= estimate <= 1.03 * CAPACITY, (seed, estimate)
        assert int((demand[8640:] > ready[8640:]).sum()) == 0


def test_readings_of_a_changing_load_are_not_learned_from() -> None:
    """The clients' p99 covers 30 s: while the token rate moves by more than 10% within that
    window, the pair (newest rate, p99) describes no one load and is not recorded. Once the rate
    has held for the window, it is."""
    scaler = Autoscaler()
    now = 0.0
    for _ in range(5):  # 40 s at 500 tokens/s per server, the pool's size held: readings
        scaler.recommend(now, 10, 500, SPEC, 10, 40_000)
        now += 10
    assert scaler.capacity is not None
    recorded = sum(len(r) for r in scaler.capacity.readings.values())
    assert recorded > 0
    for value in (560, 620, 680, 740):  # a rise of 12% per 10 s
        scaler.recommend(now, 10, value, SPEC, 10, 45_000)
        now += 10
    assert sum(len(r) for r in scaler.capacity.readings.values()) == recorded
    for _ in range(4):  # the rate holds at 740: recorded again once the window saw only it
        scaler.recommend(now, 10, 740, SPEC, 10, 60_000)
        now += 10
    assert sum(len(r) for r in scaler.capacity.readings.values()) > recorded


def test_a_flat_load_read_through_noise_is_learned_from() -> None:
    """What drill A6 reads on two cores: a flat load whose per-second token rate swings +-8%
    (each reading a 10 s average of a noisy rate). Extremes within 10% of each other may never
    come; the window's halves agree, so readings count (the rule used to wait for the extremes,
    and A6 run alone once learned nothing in 180 s)."""
    scaler = Autoscaler()
    rates = np.random.default_rng(0).uniform(0.92, 1.08, 120) * 180
    for second, rate in enumerate(rates):
        scaler.recommend(float(second), 2, round(rate), SPEC, 2, 160_000)
    assert scaler.capacity is not None and scaler.capacity.readings
    assert not any(
        max(window) <= 1.1 * min(window) for window in np.lib.stride_tricks.sliding_window_view(rates, 31)
    ), "the noise was meant to defeat a rule on the extremes"


def test_a_diurnal_day_keeps_every_invariant_at_every_step() -> None:
    """From an oversized start (a new pool sized by guess) the policy learns the capacity and then,
    at every step once no server is starting: no more servers than ceil(1.15 x the highest demand
    of the scale-down window); no SLO-violating step after the first hour; fewer GPU-hours than a
    fixed pool sized for the peak."""
    demand = day(60.0)
    scaler, held, ready = run(demand, start=64)
    estimate, _ = scaler.capacity.estimate() if scaler.capacity else (None, "")
    assert estimate == pytest.approx(CAPACITY, rel=0.1)
    window = SPEC.scale_down_stabilization_seconds // STEP_S + 1
    learned = 360  # one hour of 10 s steps
    for step in range(learned, demand.size):
        if held[step] == ready[step]:
            recent = demand[max(0, step - window) : step + 1].max()
            assert held[step] <= max(SPEC.min_replicas, math.ceil(1.15 * recent)), step
    assert int((demand[learned:] > ready[learned:]).sum()) == 0
    assert held.sum() < math.ceil(demand.max()) * demand.size
    assert held.max() <= math.ceil(1.15 * demand.max())


def test_a_flat_load_settles_and_holds() -> None:
    """Flat demand with 2% noise in the readings: after learning, the size never changes."""
    demand = np.full(2000, 20.0)
    noise = np.random.default_rng(0).uniform(-0.02, 0.02, demand.size)
    _, held, _ = run(demand, start=40, noise=noise)
    settled = held[720:]  # after two hours
    assert len(set(settled.tolist())) == 1, sorted(set(settled.tolist()))
    assert 20 / 1.0 <= settled[0] <= math.ceil(1.15 * 20)


def test_a_step_up_in_demand_is_followed_within_the_servers_start() -> None:
    demand = np.array([20.0] * 720 + [30.0] * 200)
    _, held, ready = run(demand, start=24)
    assert held[-1] == ready[-1] and math.ceil(30 / HEADROOM) <= ready[-1] <= math.ceil(1.15 * 30)
    violating = int((demand[720:] > ready[720:]).sum())
    assert violating <= (READY_S + SPEC.scale_up_stabilization_seconds) / STEP_S + 1


def test_a_hand_set_target_is_used_as_given() -> None:
    spec = SPEC.model_copy(update={"target_tokens_per_second": 500})
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 4, 1000, spec, 4, None) == 8
    assert scaler.capacity is None and scaler.per_server == 500


def test_no_estimate_holds_the_size() -> None:
    scaler = Autoscaler()
    assert scaler.recommend(0.0, 6, 900, SPEC, 6, None) == 6  # nothing learned yet
    assert scaler.per_server is None and scaler.reason == "no readings yet"


def test_no_scale_down_while_the_slo_is_missed_on_a_closed_loop_load() -> None:
    """A closed-loop load (a fixed number of streams) on a machine whose total throughput falls
    as server processes are added (drill A6 on two cores): 2,800 routed tokens/s on 3 servers, 2,500
    on 4, the clients' p99 time per output token 120 ms (over the 100 ms SLO) on both. By the rate
    alone 3 servers carry more than the target (up to 4) and 4 are one too many (down to 3), and
    neither size held for the p99's window, so nothing new was learned: the pool went 3 <-> 4 for
    ever. Removing a server cannot shorten the time per token, so while the SLO is missed the pool
    holds; holding, it learns that 4 servers did not shorten the time per token either (not the
    servers' load), settles once and stays. Without load (no p99 on the Leases) it goes down."""
    spec = SPEC.model_copy(
        update={
            "min_replicas": 2,
            "max_replicas": 4,
            "scale_up_stabilization_seconds": 0,
            "scale_down_stabilization_seconds": 20,
        }
    )
    scaler = Autoscaler()
    scaler.capacity = Capacity(SLO_MS * 1000)
    for rate, millis in ((600, 60), (800, 80), (1000, 100), (1200, 120)):  # the SLO at 1000 tokens/s
        for _ in range(3):
            scaler.capacity.observe(float(rate), millis * 1000)
    total = {3: 2800.0, 4: 2500.0}
    current, sizes, now = 3, [], 0.0
    for _ in range(60):  # 10 min of a flat load
        current = scaler.recommend(now, current, round(total[current] / current), spec, current, 120_000)
        sizes.append(current)
        now += STEP_S
    changes = [(i, a, b) for i, (a, b) in enumerate(itertools.pairwise([3, *sizes])) if a != b]
    assert len(changes) <= 2 and changes[0] == (0, 3, 4), changes  # up, then at most one settling step
    assert len(changes) == 1 or changes[1][0] * STEP_S >= SETTLE_S, changes  # not before it had learned
    assert set(sizes[-40:]) == {sizes[-1]}, sizes
    for _ in range(12):  # the load ended: the clients' window emptied, the servers idle
        current = scaler.recommend(now, current, 0, spec, current, None)
        now += STEP_S
    assert current == spec.min_replicas


def test_a_lowered_max_replicas_binds_while_the_slo_is_missed() -> None:
    """The hold while the SLO is missed never keeps more servers than maxReplicas allows."""
    spec = SPEC.model_copy(
        update={"min_replicas": 2, "max_replicas": 3, "scale_down_stabilization_seconds": 20}
    )
    scaler = Autoscaler()
    scaler.capacity = Capacity(SLO_MS * 1000)
    for rate, millis in ((600, 60), (800, 80), (1000, 100), (1200, 120)):
        for _ in range(3):
            scaler.capacity.observe(float(rate), millis * 1000)
    current, now = 4, 0.0
    for _ in range(4):  # 4 servers at 625 tokens/s each, the p99 over the SLO
        current = scaler.recommend(now, current, 625, spec, current, 120_000)
        now += STEP_S
    assert current == 3
