"""``benchmarks/attention.py --quick`` runs, its paged path agrees with the floor, and it reports
today's path beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow


def test_attention_benchmark_reports_every_path(tmp_path: Path) -> None:
    last = run_quick("attention.py", tmp_path, "--threads", "1", timeout=600)
    decode = [row for row in last["results"] if "shape" in row]
    assert {row["shape"] for row in decode} == {"gqa", "mla"}
    for row in decode:
        assert row["max_abs_error_vs_floor"] < 1e-4, row  # the same attention, read in place
        assert row["reference_ms"] is not None and row["paged_ms"] > 0, row
    e2e = next(row["end_to_end"] for row in last["results"] if "end_to_end" in row)
    assert e2e["reference_tokens_per_s"] > 0 and e2e["paged_tokens_per_s"] > 0
    assert set(last["targets"]) == {
        "decode_gqa_1024_paged_vs_floor",
        "decode_mla_1024_paged_vs_floor",
        "e2e_decode_speedup",
    }
