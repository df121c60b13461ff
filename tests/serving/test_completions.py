"""The OpenAI answers of the continuous-batching front (``Completions``) over a real engine and its
worker thread: usage, log-probabilities and their offsets, stop strings, and a step whose sampling
fails. The tiny mixtral checkpoint has no tokenizer, so it speaks bytes (``ByteTokenizer``): ids
>= 256 decode to nothing and the bytes of multi-byte characters to U+FFFD, which is what makes
different ids decode alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eaas.runtime.httpd import ClientGone
from eaas.runtime.model import ByteTokenizer, HFTokenizer, load_reference
from eaas.runtime.serving import completions as completions_module
from eaas.runtime.serving.completions import Completions
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.engine_worker import EngineWorker, Request
from eaas.runtime.serving.http_api import ApiError, CompletionRequest, Limits, parse_completion
from eaas.runtime.serving.metrics import AttentionMetrics
from eaas.runtime.serving.serve import _api_error
from eaas.runtime.serving.text_stream import token_bytes

PROMPT = "experts as a service"


@pytest.fixture(scope="module")
def front(tiny_checkpoints: dict[str, Path]) -> Iterator[Completions]:
    decoder = load_reference(tiny_checkpoints["mixtral"])
    engine = Engine(decoder, EngineOptions(kv_cache_bytes=8 << 20, block_size=4))
    worker = EngineWorker(lambda: engine, max_queue=64, on_error=_api_error).start()
    tokenizer = ByteTokenizer(decoder.config.vocab_size)
    yield Completions(
        worker,
        tokenizer.decode,
        "tiny",
        60.0,
        AttentionMetrics("tiny"),
        _api_error,
        token_bytes=token_bytes(tokenizer),
    )
    worker.stop()


def parse(front: Completions, **body: Any) -> CompletionRequest:
    limits = Limits(vocab_size=320, max_context=256, max_tokens=64)
    return parse_completion({"prompt": PROMPT, "temperature": 0, **body}, limits, ByteTokenizer(320).encode)


def complete(front: Completions, chat: bool = False, **body: Any) -> dict[str, Any]:
    call = parse(front, **body)
    requests = front.submit(call)
    return (
        front.chat_collect(call, requests, time.monotonic())
        if chat
        else front.collect(call, requests, time.monotonic())
    )


def stream(front: Completions, chat: bool = False, **body: Any) -> list[dict[str, Any]]:
    call = parse(front, stream=True, stream_options={"include_usage": True}, **body)
    requests = front.submit(call)
    return list((front.chat_chunks if chat else front.chunks)(call, requests, time.monotonic()))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_prompt_counts_once_however_many_choices(front: Completions, chat: bool) -> None:
    prompt_tokens = len(PROMPT.encode())

    def counted() -> float | None:
        return front.metrics.registry.get_sample_value("eaas_attention_prompt_tokens_total")

    before = counted() or 0.0
    answer = complete(front, chat, n=3, max_tokens=4)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12}
    assert answer["usage"] == usage
    last = stream(front, chat, n=3, max_tokens=4)[-1]
    assert last["usage"] == usage
    assert counted() == before + 2 * prompt_tokens
    two_prompts = complete(front, prompt=[PROMPT, "hi"], n=2, max_tokens=2)
    assert two_prompts["usage"]["prompt_tokens"] == prompt_tokens + 2


def test_text_offsets_are_the_running_sums_of_the_token_texts(front: Completions) -> None:
    plain = complete(front, logprobs=0, max_tokens=24)["choices"][0]
    # The stop is never completed, but its first character holds text back at every occurrence.
    first = plain["text"][:1] or "x"
    held = complete(front, logprobs=0, max_tokens=24, stop=[first + "\x00never"])["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    assert len(tokens) == 24 and held["text"] == plain["text"]
    assert plain["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert held["logprobs"] == plain["logprobs"]


def test_chat_top_logprobs_has_one_entry_per_token_id(front: Completions) -> None:
    answer = complete(front, chat=True, logprobs=20, max_tokens=6)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry, token in zip(content, answer["choices"][0]["token_ids"], strict=True):
        assert len(entry["top_logprobs"]) == 20
        assert entry["bytes"] == ([token] if token < 256 else [])  # the byte itself, even of a part of "é"
        top = entry["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert {t["token"] for t in top if t["bytes"] and t["bytes"][0] >= 0x80} <= {"\ufffd"}
    assert any(len({t["token"] for t in e["top_logprobs"]}) < 20 for e in content)  # texts do collide
    streamed = [c for chunk in stream(front, chat=True, logprobs=20, max_tokens=6) for c in chunk["choices"]]
    assert [e for c in streamed if c["logprobs"] for e in c["logprobs"]["content"]] == content


def test_completions_top_logprobs_keep_the_likeliest_of_tokens_that_read_alike(front: Completions) -> None:
    content = complete(front, chat=True, logprobs=20, max_tokens=6)["choices"][0]["logprobs"]["content"]
    tops = complete(front, logprobs=20, max_tokens=6)["choices"][0]["logprobs"]["top_logprobs"]
    for entry, top in zip(content, tops, strict=True):
        likeliest: dict[str, float] = {}
        for alternative in entry["top_logprobs"]:
            likeliest.setdefault(alternative["token"], alternative["logprob"])
        assert top == likeliest


def test_a_stop_string_ends_the_counted_and_returned_tokens(
    front: Completions, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_cancel = front.worker.cancel

    def late_cancel(request: Request) -> None:  # the worker steps on before it sees the cancellation
        deadline = time.monotonic() + 10
        while len(request.tokens) < 30 and not request.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        real_cancel(request)

    monkeypatch.setattr(front.worker, "cancel", late_cancel)
    plain = complete(front, max_tokens=40)["choices"][0]
    ids = plain["token_ids"]
    decode = ByteTokenizer(320).decode

    def new_characters(i: int) -> set[str]:  # what token i - 1 adds to the text (U+FFFD: not final yet)
        return set(decode(ids[:i])) - set(decode(ids[: i - 1])) - {"\ufffd"}

    # a stop string that a later token completes: a character that token brings first
    end = next(i for i in range(3, len(ids)) if new_characters(i))
    stop = min(new_characters(end))
    answer = complete(front, max_tokens=40, n=2, stop=[stop])
    for choice in answer["choices"]:
        assert choice["token_ids"] == ids[:end] and choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 2 * end


def test_a_failed_sampling_step_is_a_server_error_and_the_engine_goes_on(
    front: Completions, failing_sampler: int
) -> None:
    expected = complete(front, max_tokens=30)["choices"][0]["token_ids"]
    good_call, bad_call = parse(front, max_tokens=30), parse(front, max_tokens=30, seed=failing_sampler)
    good, bad = front.submit(good_call), front.submit(bad_call)
    with pytest.raises(ApiError) as failed:
        front.collect(bad_call, bad, time.monotonic())
    assert failed.value.status == 500 and failed.value.kind == "server_error"
    assert "sampling failed" in failed.value.message
    try:  # sampled in the same step as the bad one, or not: either way an answer, no 400
        assert front.collect(good_call, good, time.monotonic())["choices"][0]["token_ids"] == expected
    except ApiError as exc:
        assert exc.status == 500, exc.message
    assert complete(front, max_tokens=30)["choices"][0]["token_ids"] == expected
    assert front.worker.kv_usage == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": 10**23}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"n": 10**20}, "n"),
        ({"max_tokens": 10**20}, "max_tokens"),
        ({"logprobs": 10**20}, "logprobs"),
        ({"stop_token_ids": [10**20]}, "stop_token_ids"),
    ],
)
def test_integers_the_engine_cannot_hold_are_400s_naming_the_field(
    front: Completions, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as refused:
        parse(front, **body)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_top_k_beyond_the_vocabulary_means_every_token(front: Completions) -> None:
    assert parse(front, top_k=10**9).params.top_k == 10**9  # accepted (as vLLM), the sampler clamps it
    seeded: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 8}
    everything = complete(front, **seeded)["choices"][0]["token_ids"]
    assert complete(front, top_k=2**63 - 1, **seeded)["choices"][0]["token_ids"] == everything


def test_the_bytes_of_byte_level_bpe_tokens_join_into_the_text(tmp_path: Path, train_tokenizer: Any) -> None:
    train_tokenizer(["héllo wörld — ünïcode tokens"] * 20).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path, 320)
    text = "wörld — tokens 日本 ünïcode"  # 日本: not in the corpus, so a token per byte
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # pieces of a character: no text of their own
    of = token_bytes(tokenizer)
    assert b"".join(of(i) or b"?" for i in ids) == text.encode()
    assert of(tokenizer.marker_id("</s>") or 0) is None  # an added token is its text, not byte-level


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_answer_whose_client_went_away_stops_and_frees_its_sequences(
    front: Completions, chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client of a non-streaming answer that hangs up is found between tokens (``gone``, every
    ``GONE_CHECK_S``; here at every event): its choices are cancelled, not generated to the end for
    nobody, as vLLM aborts them."""
    monkeypatch.setattr(completions_module, "GONE_CHECK_S", 0.0)
    looks: list[bool] = []

    def gone() -> bool:
        looks.append(len(looks) >= 3)  # away after a few tokens
        return looks[-1]

    call = parse(front, max_tokens=64, n=2, ignore_eos=True)
    requests = front.submit(call)
    with pytest.raises(ClientGone):
        (front.chat_collect if chat else front.collect)(call, requests, time.monotonic(), gone=gone)
    deadline = time.monotonic() + 20
    while front.worker.running or front.worker.kv_usage:
        assert time.monotonic() < deadline, "the cancelled choices still run"
        time.sleep(0.01)
    assert all(len(request.tokens) < 64 for request in requests)  # stopped, not run to the end


