"""benchmarks/structured_outputs.py runs and ends with its JSON line: every mode decoded every
token (no row ended early), and the mask was timed at each batch size."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_structured_outputs_quick(tmp_path: Path) -> None:
    last = run_quick("structured_outputs.py", tmp_path, timeout=600)
    engine = [row for row in last["results"] if row["part"] == "engine"]
    assert [row["constrained_rows"] for row in engine] == [0, 4, 8]
    assert all(row["finished_early"] == 0 and row["tokens"] == 8 * 31 for row in engine)
    masks = [row for row in last["results"] if row["part"] == "mask"]
    assert {(row["vocab"], row["batch"]) for row in masks} == {(32_000, 1), (32_000, 16)}
    assert all(row["us_per_row_token"] > 0 for row in masks)
    assert last["targets"]["no_row_ended_early"]["met"] is True
