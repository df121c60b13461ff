"""GuideLLM (the vLLM project's load and SLO benchmark), unmodified, against ``eaas serve``: a short
``concurrent`` run on synthetic prompts; every request completes and its report's TTFT and ITL
figures are sane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.tool_helpers import Served, run_tool, tokenize_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REQUESTS = 6
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8


def test_a_concurrent_run_completes_every_request(tool_venv: Path, served: Served, tmp_path: Path) -> None:
    report = tmp_path / "guidellm.json"
    command = [
        str(tool_venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={served.url},model={served.model}",
        "--profile", "kind=concurrent,streams=2",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={served.tokenizer}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    run_tool(command, cwd=tmp_path, home=tmp_path)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    errors = [r["info"].get("error") for r in requests["errored"] + requests["incomplete"]]
    assert not errors, errors
    assert len(requests["successful"]) == REQUESTS
    metrics = benchmark["metrics"]
    # One TTFT and latency per request; one ITL per streamed token after the first.
    counts = {
        "time_to_first_token_ms": REQUESTS,
        "request_latency": REQUESTS,
        "inter_token_latency_ms": REQUESTS * (OUTPUT_TOKENS - 1),
    }
    for name, count in counts.items():
        figures: dict[str, Any] = metrics[name]["successful"]
        assert figures["count"] == count, (name, figures)
        assert 0 <= figures["min"] <= figures["median"] <= figures["max"], (name, figures)
    # An ITL may be 0: the random preset's bytes are often no complete UTF-8 character, and the
    # server holds such text back until it is, so several tokens can come in one chunk.
    assert metrics["time_to_first_token_ms"]["successful"]["min"] > 0
    assert metrics["request_latency"]["successful"]["min"] > 0
    # The first token comes before the last: a request's latency exceeds its TTFT.
    assert (
        metrics["request_latency"]["successful"]["max"] * 1000
        > metrics["time_to_first_token_ms"]["successful"]["min"]
    )
    # The server's usage: a prompt of PROMPT_TOKENS tokens in the chat template (as /tokenize counts).
    prompt = tokenize_chat(served, [{"role": "user", "content": "x" * PROMPT_TOKENS}])
    prompts = metrics["prompt_token_count"]["successful"]
    assert prompts["min"] == prompts["max"] == len(prompt) > PROMPT_TOKENS, prompts
    assert metrics["output_token_count"]["successful"]["total_sum"] == REQUESTS * OUTPUT_TOKENS
