"""Synthetic traces: deterministic, calibrated skew, drift and phase switches."""

from __future__ import annotations

import numpy as np
import pytest

from eaas.runtime.placement import PlacementError, SyntheticTrace, TraceConfig, round_robin, server_loads
from eaas.runtime.placement.cost import max_over_mean


def test_loads_are_deterministic_in_any_chunking() -> None:
    trace = SyntheticTrace(TraceConfig(num_layers=3, num_experts=16, seed=4))
    whole = trace.loads(0, 30)
    assert whole.shape == (30, 3, 16) and whole.dtype == np.float32
    np.testing.assert_array_equal(whole[10:], trace.loads(10, 30))
    np.testing.assert_array_equal(
        whole, SyntheticTrace(TraceConfig(num_layers=3, num_experts=16, seed=4)).loads(0, 30)
    )
    assert not np.array_equal(
        whole, SyntheticTrace(TraceConfig(num_layers=3, num_experts=16, seed=5)).loads(0, 30)
    )
    assert (whole >= 0).all()
    assert abs(float(whole.sum(axis=2).mean()) / TraceConfig().tokens_per_step - 1) < 0.01


def test_default_trace_is_calibrated_to_max_over_mean_2_5() -> None:
    """DeepSeek-V3 shape, round-robin on 64 servers, no balancing: per-server max/mean ~2.5."""
    placement = round_robin(58, 256, 64)
    ratios = [
        float(
            max_over_mean(server_loads(placement, SyntheticTrace(TraceConfig(seed=seed)).loads(0, 3))).mean()
        )
        for seed in range(3)
    ]
    assert 2.3 < float(np.mean(ratios)) < 2.7, ratios


def test_phases_switch_and_popularity_drifts() -> None:
    config = TraceConfig(num_layers=4, num_experts=64, phase_steps=1000, switch_steps=20, seed=1)
    trace = SyntheticTrace(config)
    assert [trace.phase_at(s) for s in (0, 999, 1000, 2500, 3000)] == ["chat", "chat", "code", "math", "chat"]

    def corr(a: int, b: int) -> float:
        x, y = np.log(trace.popularity(a)).ravel(), np.log(trace.popularity(b)).ravel()
        return float(np.corrcoef(x, y)[0, 1])

    assert corr(100, 110) > 0.99  # within a phase: slow drift
    assert corr(100, 600) < corr(100, 110)  # it does drift
    assert corr(900, 1100) < 0.8  # a domain switch changes which experts are hot
    np.testing.assert_allclose(trace.popularity(123).sum(axis=1), 1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 0}, "num_experts must be an int >= 1"),
        ({"phases": ()}, "at least one phase"),
        ({"switch_steps": 5000}, "switch_steps must be in 0..phase_steps"),
        ({"shared_fraction": 1.5}, r"shared_fraction must be in \[0, 1\]"),
    ],
)
def test_bad_trace_configs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        TraceConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="0 <= start < stop"):
        SyntheticTrace(TraceConfig(num_layers=1, num_experts=2)).loads(5, 5)
