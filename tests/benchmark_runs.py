"""Runs a ``benchmarks/`` script with ``--quick`` and checks the JSON line every benchmark ends with
(imported by the benchmark tests of several test directories)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_quick(script: str, tmp_path: Path, *extra: str, timeout: float = 300) -> dict[str, Any]:
    json_out = tmp_path / f"{script}.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--json-out", str(json_out), *extra],
        capture_output=True, text=True, timeout=timeout, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text())
    assert set(last) == {"benchmark", "device", "commit", "results", "targets"}
    for entry in last["targets"].values():
        assert set(entry) == {"value", "target", "met"} and isinstance(entry["met"], bool)
    return last
