"""A byte-level tokenizer: token id = byte value (ids >= 256 decode to nothing)."""

from __future__ import annotations


class ByteTokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size: the byte tokenizer needs >= 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
