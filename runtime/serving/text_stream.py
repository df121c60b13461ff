"""``TextStream``: the text of a growing token sequence, released only when it is final.

Two things can still change the end of the decoded text: a multi-byte character whose bytes have
not all arrived (it decodes to U+FFFD for now), and the start of a stop string that later tokens
may complete. Both are held back until they resolve; a completed stop string cuts the text
before it. Streaming and non-streaming answers are built from the same deltas.

Decoding is incremental, so a long answer costs O(length), not O(length²): each token decodes
only a short window, ``tokens[prefix:]``, against the window's already-final part
``tokens[prefix:read]``; the difference is the new text. The window starts one step back, so
decoders that treat a sequence's first token specially (a SentencePiece leading space) decode
the new tokens in context. A window whose text ends in U+FFFD waits for more tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eaas.runtime.model.tokenizer import byte_level_chars

REPLACEMENT = "\ufffd"


class TextStream:
    """``min_tokens``: stop strings count only once more tokens than this have come (vLLM's
    ``min_tokens``; the text before is released as it is). ``include_stop``: a stop string that
    ends the text stays in it (vLLM's ``include_stop_str_in_output``)."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: list[str],
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.decode = decode
        self.stops = stops
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of tokens[:read], every character complete
        self.prefix = 0  # the decoding window starts here
        self.read = 0  # tokens before this are in ``text``
        self.emitted = 0  # characters of ``text`` released so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Adds a token; returns the newly final text (sets ``stopped`` on a stop string)."""
        self.tokens.append(token)
        self._advance(final=False)
        return self._release()

    def flush(self) -> str:
        """At the end: whatever was held back, an incomplete character included (as U+FFFD)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        released = self._release()
        if self.stopped:
            return released
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return released + delta

    def _advance(self, *, final: bool) -> None:
        """Moves complete characters of the window into ``text``."""
        before = self.decode(self.tokens[self.prefix : self.read])
        window = self.decode(self.tokens[self.prefix :])
        if not window.startswith(before):  # a decoder that is not prefix-stable: decode it all
            window, before = self.decode(self.tokens), ""
            self.text = ""
        if not final and (len(window) <= len(before) or window.endswith(REPLACEMENT)):
            return  # nothing new yet, or a character still incomplete
        self.text += window[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)

    def _release(self) -> str:
        """Text up to a completed stop string (then ``stopped``), or up to what may still change."""
        start = self.emitted  # released text holds no stop's beginning, so a match starts here or later
        if len(self.tokens) <= self.min_tokens:  # too early for a stop string: all of it is final
            delta, self.emitted = self.text[start:], len(self.text)
            return delta
        found = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            cut, minus_length = min(found)  # the first stop string (the longest one there)
            end = cut - minus_length if self.include_stop else cut
        else:
            end = len(self.text) - self._held()
        delta = self.text[start:end]
        self.emitted = max(start, end)
        return delta

    def _held(self) -> int:
        """Characters at the end of ``text`` that a stop string may still claim."""
        return max((partial_suffix(self.text, stop, self.emitted) for stop in self.stops), default=0)


def partial_suffix(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper beginning of ``marker``: what
    a stream holds back because a stop string or a marker may be starting there."""
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def token_bytes(tokenizer: Any) -> Callable[[int], bytes | None]:
    """token id -> the token's own bytes, where ``tokenizer`` keeps them: the byte tokenizer's ids
    below 256, and the tokens of a byte-level BPE (GPT-2's byte-to-character table, reversed; its
    added tokens are plain text). None elsewhere: callers fall back to the UTF-8 of the token's text.
    Decoding cannot give them: a token holding part of a multi-byte character decodes to U+FFFD."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # the byte tokenizer: id = byte value, ids >= 256 decode to nothing
        return lambda token: bytes([token]) if 0 <= token < 256 else None
    from tokenizers import decoders

    if not isinstance(backend.decoder, decoders.ByteLevel):
        return lambda token: None
    byte_of = {char: byte for byte, char in byte_level_chars().items()}
    added = set(backend.get_added_tokens_decoder())

    def lookup(token: int) -> bytes | None:
        piece = backend.id_to_token(token)
        if piece is None or token in added or any(c not in byte_of for c in piece):
            return None
        return bytes(byte_of[c] for c in piece)

    return lookup
