"""benchmarks/load_checkpoint.py runs end to end and ends with the JSON line."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_load_checkpoint_quick(tmp_path: Path) -> None:
    last = run_quick("load_checkpoint.py", tmp_path, "--repeats", "1")
    rows = {row["mode"]: row for row in last["results"]}
    assert set(rows) == {"plain", "eaas"}
    assert rows["plain"]["share_bytes"] == rows["eaas"]["share_bytes"] > 0
    assert set(last["targets"]) == {"throughput_vs_plain_read", "peak_rss_vs_share_bytes"}
