"""NVIDIA's AIPerf, unmodified, against ``eaas serve``: a short streamed chat run at concurrency 2 on
synthetic prompts. Every request completes; TTFT and ITL are sane; the token counts the server
reports are the ones asked for; AIPerf also scrapes the server's Prometheus ``/metrics``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.tool_helpers import Served, run_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REQUESTS = 6
INPUT_TOKENS = 16
OUTPUT_TOKENS = 8


def test_a_streamed_chat_run_completes_every_request(tool_venv: Path, served: Served, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    command = [
        str(tool_venv / "bin" / "aiperf"), "profile",
        "--model", served.model, "--url", served.url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(served.tokenizer), "--use-server-token-count",
        "--isl", str(INPUT_TOKENS), "--isl-stddev", "0", "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
        "--concurrency", "2", "--request-count", str(REQUESTS), "--random-seed", "0",
        "--artifact-dir", str(artifacts), "--ui", "none",
    ]  # fmt: skip
    # Not HF_HUB_OFFLINE: AIPerf 0.13.0 then resolves --tokenizer as a hub repository id (its
    # _resolve_local_snapshot) and refuses a directory. The tokenizer is a local directory either way.
    run_tool(command, cwd=tmp_path, home=tmp_path, offline=False)
    report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == []
    assert report["request_count"]["avg"] == REQUESTS
    for name in ("time_to_first_token", "inter_token_latency", "request_latency"):
        figures = report[name]
        assert figures["count"] == REQUESTS, (name, figures)
        assert 0 <= figures["min"] <= figures["p50"] <= figures["max"], (name, figures)
    # ITL may be 0: the random preset's bytes are often no complete UTF-8 character, and the server
    # holds such text back until it is, so an answer can come in one chunk. The others are not 0.
    assert report["time_to_first_token"]["min"] > 0 and report["request_latency"]["min"] > 0
    assert report["request_latency"]["min"] > report["time_to_first_token"]["min"]
    lengths = report["output_sequence_length"]  # the server's usage.completion_tokens
    assert lengths["min"] == lengths["max"] == OUTPUT_TOKENS, lengths
    server = json.loads((artifacts / "server_metrics_export.json").read_text())["metrics"]
    [series] = server["eaas_attention_generated_tokens"]["series"]
    assert series["stats"]["total"] == REQUESTS * OUTPUT_TOKENS  # generated during the run
