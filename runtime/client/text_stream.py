"""``TextStream``: the text of a growing token sequence, released only when it is final.

Two things can still change the end of the decoded text: a multi-byte character whose bytes have
not all arrived (it decodes to U+FFFD for now), and the start of a stop string that later tokens
may complete. Both are held back until they resolve; a completed stop string cuts the text
before it. Streaming and non-streaming answers are built from the same deltas.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode = decode
        self.stops = stops
        self.tokens: list[int] = []
        self.emitted = ""  # text released so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Adds a token; returns the newly final text (sets ``stopped`` on a stop string)."""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        return self._release(text[: len(text) - self._held(text)])

    def flush(self) -> str:
        """At the end: whatever was held back (nothing after a stop)."""
        if self.stopped:
            return ""
        return self._release(self.decode(self.tokens))

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    held = max(held, length)
                    break
        return held

    def _release(self, final: str) -> str:
        if not final.startswith(self.emitted):  # cannot happen for prefix-stable decoders
            return ""
        delta, self.emitted = final[len(self.emitted) :], final
        return delta