def streamed_with(
    front: Completions, chat: bool, options: dict[str, Any], **body: Any
) -> list[dict[str, Any]]:
    call = parse(front, stream=True, stream_options=options, **body)
    requests = front.submit(call)
    return list((front.chat_chunks if chat else front.chunks)(call, requests, time.monotonic()))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(front: Completions, chat: bool) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (GuideLLM sends it): every chunk carries the
    usage of its choice so far; the last chunk, the request's usage, as with ``include_usage``."""
    prompt_tokens = len(PROMPT.encode())
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = streamed_with(front, chat, options, n=2, max_tokens=5)
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for chunk in per_choice:
        [choice] = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        so_far[choice["index"]].append(usage["completion_tokens"])
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 5
    # without include_usage (explicitly false) there is no usage at all; left out, it is implied
    assert all("usage" not in c for c in streamed_with(front, chat, {"include_usage": False, **{
        "continuous_usage_stats": True}}, max_tokens=3))  # fmt: skip
    assert all(
        "usage" in c for c in streamed_with(front, chat, {"continuous_usage_stats": True}, max_tokens=3)
    )
    assert all(
        "usage" not in c for c in streamed_with(front, chat, {"include_usage": True}, max_tokens=3)[:-1]
    )


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(front: Completions) -> None:
    """vLLM's ``min_tokens``: neither a stop token nor a stop string ends a choice before it has
    that many tokens; greedy, the tokens up to there are those of the answer without stops."""
    plain = complete(front, max_tokens=30)["choices"][0]["token_ids"]
    stop_id = plain[2]
    assert len(complete(front, max_tokens=30, stop_token_ids=[stop_id])["choices"][0]["token_ids"]) <= 3
    held = complete(front, max_tokens=30, stop_token_ids=[stop_id], min_tokens=12)["choices"][0]
    assert len(held["token_ids"]) >= 12 and stop_id not in held["token_ids"][:12]
    text = complete(front, max_tokens=30)["choices"][0]["text"]
    stop = text[1:3]  # a stop string that the first tokens already complete
    assert len(complete(front, max_tokens=30, stop=[stop])["choices"][0]["token_ids"]) < 12
    late = complete(front, max_tokens=30, stop=[stop], min_tokens=12)["choices"][0]
    assert late["token_ids"][:12] == plain[:12]


