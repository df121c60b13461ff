"""Scoring a prompt through the OpenAI front, the way lm-evaluation-harness's ``local-completions``
loglikelihood tasks do (``echo`` with ``logprobs``, ``max_tokens`` 0) and vLLM's ``prompt_logprobs``:
the shapes of the answers, streamed and not, against the reference's ``log_softmax``. The tiny
mixtral checkpoint speaks bytes (``ByteTokenizer``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.model import ByteTokenizer, Decoder, load_reference
from eaas.runtime.serving.completions import Completions
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.engine_worker import EngineWorker
from eaas.runtime.serving.http_api import ApiError, CompletionRequest, Limits, parse_completion
from eaas.runtime.serving.metrics import AttentionMetrics
from eaas.runtime.serving.serve import _api_error

PROMPT = "experts as a service"
IDS = list(PROMPT.encode())
LIMITS = Limits(vocab_size=320, max_context=256, max_tokens=64)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, Path]) -> Decoder:
    return load_reference(tiny_checkpoints["mixtral"])


@pytest.fixture(scope="module")
def front(reference: Decoder) -> Iterator[Completions]:
    engine = Engine(reference, EngineOptions(kv_cache_bytes=8 << 20, block_size=4, max_batch_tokens=8))
    worker = EngineWorker(lambda: engine, max_queue=64, on_error=_api_error).start()
    decode = ByteTokenizer(reference.config.vocab_size).decode
    yield Completions(worker, decode, "tiny", 60.0, AttentionMetrics("tiny"), _api_error)
    worker.stop()


def parse(**body: Any) -> CompletionRequest:
    return parse_completion({"prompt": PROMPT, "temperature": 0, **body}, LIMITS, ByteTokenizer(320).encode)


def complete(front: Completions, chat: bool = False, **body: Any) -> dict[str, Any]:
    call = parse(**body)
    requests = front.submit(call)
    collect = front.chat_collect if chat else front.collect
    return collect(call, requests, time.monotonic())


def stream(front: Completions, **body: Any) -> list[dict[str, Any]]:
    call = parse(stream=True, **body)
    return list(front.chunks(call, front.submit(call), time.monotonic()))


def log_softmax(reference: Decoder, ids: list[int]) -> torch.Tensor:
    """[P, V]: the reference's log-softmax at every position of ``ids`` (one forward pass)."""
    tokens = torch.tensor([ids])
    logits = reference.forward(
        tokens, torch.tensor([len(ids)]), reference.new_cache(1, len(ids)), all_logits=True
    )
    return torch.log_softmax(logits[0].to(torch.float32), dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_as_vllm_answers(
    front: Completions, reference: Decoder
) -> None:
    answer = complete(front, echo=True, logprobs=1, max_tokens=0)
    [choice] = answer["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and choice["token_ids"] == []
    assert answer["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": 0, "total_tokens": len(IDS)}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list(PROMPT)
    assert logprobs["text_offset"] == list(range(len(IDS)))  # one character per byte token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    want = log_softmax(reference, IDS)
    for i in range(1, len(IDS)):
        row = want[i - 1]  # the position before token i predicts it
        assert logprobs["token_logprobs"][i] == pytest.approx(float(row[IDS[i]]), abs=1e-4)
        top = logprobs["top_logprobs"][i]
        # the prompt token itself first, then the most likely one (vLLM: logprobs + 1 entries)
        assert next(iter(top)) == PROMPT[i] and top[PROMPT[i]] == logprobs["token_logprobs"][i]
        best = int(row.argmax())
        assert top[ByteTokenizer(320).decode([best])] == pytest.approx(float(row[best]), abs=1e-4)
        assert len(top) == (1 if best == IDS[i] else 2)
    # vLLM's prompt_logprobs beside it: null, then token id -> logprob, rank, decoded_token
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(IDS) and scored[0] is None
    for i in range(1, len(IDS)):
        own = scored[i][IDS[i]]
        assert own["logprob"] == logprobs["token_logprobs"][i] and own["decoded_token"] == PROMPT[i]
        assert own["rank"] == int((want[i - 1] >= want[i - 1][IDS[i]]).sum())
        assert next(iter(scored[i])) == IDS[i] and len(scored[i]) <= 2


def test_echo_with_new_tokens_is_the_prompt_then_the_answer(front: Completions) -> None:
    plain = complete(front, logprobs=2, max_tokens=5)["choices"][0]
    echoed = complete(front, echo=True, logprobs=2, max_tokens=5)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["finish_reason"] == plain["finish_reason"]
    scored = complete(front, echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    got = echoed["logprobs"]
    n = len(IDS)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert got[key] == scored[key] + plain["logprobs"][key], key
    tokens = got["tokens"]
    assert got["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert len(tokens) == n + 5


def test_a_streamed_echo_joins_to_the_whole_answer(front: Completions) -> None:
    """As vLLM streams it: a choice's first chunk is its prompt (with the prompt's logprobs) and its
    first new token; the chunks join to the non-streamed answer."""
    for max_tokens in (0, 4):
        whole = complete(front, echo=True, logprobs=1, max_tokens=max_tokens, n=2)["choices"]
        chunks = stream(front, echo=True, logprobs=1, max_tokens=max_tokens, n=2)
        for choice in whole:
            pieces = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
            assert (
                pieces[0]["text"].startswith(PROMPT) and len(pieces[0]["logprobs"]["tokens"]) > len(IDS) - 1
            )
            assert "".join(p["text"] for p in pieces) == choice["text"]
            assert pieces[-1]["finish_reason"] == choice["finish_reason"]
            joined: dict[str, list[Any]] = {key: [] for key in choice["logprobs"]}
            for piece in pieces:
                for key in joined:
                    joined[key] += piece["logprobs"][key] if piece["logprobs"] else []
            assert joined == choice["logprobs"]
        if max_tokens == 0:
            assert [len(c["choices"]) for c in chunks] == [1, 1]  # one chunk per choice: prompt and end


def test_prompt_logprobs_without_echo_and_in_chat(front: Completions, reference: Decoder) -> None:
    plain = complete(front, max_tokens=3)["choices"][0]
    choice = complete(front, max_tokens=3, prompt_logprobs=2)["choices"][0]
    assert choice["text"] == plain["text"] and choice["logprobs"] is None
    want = log_softmax(reference, IDS)
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(IDS)
    for i in range(1, len(IDS)):
        top = torch.topk(want[i - 1], 2)
        for rank, (token, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            if token != IDS[i]:
                assert scored[i][token]["rank"] == rank
                assert scored[i][token]["logprob"] == pytest.approx(value, abs=1e-4)
    chat = complete(front, chat=True, max_tokens=3, prompt_logprobs=2, n=2)
    assert "prompt_logprobs" not in chat["choices"][0]  # one list for the conversation (as vLLM)
    assert len(chat["prompt_logprobs"]) == len(scored) and chat["prompt_logprobs"][0] is None
    for got, alone in zip(chat["prompt_logprobs"][1:], scored[1:], strict=True):
        assert list(got) == list(alone)  # the same tokens (a batch of two moves the floats a little)
        for token, entry in got.items():
            assert entry == {**alone[token], "logprob": pytest.approx(alone[token]["logprob"], abs=1e-4)}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),  # as vLLM: nothing to answer without echo
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM
    ],
)
def test_bad_scoring_requests_are_400s_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.param == field


def test_what_vllm_allows_is_allowed() -> None:
    assert parse(echo=True, logprobs=1, max_tokens=0, stream=True).params.prompt_logprobs == 1
    assert parse(prompt_logprobs=0, stream=True).params.prompt_logprobs == 0
    assert parse(echo=True, max_tokens=0).params.prompt_logprobs is None  # the prompt back, unscored
