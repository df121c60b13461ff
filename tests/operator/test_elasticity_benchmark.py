"""The pure part of benchmarks/elasticity.py: the trace, the unit baselines, the autoscaled pools
and the savings arithmetic (no servers; the measured Part A runs only in the benchmark itself)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
from benchmark_runs import benchmark_module

from eaas.operator.api.moeservice import AutoscalingSpec


@pytest.fixture(scope="module")
def elasticity() -> Iterator[ModuleType]:
    """benchmarks/elasticity.py as a module (it imports its siblings ``_common`` and ``_load``)."""
    with benchmark_module("elasticity.py") as module:
        yield module


def test_trace_is_reproducible_and_shaped(elasticity: ModuleType) -> None:
    peaked = elasticity.diurnal_trace(60.0, seed=0)
    assert peaked.shape == (24 * 3600 // elasticity.STEP_S,)
    assert np.array_equal(peaked, elasticity.diurnal_trace(60.0, seed=0))
    assert not np.array_equal(peaked, elasticity.diurnal_trace(60.0, seed=1))
    assert peaked.max() == pytest.approx(60.0)
    hours = np.arange(peaked.size) * elasticity.STEP_S / 3600
    assert 12 <= hours[peaked.argmax()] <= 16  # the afternoon peak
    assert 3.0 < peaked.max() / peaked.min() < 4.5
    sinusoid = elasticity.diurnal_trace(60.0, seed=0, shape="sinusoid")
    assert sinusoid.mean() > peaked.mean()  # the sharper peak leaves less demand over the day


def test_fixed_units_are_whole_units_sized_for_the_peak(elasticity: ModuleType) -> None:
    demand = np.array([10.0, 30.0, 41.5, 20.0])
    for unit, gpus in ((8, 48), (16, 48), (32, 64), (1, 42)):
        day = elasticity.fixed(f"fixed-{unit}", demand, unit, floor=17)
        assert set(day.gpus.tolist()) == {gpus} and day.violations == 0
    assert elasticity.fixed("floor", np.array([3.0, 5.0]), 8, floor=17).gpus.tolist() == [24, 24]


# A calibration in capacities: p99 TPOT 20 ms idle, the SLO (100 ms) at 1.0, 300 ms at 1.3.
CURVE = ((0.2, 0.5, 0.8, 1.0, 1.3), (0.1, 0.2, 0.3, 0.35, 0.4), (0.02, 0.03, 0.06, 0.1, 0.3))


def test_scaled_units_move_in_whole_units(elasticity: ModuleType) -> None:
    demand = elasticity.diurnal_trace(60.0, seed=0)
    calibration = elasticity.Calibration(*CURVE)
    spec = AutoscalingSpec(
        mode="builtin", min_replicas=17, max_replicas=4096, scale_up_stabilization_seconds=120
    )
    for unit in (8, 32):
        day = elasticity.autoscaled(f"units-{unit}", demand, unit, 17, spec, calibration, 120.0, start=64)
        assert np.all(day.gpus % unit == 0) and np.all(day.ready % unit == 0)
        assert day.gpus.min() >= 17 and np.all(day.ready <= day.gpus)
        assert len(set(day.gpus.tolist())) > 1  # it does scale over the day


def test_per_gpu_pool_learns_and_follows_a_step_in_demand(elasticity: ModuleType) -> None:
    """tokenRate with the learned target, from a pool of 40 for a flat 20: it learns the capacity
    (1.0; from below the SLO, so up to EXPLORE x beyond the rates it has seen) and settles above
    20 (no violating step) and at most at ceil(20 / 0.873); a jump to 30 violates only while the added
    servers start (120 s window + 120 s to serve = 24 steps), and it never holds more than
    ceil(1.15 x 30)."""
    calibration = elasticity.Calibration(*CURVE)
    spec = AutoscalingSpec(
        mode="builtin", min_replicas=4, max_replicas=4096, scale_up_stabilization_seconds=120
    )
    demand = np.array([20.0] * 1000 + [30.0] * 200)
    day = elasticity.autoscaled("per-gpu", demand, 1, 4, spec, calibration, 120.0, start=40)
    assert 21 <= day.ready[999] <= 23 and int((demand[500:1000] > day.ready[500:1000]).sum()) == 0
    violating_at_the_jump = int((demand[1000:] > day.ready[1000:]).sum())
    assert violating_at_the_jump <= 24
    assert 30 < day.ready[-1] <= 35 and day.gpus[1000:].max() <= math.ceil(1.15 * 30)


def test_a_pool_that_served_a_day_saves_the_target_on_the_peaked_trace(elasticity: ModuleType) -> None:
    """The whole Part B on a hand-made curve: ours measured on its second day saves >= 37.5%
    against fixed 8-GPU units with no violating step, never holds more than ceil(1.15 x peak), and
    the previous default (busy) is among the baselines."""
    demand = elasticity.diurnal_trace(60.0, seed=0)
    ours, baselines = elasticity.simulate(
        demand, 17, elasticity.Calibration(*CURVE), 120.0, before=elasticity.diurnal_trace(60.0, seed=1)
    )
    unit8 = next(day for day in baselines if day.name == "fixed-8")
    assert elasticity.saving(ours, unit8) >= 0.375 and ours.violations == 0
    assert ours.gpus.size == demand.size and ours.gpus.max() <= math.ceil(1.15 * 60)
    assert {day.name for day in baselines} >= {"units-8", "units-32", "per-gpu-busy", "per-gpu-day-1"}


def test_calibration_is_the_monotone_fit_of_the_medians_and_refuses_incoherence(
    elasticity: ModuleType,
) -> None:
    def rows(points: list[tuple[float, float, float]]) -> list[dict[str, float]]:
        return [
            {"rate_rps": rps, "server_tokens_per_s": r, "tpot_p99_s": t, "busy_fraction": 0.3, "failed": 0}
            for rps, r, t in points
        ]

    first = rows([(1, 200, 0.02), (4, 800, 0.06), (6, 1200, 0.14)])
    second = rows([(1, 300, 0.03), (4, 900, 0.05), (6, 1000, 0.12)])
    third = rows([(1, 250, 0.025), (4, 700, 0.30), (6, 1100, 0.13)])  # a pause: 300 ms at 4 req/s
    fit = elasticity.calibrate([first, second, third], 0.1)
    calibration = fit["calibration"]
    # the medians: (250, 25 ms), (800, 60 ms), (1100, 130 ms): the outlier moves nothing
    assert fit["capacity_tokens_per_s"] == pytest.approx(800 + 300 * 40 / 70)
    assert len(calibration.loads) == 3 and fit["repeat_capacities"].count(",") == 2
    assert calibration.tpot_at(1.0) == pytest.approx(0.1)
    assert list(calibration.tpot) == sorted(calibration.tpot)
    assert calibration.tpot_at(2.0) > calibration.tpot_at(1.5) > 0.1  # continued past the last point
    with pytest.raises(elasticity.IncoherentCalibration, match="every rate met the SLO"):
        elasticity.calibrate([rows([(1, 200, 0.02), (4, 800, 0.06)])], 0.1)
    with pytest.raises(elasticity.IncoherentCalibration, match="no rate met the SLO"):
        elasticity.calibrate([rows([(1, 200, 0.2), (4, 800, 0.6)])], 0.1)
    with pytest.raises(elasticity.IncoherentCalibration, match="only 0 of 2 repeats"):
        elasticity.calibrate([first, rows([(1, 100, 0.05), (4, 300, 0.2)])], 0.1)
    # A repeat that met the SLO at every rate up to one near the capacity agrees (it bounds it).
    met_all = rows([(1, 240, 0.02), (4, 820, 0.06), (6, 1000, 0.09)])
    assert ">= 1000" in elasticity.calibrate([first, second, met_all], 0.1)["repeat_capacities"]


def test_savings_on_a_hand_checkable_day(elasticity: ModuleType) -> None:
    ours = elasticity.Day("ours", np.array([1, 1, 2, 2]), np.array([1, 1, 2, 2]), 0)
    baseline = elasticity.Day("fixed", np.array([4, 4, 4, 4]), np.array([4, 4, 4, 4]), 0)
    assert ours.gpu_hours() == pytest.approx(6 * elasticity.STEP_S / 3600)
    assert elasticity.saving(ours, baseline) == pytest.approx(1 - 6 / 16)
    assert elasticity.max_instant_saving(ours, baseline) == pytest.approx(0.75)


def test_calibration_busy_curve(elasticity: ModuleType) -> None:
    linear = elasticity.Calibration((1.0,), (0.5,))
    assert linear.u_slo == 0.5
    assert linear.busy_at(0.5) == pytest.approx(0.25)
    assert linear.busy_at(1.5) == pytest.approx(0.75) and linear.busy_at(3.0) == 1.0
    noisy = elasticity.Calibration((0.5, 1.0, 2.0), (0.3, 0.2, 0.6))  # a dip made non-decreasing
    assert noisy.u_slo == pytest.approx(0.3)
    assert math.isclose(noisy.busy_at(1.5), 0.45)