def test_include_stop_str_in_output_keeps_the_stop_string(front: Completions) -> None:
    text = complete(front, max_tokens=30)["choices"][0]["text"]
    stop = text[4:6]
    without = complete(front, max_tokens=30, stop=[stop])["choices"][0]
    kept = complete(front, max_tokens=30, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert without["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == without["text"] + stop and kept["token_ids"] == without["token_ids"]
    streamed = stream(front, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == kept["text"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"priority": "high"}, "priority"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),  # without stream
        ({"repetition_penalty": 1.2}, "repetition_penalty"),  # not implemented: refused, not ignored
    ],
)
def test_vllm_extensions_with_bad_values_are_400s_naming_the_field(
    front: Completions, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as refused:
        parse(front, **body)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_vllm_extensions_are_accepted() -> None:
    call = parse_completion(
        {
            "prompt": "x", "max_tokens": 8, "min_tokens": 8, "ignore_eos": True, "priority": -3,
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        Limits(vocab_size=320, max_context=256, max_tokens=64),
        ByteTokenizer(320).encode,
    )  # fmt: skip
    assert call.params.min_tokens == 8 and call.include_stop and not call.skip_special_tokens
    assert call.include_usage and call.continuous_usage


def test_special_tokens_decode_to_their_text_when_not_skipped(tmp_path: Path, train_tokenizer: Any) -> None:
    train_tokenizer(["hello world"] * 20).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path, 320)
    ids = [*tokenizer.encode("hello"), tokenizer.marker_id("</s>") or 0]
    assert tokenizer.decode(ids) == "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hello</s>"
