"""``eaas attention-client`` serving mode: OpenAI-compatible completions over real expert-server processes.

A ``LocalCluster`` (two expert-server processes, R = 1, tcp) serves the tiny mixtral checkpoint; the
attention client serves HTTP on loopback, in this process (``AttentionService``) and as the pod
command (``eaas attention-client`` configured by ``EAAS_*`` variables).
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.client import ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import ByteTokenizer, CheckpointReader, Decoder, load_reference
from eaas.runtime.placement import round_robin, stored
from eaas.runtime.serving import completions as completions_module
from eaas.runtime.serving.batch_scheduler import BatchScheduler, Job, QueueFull, take_batch
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.serve import AttentionService, ServeOptions, expert_urls, static_discovery

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MODEL = "tiny-mixtral"


def http(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(request, timeout=30) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text.decode()


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["mixtral"]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Decoder:
    return load_reference(checkpoint)


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    with LocalCluster(
        checkpoint, placement, tmp_path_factory.mktemp("cluster"), transports=("tcp",)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def service(checkpoint: Path, cluster: LocalCluster) -> Iterator[AttentionService]:
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        model_name=MODEL,
        max_batch_size=8,
        max_queue=8,
        max_tokens=64,
        placement_poll_s=0.2,
        client=ClientOptions(transport="tcp", request_timeout_s=10.0, rejoin_max_s=0.5),
    )
    with AttentionService(checkpoint, cluster.placement_path, static_discovery(cluster.urls), options) as svc:
        yield svc


def expected(reference: Decoder, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    tokens, _ = reference.generate(prompts, max(max_tokens))
    return [t[:n] for t, n in zip(tokens, max_tokens, strict=True)]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def test_concurrent_completions_equal_the_reference_and_share_batches(
    service: AttentionService, reference: Decoder
) -> None:
    tokenizer = ByteTokenizer(service.config.vocab_size)
    requests: list[dict[str, Any]] = [
        {"model": MODEL, "prompt": "Experts as a service", "max_tokens": 6, "temperature": 0},
        {"model": MODEL, "prompt": [7, 8, 300], "max_tokens": 3, "temperature": 0},
        {"prompt": ["Hello", [42], "MoE on Kubernetes"], "max_tokens": 5, "temperature": 0},  # 3 choices
        {"prompt": "a", "max_tokens": 8, "temperature": 0.0, "stop": None},
        {"prompt": [100, 200, 300, 250], "max_tokens": 4, "temperature": 0},
        {"prompt": "batched", "max_tokens": 2, "temperature": 0},
    ]
    results: list[Any] = [None] * len(requests)

    def send(index: int) -> None:
        results[index] = http("POST", f"{service.url}/v1/completions", requests[index])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    prompts: list[list[int]] = []
    lengths: list[int] = []
    answers: list[dict[str, Any]] = []
    for request, (status, body) in zip(requests, results, strict=True):
        assert status == 200, body
        assert body["object"] == "text_completion" and body["model"] == MODEL
        items = (
            request["prompt"]
            if isinstance(request["prompt"], list) and not isinstance(request["prompt"][0], int)
            else [request["prompt"]]
        )
        assert [c["index"] for c in body["choices"]] == list(range(len(items)))
        for item in items:
            prompts.append(tokenizer.encode(item) if isinstance(item, str) else item)
            lengths.append(request["max_tokens"])
        answers += body["choices"]
        used = body["usage"]
        assert used["completion_tokens"] == request["max_tokens"] * len(items)
        assert used["prompt_tokens"] == sum(len(prompts[-1 - i]) for i in range(len(items)))
        assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"]
    want = expected(reference, prompts, lengths)
    assert [c["token_ids"] for c in answers] == want
    assert [c["text"] for c in answers] == [tokenizer.decode(w) for w in want]
    assert all(c["finish_reason"] == "length" for c in answers)
    text = http("GET", f"{service.url}/metrics")[1]
    steps = metric(text, "eaas_attention_batch_sequences_count")
    single = metric(text, 'eaas_attention_batch_sequences_bucket{le="1.0"}')
    assert single < steps  # some steps ran several sequences together
    # Every step says how long it spent on the expert servers; together less than the requests took.
    assert metric(text, "eaas_attention_step_expert_seconds_count") == steps
    spent = metric(text, "eaas_attention_step_expert_seconds_sum")
    assert 0 < spent < metric(text, "eaas_attention_request_seconds_sum")
    # The p99 time per output token of the last 30 s (what the Lease carries for the autoscaler):
    # within the histogram's observations, which all finished just now.
    p99 = metric(text, "eaas_attention_time_per_output_token_p99_seconds")
    finished = metric(text, "eaas_attention_time_per_output_token_seconds_count")
    assert finished > 0 and 0 < p99 <= metric(text, "eaas_attention_time_per_output_token_seconds_sum")


def test_stop_strings_cut_the_text(service: AttentionService, reference: Decoder) -> None:
    tokenizer = ByteTokenizer(service.config.vocab_size)
    [full], _ = reference.generate([tokenizer.encode("Hello")], 12)
    text = tokenizer.decode(full)
    assert len(text) >= 5, "the fixed random checkpoint must produce enough text for a stop string"
    stop = text[3:5]
    status, body = http(
        "POST",
        f"{service.url}/v1/completions",
        {"prompt": "Hello", "max_tokens": 12, "stop": [stop], "temperature": 0},
    )
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.find(stop)]
    assert (
        stop in tokenizer.decode(choice["token_ids"])
        and choice["token_ids"] == full[: len(choice["token_ids"])]
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "temperature": "0"}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": "x"}, "frequency_penalty"),
        ({"prompt": "hi", "stop_token_ids": [100000]}, "stop_token_ids"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "best_of": True}, "best_of"),
        ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 100000]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": ["ok", 3]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 65}, "max_tokens"),
        ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type"),
        ({"prompt": "hi", "structured_outputs": {"regex": "[a"}}, "structured_outputs.regex"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": ["a"] * 9, "n": 4}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ([1, 2], "body"),
        # Fields this server does not implement are refused, never ignored:
        ({"prompt": "hi", "logit_bias": {"7": 5}}, "logit_bias"),
        ({"prompt": "hi", "min_p": 0.1}, "min_p"),
        ({"prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_requests_are_400_naming_the_field(service: AttentionService, body: Any, field: str) -> None:
    status, answer = http("POST", f"{service.url}/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field and answer["error"]["message"].startswith(field)


def test_fields_at_their_neutral_values_or_null_are_accepted(service: AttentionService) -> None:
    """SDKs fill in defaults: a field that changes nothing at its value is no reason to refuse."""
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {}, "min_p": 0.0, "repetition_penalty": 1,
            "ignore_eos": False, "suffix": None, "metadata": None}  # fmt: skip
    status, answer = http("POST", f"{service.url}/v1/completions", body)
    assert status == 200, answer
    status, answer = http(
        "POST",
        f"{service.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logit_bias": {"5": 1}},
    )
    assert status == 400 and answer["error"]["param"] == "logit_bias", answer  # not neutral: refused


def test_a_kv_cache_smaller_than_the_context_bounds_what_a_request_may_take(
    checkpoint: Path, cluster: LocalCluster, service: AttentionService
) -> None:
    """A chat without ``max_tokens`` takes the rest of the context: of the positions the KV cache
    can give one sequence where that is less than the model's, not a 400 for a max_tokens the
    client never sent; /tokenize says the same length."""
    per_block = KVPool.bytes_per_block(service.config, 16, service.side.dtype)
    assert service.config.max_position_embeddings > 4 * 16
    options = ServeOptions(
        host="127.0.0.1", port=0, model_name=MODEL, kv_cache_bytes=4 * per_block, block_size=16,
        placement_poll_s=0.2, client=ClientOptions(transport="tcp", request_timeout_s=10.0),
    )  # fmt: skip
    with AttentionService(
        checkpoint, cluster.placement_path, static_discovery(cluster.urls), options
    ) as small:
        assert small.limits.max_context == 64
        status, answer = http(
            "POST", f"{small.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200, answer
        assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= 64
        status, answer = http("POST", f"{small.url}/tokenize", {"prompt": "hi"})
        assert status == 200 and answer["max_model_len"] == 64, answer


def test_a_chat_prompt_that_fills_the_context_is_blamed_on_the_messages(service: AttentionService) -> None:
    """Without ``max_tokens`` the answer may take what the context leaves; a prompt that leaves
    nothing is the messages' fault, not that of a max_tokens the client never sent."""
    long = {"messages": [{"role": "user", "content": "x" * 5000}]}
    status, answer = http("POST", f"{service.url}/v1/chat/completions", long)
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert "leaves no room for an answer" in answer["error"]["message"]
    status, answer = http("POST", f"{service.url}/v1/chat/completions", {**long, "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer  # (it was sent)


def test_an_unknown_model_is_a_404_in_openai_shape(service: AttentionService) -> None:
    status, answer = http("POST", f"{service.url}/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert status == 404
    assert answer["error"]["param"] == "model" and answer["error"]["code"] == "model_not_found"
    assert answer["error"]["message"].startswith("model: the model 'gpt-4' does not exist")


def test_malformed_http_never_breaks_the_server(service: AttentionService) -> None:
    assert http("POST", f"{service.url}/v1/completions", raw=b"{not json")[0] == 400
    assert http("POST", f"{service.url}/v1/completions", raw=b"")[0] == 400
    assert http("GET", f"{service.url}/v1/completions")[0] == 405
    assert http("GET", f"{service.url}/v2/nothing")[0] == 404
    status, body = http("POST", f"{service.url}/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2


def test_a_full_queue_answers_429_with_retry_after(service: AttentionService) -> None:
    data = json.dumps({"prompt": ["x"] * 9, "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{service.url}/v1/completions", data=data, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        _OPENER.open(request, timeout=30)
    body = json.loads(refused.value.read())
    assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
    assert body["error"]["type"] == "overloaded" and "queue full" in body["error"]["message"]


def test_models_health_and_metrics(service: AttentionService) -> None:
    status, models = http("GET", f"{service.url}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert http("GET", f"{service.url}/healthz") == (200, "ok\n")
    status, ready = http("GET", f"{service.url}/readyz")
    assert status == 200 and ready["ready"] and ready["live_servers"] == [0, 1]
    assert http("GET", f"{service.url}/health") == (200, ready)  # vLLM's spelling, for gateways
    assert http("GET", f"{service.url}/ping") == http("POST", f"{service.url}/ping") == (200, "ok\n")
    assert http("GET", f"{service.url}/version") == (200, {"version": importlib.metadata.version("eaas")})
    assert http("POST", f"{service.url}/health")[0] == 405
    text = http("GET", f"{service.url}/metrics")[1]
    assert metric(text, 'eaas_attention_requests_total{result="ok"}') >= 1
    assert metric(text, 'eaas_attention_requests_total{result="bad_request"}') >= 1
    assert metric(text, 'eaas_attention_requests_total{result="rejected"}') >= 1
    assert metric(text, "eaas_attention_generated_tokens_total") >= 1
    assert 'eaas_attention_request_seconds_bucket{le="0.005"}' in text
    assert metric(text, "eaas_attention_ready") == 1.0
    assert metric(text, "eaas_attention_live_expert_servers") == 2.0


def test_metrics_also_carry_the_names_vllm_dashboards_and_routers_read(service: AttentionService) -> None:
    prompt = [5, 6, 7, 8] * 9  # 36 tokens: two full blocks of 16, found again the second time
    for _ in range(2):
        status, _ = http(
            "POST", f"{service.url}/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        )
        assert status == 200
    text = http("GET", f"{service.url}/metrics")[1]
    label = f'{{model_name="{MODEL}"}}'
    for ours, theirs in [
        ("eaas_attention_generated_tokens_total", "vllm:generation_tokens_total"),
        ("eaas_attention_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("eaas_attention_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("eaas_attention_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("eaas_attention_preemptions_total", "vllm:num_preemptions_total"),
        ("eaas_attention_running_sequences", "vllm:num_requests_running"),
        ("eaas_attention_queued_sequences", "vllm:num_requests_waiting"),
        ("eaas_attention_kv_cache_usage", "vllm:kv_cache_usage_perc"),
        ("eaas_attention_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("eaas_attention_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("eaas_attention_request_seconds_count", "vllm:e2e_request_latency_seconds_count"),
    ]:
        assert metric(text, ours) == metric(text, theirs + label), theirs
    assert metric(text, "vllm:prefix_cache_hits_total" + label) >= 32  # the second request's two blocks
    assert metric(text, "vllm:inter_token_latency_seconds_count" + label) >= 4  # 2 gaps per request
    assert f'vllm:time_to_first_token_seconds_bucket{{le="0.005",model_name="{MODEL}"}}' in text


def stream(
    url: str, body: dict[str, Any], max_chunks: int | None = None, path: str = "/v1/completions"
) -> list[Any]:
    """POSTs a streaming completion; returns the parsed ``data:`` items ("[DONE]" kept as a string).
    With ``max_chunks``, hangs up after that many (a client that goes away)."""
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=30)
    connection.request(
        "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    items: list[Any] = []
    for line in response:
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            items.append(payload if payload == "[DONE]" else json.loads(payload))
            if max_chunks is not None and len(items) >= max_chunks:
                break
    connection.close()
    return items


def test_streaming_equals_the_whole_answer(service: AttentionService, reference: Decoder) -> None:
    body = {
        "prompt": ["Hello", [42, 7]],
        "max_tokens": 7,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    items = stream(service.url, body)
    assert (
        items[-1] == "[DONE]" and items[-2]["choices"] == [] and items[-2]["usage"]["completion_tokens"] == 14
    )
    texts = {0: "", 1: ""}
    finish = {}
    for item in items[:-2]:
        [choice] = item["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    status, whole = http(
        "POST", f"{service.url}/v1/completions", {k: v for k, v in body.items() if k != "stream_options"}
    )
    assert status == 200
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
    assert finish == {0: "length", 1: "length"}
    tokenizer = ByteTokenizer(service.config.vocab_size)
    assert [c["token_ids"] for c in whole["choices"]] == expected(
        reference, [tokenizer.encode("Hello"), [42, 7]], [7, 7]
    )


def test_guidellms_streamed_requests_are_served(service: AttentionService) -> None:
    """What GuideLLM sends (vLLM's extensions): usage in every chunk, EOS ignored, a minimum."""
    extensions = {
        "max_tokens": 6, "min_tokens": 6, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    for path, body in (
        ("/v1/completions", {"prompt": "Hello", **extensions}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], **extensions}),
    ):
        items = stream(service.url, body, path=path)
        assert items[-1] == "[DONE]" and all("usage" in item for item in items[:-1]), items
        assert items[-2]["choices"] == [] and items[-2]["usage"]["completion_tokens"] == 6


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(service: AttentionService) -> None:
    body = {"prompt": "Experts", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 7, "n": 3}
    first = http("POST", f"{service.url}/v1/completions", body)[1]
    again = http("POST", f"{service.url}/v1/completions", body)[1]
    ids = [c["token_ids"] for c in first["choices"]]
    assert ids == [c["token_ids"] for c in again["choices"]]
    assert len({tuple(t) for t in ids}) == 3  # choice j uses seed + j
    assert [c["index"] for c in first["choices"]] == [0, 1, 2] and first["usage"]["completion_tokens"] == 30
    greedy = http("POST", f"{service.url}/v1/completions", {**body, "temperature": 0, "n": 1})[1]
    assert greedy["choices"][0]["token_ids"] != ids[0] or len(set(ids[0])) == 1


def test_logprobs_are_the_models(service: AttentionService, reference: Decoder) -> None:
    prompt = [5, 9, 13]
    status, body = http(
        "POST",
        f"{service.url}/v1/completions",
        {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2},
    )
    assert status == 200, body
    [choice] = body["choices"]
    tokens, logits = reference.generate([prompt], 4)
    want = torch.log_softmax(logits[:, 0], -1).gather(1, torch.tensor(tokens[0])[:, None])[:, 0].tolist()
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == 4 and all(abs(a - b) < 1e-3 for a, b in zip(got, want, strict=True))
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    status, body = http(
        "POST",
        f"{service.url}/v1/completions",
        {"prompt": "ab", "max_tokens": 2, "echo": True, "temperature": 0},
    )
    assert status == 200 and body["choices"][0]["text"].startswith("ab")


def test_a_client_that_hangs_up_frees_its_kv_cache(service: AttentionService) -> None:
    assert service.worker is not None
    items = stream(service.url, {"prompt": "a long one", "max_tokens": 60, "temperature": 0}, max_chunks=2)
    assert len(items) == 2
    wait_for(
        lambda: service.worker is not None and service.worker.running == 0,
        20,
        "the cancelled sequence to stop",
    )
    assert service.worker.kv_usage == 0.0
    text = http("GET", f"{service.url}/metrics")[1]
    assert metric(text, "eaas_attention_running_sequences") == 0.0
    assert metric(text, "eaas_attention_time_to_first_token_seconds_count") >= 1
    assert metric(text, "eaas_attention_time_per_output_token_seconds_count") >= 1


def test_a_client_that_hangs_up_before_a_whole_answer_is_not_answered_for_nobody(
    service: AttentionService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-streaming request whose client closes the connection is cancelled (looked at between
    tokens every ``GONE_CHECK_S``; here at once), not generated to the end, as vLLM aborts it."""
    assert service.worker is not None
    monkeypatch.setattr(completions_module, "GONE_CHECK_S", 0.0)
    ok = metric(http("GET", f"{service.url}/metrics")[1], 'eaas_attention_requests_total{result="ok"}')
    body = json.dumps({"prompt": "nobody reads this", "max_tokens": 64, "n": 4, "ignore_eos": True}).encode()
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: eaas\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    wait_for(lambda: service.worker is not None and service.worker.running == 0, 20, "the choices cancelled")
    assert service.worker.kv_usage == 0.0
    text = http("GET", f"{service.url}/metrics")[1]
    assert metric(text, 'eaas_attention_requests_total{result="ok"}') == ok  # never answered
    status, answer = http("POST", f"{service.url}/v1/completions", {"prompt": "next", "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_an_error_in_a_stream_is_an_event_then_done(service: AttentionService, failing_sampler: int) -> None:
    """After the 200 the error can only be an event: OpenAI's error object, then ``[DONE]`` (as
    vLLM), so a client reading to ``[DONE]`` is not left waiting for the connection to close."""
    items = stream(service.url, {"prompt": "doomed", "max_tokens": 4, "seed": failing_sampler})
    assert items[-1] == "[DONE]", items
    error = items[-2]["error"]
    assert error["type"] == "server_error" and "sampling failed" in error["message"], error


def raw_post(url: str, head: bytes, body: bytes) -> tuple[int, Any]:
    """POSTs ``body`` after ``head`` (headers, without the blank line) on a raw socket; the status
    and the JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: eaas\r\nConnection: close\r\n" + head + b"\r\n" + body
        )
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_chunked_request_body_is_read(service: AttentionService) -> None:
    """A client that does not know its body's length beforehand sends it in chunks (as vLLM takes)."""
    body = json.dumps({"prompt": "in chunks", "max_tokens": 3, "temperature": 0}).encode()
    head = b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:7], body[7:]))
    status, answer = raw_post(service.url, head, chunked + b"0\r\n\r\n")
    assert status == 200, answer
    whole = http("POST", f"{service.url}/v1/completions", json.loads(body))[1]
    assert answer["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    for bad_body in (b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n", b"0\r\n\r\n"):
        status, answer = raw_post(service.url, head, bad_body)
        assert status == 400 and answer["error"]["param"] == "body", (bad_body, answer)


def test_stop_strings_end_a_stream(service: AttentionService, reference: Decoder) -> None:
    tokenizer = ByteTokenizer(service.config.vocab_size)
    [full], _ = reference.generate([tokenizer.encode("Hello")], 12)
    text = tokenizer.decode(full)
    stop = text[3:5]
    items = stream(service.url, {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stop": stop})
    streamed = "".join(i["choices"][0]["text"] for i in items[:-1])
    assert streamed == text[: text.find(stop)] and items[-2]["choices"][0]["finish_reason"] == "stop"


def test_static_batching_stays_selectable(
    checkpoint: Path, cluster: LocalCluster, reference: Decoder
) -> None:
    """The baseline of benchmarks/serving.py: whole greedy answers, one generate() per batch."""
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        batching="static",
        placement_poll_s=0.2,
        client=ClientOptions(transport="tcp", request_timeout_s=10.0),
    )
    with AttentionService(
        checkpoint, cluster.placement_path, static_discovery(cluster.urls), options
    ) as static:
        body = {"prompt": [5, 6], "max_tokens": 3, "temperature": 0}
        status, answer = http("POST", f"{static.url}/v1/completions", body)
        assert status == 200 and answer["choices"][0]["token_ids"] == expected(reference, [[5, 6]], [3])[0]
        status, answer = http("POST", f"{static.url}/v1/completions", {**body, "temperature": 0.5})
        assert status == 400 and answer["error"]["param"] == "batching"
        # What the baseline cannot do is refused, never ignored:
        for extra, field in (
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice"),
            ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ):
            status, answer = http("POST", f"{static.url}/v1/completions", {**body, **extra})
            assert status == 400 and answer["error"]["param"] == field, answer


def test_ready_only_once_the_kv_cache_is_made_and_a_forward_went_through(
    checkpoint: Path, cluster: LocalCluster, tmp_path: Path, reference: Decoder
) -> None:
    """A new pod's first requests wait neither for its KV cache's allocation nor for the first
    forward of its process: both happen before it reports ready, and the warm-up leaves the
    serving engine's cache and counters as a request would find them on a fresh engine."""
    options = ServeOptions(
        host="127.0.0.1", port=0, placement_poll_s=0.05, client=ClientOptions(transport="tcp")
    )
    placement_file = tmp_path / "placement.json"  # committed after the start, as by the operator
    with AttentionService(checkpoint, placement_file, static_discovery(cluster.urls), options) as late:
        assert http("GET", f"{late.url}/readyz")[0] == 503 and late.engine is None
        status, health = http("GET", f"{late.url}/health")
        assert status == 503 and "placement" in health["reason"]
        placement_file.write_text(cluster.placement_path.read_text())
        wait_for(lambda: late.readiness()[0], 30, "the placement to be read")
        engine, experts = late.engine, late.experts
        assert engine is not None and experts is not None
        assert experts.counters.requests > 0  # the warm-up went through the expert servers
        assert engine.kv_usage == 0 and engine.allocator.queries == 0 and not engine.has_work()
        status, body = http(
            "POST", f"{late.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0}
        )
        assert status == 200 and body["choices"][0]["token_ids"] == expected(reference, [[5, 6]], [3])[0]
        assert engine.allocator.queries == 2 and late.worker is not None and late.worker.engine is engine
        assert http("GET", f"{late.url}/health")[0] == 200
        late.worker.stop()  # an engine worker that is gone: no endpoint picker should send here
        status, health = http("GET", f"{late.url}/health")
        assert status == 503 and "engine worker is not running" in health["reason"]
        assert http("GET", f"{late.url}/healthz")[0] == http("GET", f"{late.url}/ping")[0] == 503
    discovery = static_discovery(cluster.urls)
    with AttentionService(checkpoint, cluster.placement_path, discovery, options) as early:
        # a placement there at the start: ready as soon as start() returns
        assert early.readiness()[0] and early.engine is not None and early.engine.allocator.queries == 0


def test_readyz_follows_the_expert_servers(
    service: AttentionService, cluster: LocalCluster, reference: Decoder
) -> None:
    """Last in this module: kills a server of the shared cluster (R = 1, so its experts are lost)."""
    before = http("GET", f"{service.url}/metrics")[1]
    assert (
        metric(before, "eaas_attention_failovers_total") == 0
        and metric(before, "eaas_attention_rejoins_total") == 0
    )
    cluster.kill(1)
    status, body = http("POST", f"{service.url}/v1/completions", {"prompt": "lost", "max_tokens": 2})
    assert status == 503 and "expert unavailable" in body["error"]["message"]
    status, ready = http("GET", f"{service.url}/readyz")
    assert status == 503 and ready["down_servers"] == [1] and "no connected expert server" in ready["reason"]
    status, health = http("GET", f"{service.url}/health")
    assert status == 503 and "no connected expert server" in health["reason"]
    cluster.restart(1)
    wait_for(lambda: http("GET", f"{service.url}/readyz")[0] == 200, 20, "the restarted server to rejoin")
    status, body = http(
        "POST", f"{service.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0}
    )
    assert status == 200 and body["choices"][0]["token_ids"] == expected(reference, [[5, 6]], [3])[0]
    text = http("GET", f"{service.url}/metrics")[1]
    assert metric(text, 'eaas_attention_requests_total{result="unavailable"}') >= 1
    assert metric(text, "eaas_attention_failovers_total") == 1  # the dashboard's failover panel reads these
    assert metric(text, "eaas_attention_rejoins_total") == 1


def test_pod_command_serves_from_environment_and_waits_for_the_placement(
    checkpoint: Path, tmp_path: Path, reference: Decoder
) -> None:
    """``eaas attention-client`` as pods run it: settings from EAAS_*, the placement mounted late."""
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1, replication=1)
    with LocalCluster(checkpoint, placement, tmp_path / "cluster", transports=("tcp",)) as cluster:
        placement_file = tmp_path / "placement" / "placement.json"  # not there yet, as before a commit
        ready_file = tmp_path / "ready.json"
        env = {
            **os.environ,
            "EAAS_PORT": "0",
            "EAAS_CHECKPOINT": str(checkpoint),
            "EAAS_PLACEMENT_FILE": str(placement_file),
            "EAAS_TRANSPORT": "tcp",
            "EAAS_MOESERVICE": "tiny",
        }
        command = [
            sys.executable, "-m", "eaas.runtime.cli", "attention-client", "--host", "127.0.0.1",
            "--server", f"0={cluster.urls[0]}", "--ready-file", str(ready_file), "--log-level", "WARNING",
        ]  # fmt: skip
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: ready_file.exists() or process.poll() is not None, 60, "the server to start")
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            url = f"http://127.0.0.1:{json.loads(ready_file.read_text())['port']}"
            assert http("GET", f"{url}/healthz")[0] == 200
            status, ready = http("GET", f"{url}/readyz")
            assert status == 503 and "placement" in ready["reason"]
            status, body = http("POST", f"{url}/v1/completions", {"prompt": "early"})
            assert status == 503 and "not ready" in body["error"]["message"]
            placement_file.parent.mkdir()
            placement_file.write_bytes(stored.pack(placement))  # as the operator's ConfigMap holds it
            wait_for(lambda: http("GET", f"{url}/readyz")[0] == 200, 20, "the placement to be read")
            status, body = http(
                "POST",
                f"{url}/v1/completions",
                {"model": "tiny", "prompt": [9, 10], "max_tokens": 3, "temperature": 0},
            )
            assert status == 200 and body["choices"][0]["token_ids"] == expected(reference, [[9, 10]], [3])[0]
            # SIGTERM: not ready any more, but a request that still arrives (an endpoint not yet
            # updated) is answered; the process exits 0 once nothing has been in flight for a while.
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: http("GET", f"{url}/readyz")[0] == 503, 10, "readiness to turn false")
            assert "leaving" in http("GET", f"{url}/readyz")[1]["reason"]
            status, body = http(
                "POST",
                f"{url}/v1/completions",
                {"model": "tiny", "prompt": [9, 10], "max_tokens": 3, "temperature": 0},
            )
            assert status == 200 and body["choices"][0]["token_ids"] == expected(reference, [[9, 10]], [3])[0]
            assert process.wait(timeout=30) == 0
            output = process.stdout.read().decode() if process.stdout else ""
            assert "left: nothing in flight" in output
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


# --- pure pieces -----------------------------------------------------------------------------------
def test_a_leaving_attention_client_lingers_then_goes_once_nothing_is_in_flight() -> None:
    from eaas.runtime.commands.attention_client import LINGER_S, QUIET_S, Drain

    drain = Drain(timeout_s=25)
    assert not drain.done(0.1, idle=True)  # requests may still come through stale endpoints
    assert not drain.done(LINGER_S, idle=False)  # one in flight: wait for it
    assert not drain.done(LINGER_S + 0.5, idle=True)
    assert drain.done(LINGER_S + 0.5 + QUIET_S, idle=True) and "nothing in flight" in drain.reason
    stuck = Drain(timeout_s=8)
    assert not stuck.done(7.9, idle=False)
    assert stuck.done(8.0, idle=False) and "still in flight" in stuck.reason
    assert Drain(timeout_s=0).done(0.0, idle=True)  # no drain asked for: at once


def test_expert_urls_follow_the_operator_naming() -> None:
    assert expert_urls((0, 2), "m-experts.models.svc", 9100) == {
        0: "http://m-experts-0.m-experts.models.svc:9100",
        2: "http://m-experts-2.m-experts.models.svc:9100",
    }
    with pytest.raises(ValueError, match="expert service"):
        expert_urls((0,), ".models.svc", 9100)


def test_take_batch_admits_oldest_within_limits() -> None:
    from collections import deque

    waiting = deque(Job([1] * 10, 10) for _ in range(5))  # 20 tokens each
    assert len(take_batch(waiting, max_batch_size=3, max_batch_tokens=1000)) == 3
    assert len(take_batch(waiting, max_batch_size=8, max_batch_tokens=30)) == 1  # the next would not fit
    assert len(take_batch(waiting, max_batch_size=8, max_batch_tokens=5)) == 1  # never starves
    assert not waiting


def test_scheduler_fails_only_the_failing_batch_and_refuses_past_the_queue() -> None:
    release = threading.Event()
    calls: list[list[list[int]]] = []

    def generate(prompts: list[list[int]], steps: int) -> list[list[int]]:
        calls.append(prompts)
        release.wait(10)
        if prompts[0] == [0]:
            raise RuntimeError("boom")
        return [[p[0]] * steps for p in prompts]

    scheduler = BatchScheduler(generate, max_batch_size=4, max_queue=2).start()
    try:
        first = Job([0], 1)
        scheduler.submit([first])
        wait_for(lambda: len(calls) == 1, 5, "the first batch")
        later = [Job([1], 2), Job([2], 3)]
        scheduler.submit(later)
        with pytest.raises(QueueFull, match="queue full"):
            scheduler.submit([Job([3], 1)])
        release.set()
        for job in [first, *later]:
            assert job.done.wait(5)
        assert isinstance(first.error, RuntimeError)
        assert [job.tokens for job in later] == [[1, 1], [2, 2, 2]]
        assert calls[1] == [[1], [2]]  # generated together
        assert scheduler.is_running
    finally:
        scheduler.stop()


def test_tokenize_and_detokenize_as_vllm_answers_them(service: AttentionService) -> None:
    status, answer = http("POST", f"{service.url}/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200 and answer["tokens"] == list("héllo".encode()) and answer["count"] == 6
    assert answer["max_model_len"] == service.limits.max_context
    status, chat = http("POST", f"{service.url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and bytes(chat["tokens"]).decode() == "<|user|>\nhi\n<|assistant|>\n"
    status, back = http("POST", f"{service.url}/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        status, error = http("POST", f"{service.url}{path}", body)
        assert status == 400 and error["error"]["param"] == param, (path, body, error)
    status, error = http("POST", f"{service.url}/detokenize", {"model": "other", "tokens": [1]})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, _ = http("GET", f"{service.url}/tokenize")
    assert status == 405


def test_a_burst_of_connections_is_answered_every_one(service: AttentionService) -> None:
    """300 clients connect at once (more than the queue takes): every one gets an HTTP answer
    (200, or 429 at once when the queue is full), none a reset or a wait for SYN retransmits."""
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}).encode()
    barrier = threading.Barrier(300)
    statuses: list[int | str] = []
    lock = threading.Lock()

    def client() -> None:
        host, port = service.url.removeprefix("http://").split(":")
        barrier.wait()
        started = time.monotonic()
        try:
            connection = HTTPConnection(host, int(port), timeout=60)
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            status: int | str = connection.getresponse().status
            connection.close()
        except OSError as exc:
            status = f"{type(exc).__name__}: {exc}"
        if isinstance(status, int) and time.monotonic() - started > 30:
            status = f"{status} after {time.monotonic() - started:.0f} s"
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=client) for _ in range(300)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    counts = collections.Counter(statuses)
    assert set(counts) <= {200, 429} and sum(counts.values()) == 300, counts
    assert counts[200] >= 8  # the queue's worth at least was served
