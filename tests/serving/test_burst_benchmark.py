"""``benchmarks/burst.py`` runs, and every client of a burst gets an answer (a stream or a 429)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_burst_benchmark_answers_every_client(tmp_path: Path) -> None:
    last = run_quick("burst.py", tmp_path, "--sizes", "40,120")
    for row in last["results"]:
        assert sum(row["counts"].values()) == row["clients"], row
        assert set(row["counts"]) <= {"200", "429"}, row  # no reset, timeout or 429 without Retry-After
        assert row["answered_200"] >= 1 and row["errors"] == 0, row
    assert last["targets"]["errors_in_every_burst"] == {"value": 0, "target": 0, "met": True}
