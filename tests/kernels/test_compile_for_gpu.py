"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

Runs ``python -m eaas.kernels.compile_check`` (Triton's NVIDIA backend and ptxas, nothing is
executed) in a subprocess without TRITON_INTERPRET: every default tile configuration (and the
bias/clamped-SwiGLU and FP8 variants of the largest) must fit in
shared memory at its ``programs_per_sm``, and so must the paged-attention kernel at Qwen3's GQA
and DeepSeek's MLA shapes; and with ``num_stages > 1`` the K loop must be
software-pipelined. This is the GPU code path as far as a CPU can check it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_kernels_compile_for_sm90() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "eaas.kernels.compile_check", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    gemms = [report for report in reports if report["kernel"] in ("gate_up", "down")]
    assert {report["kernel"] for report in gemms} == {"gate_up", "down"}
    assert any(report["kernel"] == "align" for report in reports)
    for variant in ("epilogue", "fp8"):  # biases + clamped SwiGLU; block-scaled FP8 weights
        assert {r["kernel"] for r in gemms if r["variant"] == variant} == {"gate_up", "down"}
    for report in gemms:
        assert report["ok"], f"does not fit in shared memory: {report}"
        if report["config"]["num_stages"] > 1:
            assert report["pipelined"], f"K loop not pipelined: {report}"
    attention = [report for report in reports if report["kernel"] == "paged_attention"]
    assert {report["variant"].split(",")[0] for report in attention} == {"qwen3_gqa", "deepseek_mla"}
    for report in attention:
        assert report["ok"], f"does not fit in shared memory: {report}"
    assert result.returncode == 0
