"""``benchmarks/moe_kernels.py --quick`` and the autotune smoke test run end to end on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS.parent,
        env=os.environ,
    )


def test_moe_kernels_quick_ends_with_the_json_line(tmp_path: Path) -> None:
    json_out = tmp_path / "moe_kernels.json"
    result = _run(str(BENCHMARKS / "moe_kernels.py"), "--quick", "--reps", "1", "--json-out", str(json_out))
    assert result.returncode == 0, result.stderr[-3000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text())
    assert last["benchmark"] == "moe_kernels" and last["results"]
    for row in last["results"]:
        assert row["max_normalized_error"] <= 1.0, row
        assert row["triton_us"] > 0 and row["grouped_mm_us"] > 0 and row["loop_us"] > 0
    targets = last["targets"]
    assert targets["max_error_within_tolerance"]["met"] is True
    gpu_targets = [name for name in targets if name != "max_error_within_tolerance"]
    assert len(gpu_targets) == 3
    for name in gpu_targets:
        if torch.cuda.is_available():
            assert isinstance(targets[name]["met"], bool)
        else:  # never estimated without a GPU
            assert targets[name]["value"] is None and targets[name]["met"] is None
            assert "not measured" in targets[name]["note"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the autotuner does real (long) tuning")
def test_autotune_smoke_writes_a_valid_file(tmp_path: Path) -> None:
    from eaas.kernels.configs import load_tuned_configs, select_configs

    out = tmp_path / "tuned.json"
    result = _run(str(BENCHMARKS / "autotune_moe.py"), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    data = load_tuned_configs(str(out))
    assert "cpu-interpreter-smoke-test" in data["devices"]
    gate_up, down = select_configs("cpu-interpreter-smoke-test", 64, 32, 8, path=str(out))
    assert gate_up.block_m == 16 and down.block_m == 16


def test_autotune_without_gpu_refuses_the_packaged_file() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    result = _run(str(BENCHMARKS / "autotune_moe.py"))
    assert result.returncode == 2
    assert "pass --out" in result.stderr


def test_warm_up_quick_times_a_first_and_a_second_warm_up(tmp_path: Path) -> None:
    json_out = tmp_path / "warm_up.json"
    result = _run(str(BENCHMARKS / "warm_up.py"), "--quick", "--json-out", str(json_out))
    assert result.returncode == 0, result.stderr[-3000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text()) and last["benchmark"] == "warm_up"
    assert [row["backend"] for row in last["results"]] == ["torch", "grouped_mm"]  # no GPU: no Triton row
    for row in last["results"]:
        assert row["first_s"] > 0 and row["second_s"] > 0, row
        assert sorted(row["first_call_ms_after"], key=int) == ["1", "3", "8", "24", "64", "200", "512"], row
