"""The data-path benchmarks (transport_rtt, e2e_decode) run end to end and end with the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import run_quick

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_transport_rtt_quick(tmp_path: Path) -> None:
    last = run_quick("transport_rtt.py", tmp_path)
    sizes = {(r["tokens"], r["hidden"]) for r in last["results"]}
    assert sizes == {(t, h) for t in (1, 16, 128, 512) for h in (2048, 7168)}
    for row in last["results"]:
        assert row["copy_floor_us"] > 0 and row["shm_us"] > 0 and row["tcp_us"] > 0 and row["naive_us"] > 0


def test_e2e_decode_quick(tmp_path: Path) -> None:
    last = run_quick("e2e_decode.py", tmp_path, "--steps", "2")
    runs = {row["run"]: row for row in last["results"]}
    assert set(runs) == {"monolithic", "eaas", "eaas_server_killed"}
    assert runs["eaas_server_killed"]["failed_requests"] == 0  # correctness holds even on a busy machine
    assert last["targets"]["failed_requests_under_kill"]["met"] is True


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the run without CUDA")
@pytest.mark.parametrize("script", ["gpu_rtt.py", "gpu_mechanisms.py"])
def test_gpu_benchmarks_report_nothing_measured_without_cuda(script: str, tmp_path: Path) -> None:
    json_out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--json-out", str(json_out)],
        capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text()) and last["results"] == []
    for entry in last["targets"].values():  # GPU targets are never estimated
        assert entry["value"] is None and entry["met"] is None and "not measured" in entry["note"]
