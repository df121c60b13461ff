"""``TextStream`` against the whole-sequence decode it replaces: the released deltas joined equal
the decoded text cut at the first stop string; no delta ends in half a character; decoding work
per token stays bounded (incremental, not the whole sequence each time)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaas.runtime.model.tokenizer import ByteTokenizer
from eaas.runtime.serving.text_stream import REPLACEMENT, TextStream

BYTES = ByteTokenizer(512)


def expected(decode: Callable[[list[int]], str], tokens: list[int], stops: list[str]) -> str:
    """The whole decode after the first token that completes a stop, cut at that stop's start
    (generation ends at that token; a longer stop that began earlier has not completed yet).
    A stop that only a replacement character completes is found at the end at the latest."""
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
    return decode(tokens)


def stream(decode: Callable[[list[int]], str], tokens: list[int], stops: list[str]) -> tuple[list[str], bool]:
    text = TextStream(decode, stops)
    deltas = []
    for token in tokens:
        deltas.append(text.push(token))
        if text.stopped:
            return deltas, True
    deltas.append(text.flush())
    return deltas, text.stopped


texts = st.text(alphabet=st.sampled_from(list("ab cé€😀\n")), max_size=30)


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.text(alphabet=st.sampled_from(list("ab é😀")), min_size=1, max_size=3), max_size=2))
def test_byte_tokens_stream_to_the_whole_decode(text: str, stops: list[str]) -> None:
    tokens = BYTES.encode(text)
    deltas, stopped = stream(BYTES.decode, tokens, stops)
    assert "".join(deltas) == expected(BYTES.decode, tokens, stops)
    assert stopped == any(s in text for s in stops)
    assert not any(d.endswith(REPLACEMENT) for d in deltas), "half a character was released"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=20))
def test_invalid_utf8_is_released_at_the_end_as_replacement_characters(data: bytes) -> None:
    tokens = list(data)
    deltas, _ = stream(BYTES.decode, tokens, [])
    assert "".join(deltas) == BYTES.decode(tokens)


def trained(kind: str) -> Callable[[list[int]], str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "byte_level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style: spaces become "▁", and the decoder drops a leading one
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        alphabet = list("▁abcdeéhlkmnorstuvwx€")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(["experts as a service", "hello world é €", "serve tokens"] * 20, trainer)
    return lambda ids: str(tokenizer.decode(ids))


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_bpe_tokens_stream_to_the_whole_decode(kind: str) -> None:
    decode = trained(kind)
    for ids in ([5, 17, 40, 3, 99, 120, 7, 150], list(range(1, 60)), [60, 61, 62] * 5):
        for stops in ([], ["s"], ["ex", "zz"], ["world"]):
            deltas, _ = stream(decode, ids, stops)
            assert "".join(deltas) == expected(decode, ids, stops), (ids, stops)


def test_each_token_decodes_a_short_window() -> None:
    lengths: list[int] = []

    def decode(ids: list[int]) -> str:
        lengths.append(len(ids))
        return BYTES.decode(ids)

    text = TextStream(decode, ["never"])
    for token in BYTES.encode("mixture of experts, served € by the token " * 50):
        text.push(token)
    assert max(lengths) <= 4, f"decoded windows of up to {max(lengths)} tokens: not incremental"


@settings(max_examples=200, deadline=None)
@given(texts, st.lists(st.text(alphabet=st.sampled_from(list("ab é😀")), min_size=1, max_size=3), max_size=2))
def test_include_stop_keeps_the_stop_string_that_ended_the_text(text: str, stops: list[str]) -> None:
    """vLLM's ``include_stop_str_in_output``: the text up to the end of the stop string that ended it."""
    tokens = BYTES.encode(text)
    stream = TextStream(BYTES.decode, stops, include_stop=True)
    deltas = []
    for token in tokens:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    kept = "".join(deltas)
    without = expected(BYTES.decode, tokens, stops)
    if stream.stopped:
        assert any(kept == without + s for s in stops) and kept.endswith(tuple(stops))
    else:
        assert kept == without


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("ab c")), max_size=30),
    st.lists(st.text(alphabet=st.sampled_from(list("ab ")), min_size=1, max_size=3), max_size=2),
    st.integers(0, 12),
)
def test_stop_strings_count_only_after_min_tokens(text: str, stops: list[str], min_tokens: int) -> None:
    """vLLM's ``min_tokens``: no stop string ends the text before that many tokens; after them, the
    first stop that the text from there holds ends it."""
    tokens = BYTES.encode(text)  # one character per token
    stream = TextStream(BYTES.decode, stops, min_tokens=min_tokens)
    deltas = []
    for token in tokens:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    want = text
    for n in range(min_tokens + 1, len(text) + 1):
        cut = min((i for i in (text[:n].find(s, min_tokens) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            want = text[:cut]
            break
    assert "".join(deltas) == want
