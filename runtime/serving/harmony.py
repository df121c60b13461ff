"""gpt-oss's harmony format: the answer is a series of messages on channels, each opened by a
header and ended by a marker (special tokens of the model's tokenizer, kept in the decoded text):

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the chat template's generation prompt opens the first message with ``<|start|>assistant``, so the
output starts at its channel). ``analysis`` is the reasoning; ``final`` the content, and so is
``commentary`` without a recipient (a preamble the model writes before calling); a message to
``functions.NAME`` is a call whose body is its JSON arguments (one to a built-in tool, such as
``browser.search``, is reasoning: no function of the request). ``<|call|>`` and ``<|return|>``
end the turn (they are the checkpoint's end-of-sequence ids, so generation stops there and
neither reaches the text). An output that does not start with a harmony marker is all content.

``HarmonyReasoning`` splits the thinking from the rest (the reasoning parser); it writes each call
into the content in one form, ``<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>``,
where ``tools.HarmonyFormat`` (the tool-call parser) finds it, as the other formats find theirs. Both are
chosen by the family (``gpt_oss``) or by ``--reasoning-parser harmony --tool-call-parser harmony``.

Grammars: a required or named call is the optional analysis message, then one call (the model's
turn ends at the call, so a turn holds one); structured outputs constrain the ``final`` message,
after the optional analysis.
"""

from __future__ import annotations

import re

from eaas.runtime.serving.grammar import Constraint, Markers, answer_after
from eaas.runtime.serving.text_stream import partial_suffix

START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CALL_OPEN = CHANNEL + "commentary to="  # the call's form in the content: CALL_OPEN NAME MESSAGE ARGS CALL
FUNCTIONS = "functions."


class HarmonyReader:
    """The messages of an output, pushed piece by piece: ``push`` returns the (reasoning,
    content) it can release, holding back a marker split over pieces."""

    def __init__(self) -> None:
        self.pending = ""
        self.state = "start"  # start | header | body | plain (not harmony: all content)
        self.header = ""
        self.kind = ""  # of the body: reasoning | content | call

    def push(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        keep = max(partial_suffix(self.pending, m) for m in MARKERS)
        ready, self.pending = (
            self.pending[: len(self.pending) - keep],
            self.pending[len(self.pending) - keep :],
        )
        return self._read(ready)

    def finish(self) -> tuple[str, str]:
        """What is left once the output ended (a call cut off by its end is closed)."""
        rest, self.pending = self.pending, ""
        reasoning, content = self._read(rest)
        if self.state == "body" and self.kind == "call":
            content += CALL
        self.state = "header"
        return reasoning, content

    def _read(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for part in _SPLIT.split(text):
            if not part:
                continue
            if self.state == "start":
                if not part.strip():
                    continue  # whitespace before the first marker
                self.state = "header" if part in MARKERS else "plain"
            if self.state == "plain":
                content.append(part)
            elif self.state == "header":
                if part == MESSAGE:
                    self.state, self.kind = "body", self._open(content)
                elif part in (START, END, CALL, RETURN):
                    self.header = ""  # a new message (or a header that never opened one)
                else:
                    self.header += part
            elif part in (END, CALL, RETURN, START, CHANNEL):  # the body ends
                if self.kind == "call":
                    content.append(CALL)
                self.state, self.header = "header", CHANNEL if part == CHANNEL else ""
            elif part in MARKERS:
                continue  # a marker that has no place in a body (a confused model): dropped
            else:
                (reasoning if self.kind == "reasoning" else content).append(part)
        return "".join(reasoning), "".join(content)

    def _open(self, content: list[str]) -> str:
        """The kind of the body the header opens (a call's head goes into the content)."""
        channel = _CHANNEL.search(self.header)
        recipient = _RECIPIENT.search(self.header)
        self.header = ""
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            content.append(f"{CALL_OPEN}{recipient.group(1)}{MESSAGE}")
            return "call"
        # a message to a built-in tool (browser.search, python) is the model's own work: reasoning
        if recipient is not None or (channel is not None and channel.group(1) == "analysis"):
            return "reasoning"
        return "content"


class HarmonyReasoning:
    """The reasoning parser of gpt-oss (``ReasoningStyle``'s interface)."""

    name = "harmony"
    markers = MARKERS

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        reader = HarmonyReader()
        reasoning, content = reader.push(text)
        more_reasoning, more_content = reader.finish()
        return (reasoning + more_reasoning).strip(), (content + more_content).strip()

    def stream(self) -> HarmonyReader:
        return HarmonyReader()

    def answer_grammar(self, constraint: Constraint, markers: Markers) -> Constraint:
        """`constraint` for the ``final`` message, after an optional analysis. A required or named
        call's grammar (``tools``) is returned as it is: it holds the analysis itself, and a call
        is a ``commentary`` message, not the ``final`` one."""
        if constraint.field == "tools":
            return constraint
        final = f'{markers(CHANNEL)} "final" {markers(MESSAGE)}'
        lark = f"start: analysis? {final} @answer\n{analysis_rules(markers)}"
        return answer_after(constraint, lark)


def analysis_rules(markers: Markers) -> str:
    """Lark rules of the analysis message and the header of the message after it (``analysis``).
    Where the markers are text (a tokenizer without them as special tokens), the message is one
    lexeme whose thinking cannot contain ``<|``, so that no marker's text can be taken for it."""
    if markers.token(END) is None:
        head = re.escape(f"{CHANNEL}analysis{MESSAGE}")
        tail = re.escape(f"{END}{START}assistant")
        return f"analysis: ANALYSIS\nANALYSIS: /{head}(?:[^<]|<+[^<|])*<*{tail}/\n"
    return (
        f'analysis: {markers(CHANNEL)} "analysis" {markers(MESSAGE)} TEXT? {markers(END)} '
        f'{markers(START)} "assistant"\nTEXT: /(?s:.+)/\n'
    )
