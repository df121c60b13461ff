"""benchmarks/serving.py runs end to end (three attention-client processes over one cluster) and
ends with the JSON line; every answer matched the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_serving_quick(tmp_path: Path) -> None:
    json_out = tmp_path / "serving.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--quick", "--requests", "12",
         "--json-out", str(json_out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text())
    modes = {row["mode"]: row for row in last["results"]}
    assert set(modes) == {"static", "continuous", "continuous stream"}
    assert all(row["failed"] == 0 and row["requests"] == 12 for row in modes.values())
    assert last["targets"]["failed_requests"]["met"] is True
    assert modes["continuous stream"]["ttft_p50_s"] <= modes["continuous stream"]["latency_p50_s"]
