"""benchmarks/load_checkpoint.py runs end to end and ends with the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_load_checkpoint_quick(tmp_path: Path) -> None:
    json_out = tmp_path / "load.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load_checkpoint.py"), "--quick", "--repeats", "1",
         "--json-out", str(json_out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text())
    rows = {row["mode"]: row for row in last["results"]}
    assert set(rows) == {"plain", "eaas"}
    assert rows["plain"]["share_bytes"] == rows["eaas"]["share_bytes"] > 0
    assert set(last["targets"]) == {"throughput_vs_plain_read", "peak_rss_vs_share_bytes"}
