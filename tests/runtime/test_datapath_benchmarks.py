"""The data-path benchmarks (transport_rtt, e2e_decode) run end to end and end with the JSON line."""

from __future__ import annotations

import ast
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
    assert sizes == {(t, h) for t in (1, 8, 16, 32, 128, 512) for h in (2048, 7168)}
    for row in last["results"]:
        assert row["copy_floor_us"] > 0 and row["shm_us"] > 0 and row["tcp_us"] > 0 and row["naive_us"] > 0
        # nixl: the transport, NIXL's own round trip (default UCX transports and TCP alone)
        assert row["nixl_us"] > 0 and row["nixl_raw_us"] > 0 and row["nixl_raw_ucx_tcp_us"] > 0
        assert row["nixl_over_raw"] == row["nixl_us"] / row["nixl_raw_us"]
        # as the client drives them: x staged in place (shm, nixl), the answer not copied out
        assert row["shm_in_place_us"] > 0 and row["tcp_in_place_us"] > 0 and row["nixl_in_place_us"] > 0
        assert row["nixl_in_place_over_raw"] == row["nixl_in_place_us"] / row["nixl_raw_us"]
        assert row["nixl_fixed_spin_in_place_us"] > 0  # the waiting that never learns the server's pace
        # NIXL's own notification round trip (what nixl's small frames use), for x up to 64 KiB
        small = row["tokens"] * row["hidden"] * 2 <= 64 << 10
        assert (row.get("nixl_raw_notify_us", 0) > 0) is small, row
        if row["hidden"] == 7168:  # with and without NIXL's progress thread in the echo process
            assert row["pt_nixl_us"] > 0 and row["pt_nixl_progress_thread_us"] > 0
            assert row["pt_nixl_echo_cpu"] >= 0 and row["pt_nixl_progress_thread_echo_cpu"] >= 0
    assert {
        "shm_within_3x_copy_floor_512x7168",
        "tcp_5x_faster_than_naive_512x7168",
        "nixl_within_1.3x_raw_128x7168",
        "nixl_within_1.3x_raw_512x7168",
        "nixl_faster_than_tcp_from_32",
        "nixl_within_1.2x_tcp_below_32",
    } == set(last["targets"])
    at = {(r["tokens"], r["hidden"]): r for r in last["results"]}
    in_place_128 = at[(128, 7168)]["nixl_in_place_over_raw"]
    assert last["targets"]["nixl_within_1.3x_raw_128x7168"]["value"] == in_place_128


def test_e2e_decode_quick(tmp_path: Path) -> None:
    last = run_quick("e2e_decode.py", tmp_path, "--steps", "2")
    runs = {row["run"]: row for row in last["results"]}
    assert set(runs) == {"monolithic", "eaas", "eaas_tcp", "eaas_nixl", "eaas_server_killed"}
    assert runs["eaas_nixl"]["server_transports"] == ["nixl"] and runs["eaas_nixl"]["tokens_per_s"] > 0
    assert runs["eaas_nixl"]["vs_tcp"] == runs["eaas_nixl"]["tokens_per_s"] / runs["eaas_tcp"]["tokens_per_s"]
    for run in ("eaas", "eaas_tcp", "eaas_nixl"):  # the CPU the decode steps took, client and servers
        assert runs[run]["client_cpu_ms_per_step"] > 0 and runs[run]["servers_cpu_ms_per_step"] > 0
    assert runs["eaas_server_killed"]["failed_requests"] == 0  # correctness holds even on a busy machine
    assert last["targets"]["failed_requests_under_kill"]["met"] is True


def test_e2e_decode_micro_batches_quick(tmp_path: Path) -> None:
    last = run_quick("e2e_decode.py", tmp_path, "--micro-batches", "1,2", "--steps", "2", "--reps", "1")
    simulated = [row for row in last["results"] if not row["run"].startswith("torch_engine")]
    runs = {(row["run"], row["ratio_expert_to_attention"]): row for row in simulated}
    assert set(runs) == {(f"{m}BO", ratio) for m in (1, 2) for ratio in (1.0, 2.0)}
    engine = {row["run"]: row for row in last["results"] if row["run"].startswith("torch_engine")}
    assert set(engine) == {"torch_engine_1BO", "torch_engine_2BO", "torch_engine_auto"}
    assert last["targets"]["auto_vs_1BO_torch_backend"]["value"] == engine["torch_engine_auto"]["vs_1BO"]
    for (_, ratio), row in runs.items():
        assert row["tokens_per_s"] > 0 and row["cpu_s_per_token"] >= row["client_cpu_s_per_token"] > 0
        assert row["vs_1BO"] == row["tokens_per_s"] / runs[("1BO", ratio)]["tokens_per_s"]
        assert row["simulated_backend"].startswith("simulated:0:")
    assert set(last["targets"]) == {
        "2BO_vs_1BO_tokens_per_s_rt_eq_attention", "2BO_vs_1BO_p99_inter_token", "failed_requests",
        "auto_vs_1BO_torch_backend",
    }  # fmt: skip
    assert last["targets"]["failed_requests"]["met"] is True  # 2BO's tokens are 1BO's


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the run without CUDA")
@pytest.mark.parametrize("script", ["gpu_rtt.py", "gpu_mechanisms.py", "nixl_gpu_rtt.py"])
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


def test_nixl_gpu_rtt_measures_its_host_memory_row_here(tmp_path: Path) -> None:
    """The GPU script's NIXL half (agents, echo process, poisoned-and-checked answers) on host
    memory, so what runs on a lent GPU was run here first."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "nixl_gpu_rtt.py"), "--host-check", "--quick", "--rows", "dram"],
        capture_output=True, text=True, timeout=180, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    measured = ast.literal_eval(result.stdout.strip().splitlines()[-1])["dram"]
    assert sorted(measured) == [1, 8, 32, 128, 512] and all(us > 0 for us in measured.values())
