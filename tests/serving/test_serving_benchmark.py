"""benchmarks/serving.py runs end to end (three attention-client processes over one cluster) and
ends with the JSON line; every answer matched the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_serving_quick(tmp_path: Path) -> None:
    last = run_quick("serving.py", tmp_path, "--requests", "12", timeout=600)
    modes = {row["mode"]: row for row in last["results"]}
    assert set(modes) == {"static", "continuous", "continuous stream"}
    assert all(row["failed"] == 0 and row["requests"] == 12 for row in modes.values())
    assert last["targets"]["failed_requests"]["met"] is True
    assert modes["continuous stream"]["ttft_p50_s"] <= modes["continuous stream"]["latency_p50_s"]
