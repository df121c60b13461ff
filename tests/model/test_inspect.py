"""``eaas model inspect`` reads headers only and sizes an expert server's share."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from eaas.runtime.commands.model import model
from eaas.runtime.model import CheckpointReader, preset, write_random_checkpoint
from eaas.runtime.model.inspect import summarize


def test_summary_of_a_tiny_checkpoint(tiny_checkpoints: dict[str, Path]) -> None:
    summary = summarize(CheckpointReader(tiny_checkpoints["mixtral"]), servers=3, replication=2)
    config = preset("mixtral")
    assert summary.expert_bytes == 3 * config.expert_intermediate_size * config.hidden_size * 4
    assert summary.experts_per_server == 3 * 8 * 2 // 3  # 3 MoE layers x 8 experts x R=2 over 3 servers
    assert summary.bytes_per_server == 16 * summary.expert_bytes
    assert summary.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x f32
    assert summary.stored_dtypes == {"F32": len(CheckpointReader(tiny_checkpoints["mixtral"]).names())}


def test_inspect_cli_on_fp8_and_bad_arguments(tmp_path: Path) -> None:
    directory = write_random_checkpoint(preset("deepseek_v3"), tmp_path / "ds", fp8_block=(16, 16))
    runner = CliRunner()
    result = runner.invoke(model, ["inspect", str(directory), "--servers", "4"])
    assert result.exit_code == 0, result.output
    assert "deepseek_v3 (mla attention)" in result.output
    assert "FP8 blocks 16x16" in result.output
    # FP8 experts are served as bf16: 3 x 32 x 64 x 2 bytes.
    assert "one expert        12.0 KiB as served" in result.output
    result = runner.invoke(model, ["inspect", str(directory), "--servers", "2", "--replication", "3"])
    assert result.exit_code == 2 and "1 <= replication <= servers" in result.output
    result = runner.invoke(model, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and "config.json: not found" in result.output


def test_summary_of_fused_experts(tiny_checkpoints: dict[str, Path]) -> None:
    summary = summarize(CheckpointReader(tiny_checkpoints["gpt_oss"]), servers=2, replication=1)
    h, i = 64, 32
    assert summary.expert_bytes == (3 * h * i + 2 * i + h) * 4  # weights and biases, float32
