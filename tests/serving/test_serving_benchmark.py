"""benchmarks/serving.py runs end to end (attention-client processes over one cluster: static,
continuous, streamed, then prefix caching on and off over two workloads) and ends with the JSON
line; every answer matched the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_serving_quick(tmp_path: Path) -> None:
    last = run_quick("serving.py", tmp_path, "--requests", "12", timeout=600)
    modes = {row["mode"]: row for row in last["results"]}
    assert set(modes) == {
        "static",
        "continuous",
        "continuous stream",
        "shared system prompt, cache on stream",
        "shared system prompt, cache off stream",
        "no sharing, cache on stream",
        "no sharing, cache off stream",
    }
    assert all(row["failed"] == 0 and row["requests"] == 12 for row in modes.values())
    assert last["targets"]["failed_requests"]["met"] is True
    assert modes["continuous stream"]["ttft_p50_s"] <= modes["continuous stream"]["latency_p50_s"]
    # Part B: the shared prompt is found in the cache (all but the first request's), never with it off
    on, off = modes["shared system prompt, cache on stream"], modes["shared system prompt, cache off stream"]
    assert on["shared_fraction"] > 0.5 and on["prefix_hit_rate"] > 0.5 * on["shared_fraction"]
    assert off["prefix_hit_rate"] == 0 and modes["no sharing, cache on stream"]["prefix_hit_rate"] < 0.05
