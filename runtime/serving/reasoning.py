"""Reasoning models: the thinking a model writes between ``<think>`` and ``</think>`` goes to
``reasoning_content`` (and vLLM's newer name for it, ``reasoning``), the rest to ``content``.

Three styles, chosen by the checkpoint's family or ``--reasoning-parser``:

- ``deepseek_r1``: the chat template opens the thinking itself (its generation prompt ends with
  ``<think>``), so the output starts inside it. Everything up to ``</think>`` is reasoning. An
  output cut off before ``</think>`` is all reasoning.
- ``qwen3`` (Qwen3, GLM-4.5): the model opens the thinking itself. An output that does not start
  with ``<think>`` (thinking switched off) is all content.
- ``harmony`` (gpt-oss): the ``analysis`` channel is the reasoning (``harmony.py``).

Tool calls are read from the content only, never from the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaas.runtime.serving.grammar import Constraint, Markers, after_thinking
from eaas.runtime.serving.harmony import HarmonyReasoning
from eaas.runtime.serving.text_stream import partial_suffix

START = "<think>"
END = "</think>"
PARSER_BY_FAMILY = {"qwen3_moe": "qwen3", "glm4_moe": "qwen3", "gpt_oss": "harmony"}


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    starts_inside: bool  # the output begins inside the thinking (the template opened it)
    markers = (START, END)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START) :]
        elif not self.starts_inside:
            return "", text
        end = body.find(END)
        if end < 0:
            return body.strip(), ""
        return body[:end].strip(), body[end + len(END) :].lstrip()

    def stream(self) -> StreamedReasoning:
        return StreamedReasoning(self)

    def answer_grammar(self, constraint: Constraint, markers: Markers) -> Constraint:
        """`constraint` for the answer after the thinking."""
        return after_thinking(constraint, self.starts_inside, markers)


Style = ReasoningStyle | HarmonyReasoning
STYLES: dict[str, Style] = {
    "deepseek_r1": ReasoningStyle("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningStyle("qwen3", starts_inside=False),
    "harmony": HarmonyReasoning(),
}


def reasoning_style(parser: str | None, family: str) -> Style | None:
    """The style ``--reasoning-parser`` names (``auto``/None: by the checkpoint's family; ``none``:
    no reasoning parsing)."""
    if parser in (None, "", "auto"):
        name = PARSER_BY_FAMILY.get(family)
        return STYLES[name] if name else None
    if parser == "none":
        return None
    if parser not in STYLES:
        raise ValueError(
            f"reasoning-parser: must be auto, none or one of {', '.join(STYLES)}, got {parser!r}"
        )
    return STYLES[parser]


class StreamedReasoning:
    """Streaming: each piece of text is split into (reasoning, content) deltas as it comes; a
    marker split over pieces is held back until it is whole."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self.pending = ""  # text not yet sent (a marker may be starting in it)
        self.state = "start"  # start (an opening marker may come) | inside | after
        self.trim = False  # drop the whitespace between the closing marker and the answer

    def push(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        reasoning = content = ""
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if not stripped:
                    return reasoning, content  # only whitespace so far
                if stripped.startswith(START):
                    self.pending, self.state = stripped[len(START) :].lstrip(), "inside"
                    continue
                if START.startswith(stripped):
                    return reasoning, content  # may still become the start marker
                # no opening marker: inside if the template opened the thinking, else no thinking
                self.state = "inside" if self.style.starts_inside else "after"
                continue
            if self.state == "inside":
                end = self.pending.find(END)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending, self.state, self.trim = self.pending[end + len(END) :], "after", True
                    continue
                keep = partial_suffix(self.pending, END)
                reasoning += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return reasoning, content
            if self.trim:
                self.pending = self.pending.lstrip()
                self.trim = not self.pending
                continue
            content += self.pending
            self.pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left once the choice ended."""
        rest, self.pending = self.pending, ""
        if self.state == "inside" or (self.state == "start" and self.style.starts_inside):
            return rest, ""
        return "", rest
