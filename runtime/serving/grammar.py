"""Structured outputs: grammars that constrain what a sequence may generate (llguidance).

A request asks for a ``Constraint`` (``parse_constraint``: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields): JSON (any object, or one schema), a
regular expression, one of a list of strings, or a grammar (Lark, as llguidance takes it, or
GBNF, converted). ``Grammars`` compiles it for the served tokenizer, off the engine thread and
cached by grammar text; each sequence gets its own copy of the compiled matcher. The engine asks
``allowed_tokens`` for the rows that have one (a bitmask per row, filled for the whole batch at
once by llguidance's thread pool, without the GIL), masks those rows' scores before sampling, and
feeds the sampled token back. A sequence ends with ``stop`` once its grammar can take nothing
more (or the model picks end-of-sequence where the grammar may end). The matcher follows the
generated tokens only, so a preempted sequence, recomputed from its tokens, keeps its state.

Why llguidance: a maintained engine (vLLM's and SGLang's ``guidance`` backend) with no runtime
dependencies, one ABI3 wheel, JSON Schema, regex, Lark and GBNF behind one API, and masks
computed lazily at each step, for a whole batch in parallel (~50 µs of CPU per token at a 128k
vocabulary by its authors' figure), so a new schema costs little before its first token.
xgrammar, the other strong choice, compiles each grammar against the vocabulary ahead of time
(fast masks afterwards, a cost per new schema first); outlines-core builds an index over the
vocabulary per schema up front.

The byte tokenizer (random checkpoints) has no end-of-sequence token; for grammars it uses id 256
(``BYTE_EOS``, the first id past the bytes, which decodes to nothing) when the vocabulary has one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eaas.runtime.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BYTE_EOS = 256
MAX_CHOICES = 256
CACHE_SIZE = 256  # compiled grammars kept
# Characters Rust's regex syntax (llguidance's) treats as meta; choices are matched literally.
REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# vLLM's structured_outputs keys: one of these says what to match ...
SOURCES = ("json", "regex", "choice", "grammar", "json_object")
# ... and these tune JSON's whitespace.
JSON_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
BACKENDS = ("auto", "guidance", "llguidance")
# JSON's whitespace between two tokens, unless the request says otherwise: nothing, one space, or
# a line break and up to 32 columns of indentation. Bounded, so that a model (a small or a random
# one) cannot fill its whole budget with whitespace inside a valid document, which an unbounded
# pattern allows; pretty-printed JSON up to 16 levels deep (2-space indents) still fits.
JSON_WHITESPACE = r"( |\r?\n[ \t]{0,32})?"
LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class GrammarError(ValueError):
    """A constraint the request spelled wrong or the engine cannot take; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Constraint:
    field: str  # the request field that asked for it (errors name it)
    grammar: str  # llguidance's grammar text


def load_llguidance() -> Any:
    """The llguidance module, imported on first use (a server that never sees a grammar never loads it)."""
    import llguidance

    return llguidance


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The constraint a completion or chat body asks for, or None. At most one source may be
    given; a malformed one raises ``GrammarError`` naming its field."""
    found: list[tuple[str, dict[str, Any]]] = []  # (field, {source: value, options...})
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise GrammarError("structured_outputs", "must be an object")
        unknown = sorted(set(outputs) - {*SOURCES, *JSON_OPTIONS})
        if unknown:
            raise GrammarError(
                f"structured_outputs.{unknown[0]}",
                f"is not supported (supported: {', '.join((*SOURCES, *JSON_OPTIONS))})",
            )
        given = [k for k in SOURCES if outputs.get(k) not in (None, False)]
        if len(given) != 1:
            raise GrammarError("structured_outputs", f"give exactly one of {', '.join(SOURCES)}")
        if given == ["json_object"] and outputs["json_object"] is not True:
            raise GrammarError("structured_outputs.json_object", "must be true")
        found.append((f"structured_outputs.{given[0]}", dict(outputs)))
    for name, source in LEGACY.items():
        if body.get(name) is not None:
            spec = {source: body[name]}
            if body.get("guided_whitespace_pattern") is not None:
                spec["whitespace_pattern"] = body["guided_whitespace_pattern"]
            found.append((name, spec))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise GrammarError("guided_decoding_backend", f"this server has llguidance only, got {backend!r}")
    if not found:
        return None
    if len(found) > 1:
        raise GrammarError(found[1][0], f"only one constraint per request (already {found[0][0]})")
    field, spec = found[0]
    return Constraint(field, _grammar(field, spec))


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise GrammarError("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema", "must be an object with name and schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError("response_format.json_schema.name", "must be a string")
        if spec.get("strict") not in (None, True, False):
            raise GrammarError("response_format.json_schema.strict", "must be true or false")
        if "schema" not in spec:
            raise GrammarError("response_format.json_schema.schema", "is required")
        return {"json": spec["schema"]}
    raise GrammarError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _grammar(field: str, spec: dict[str, Any]) -> str:
    matcher = load_llguidance().LLMatcher
    if "json" in spec or "json_object" in spec:
        schema = spec.get("json")
        if schema is None:
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(field, f"not valid JSON ({exc})") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError(field, "a JSON schema must be an object")
        options: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE}
        disable = spec.get("disable_any_whitespace")
        if disable not in (None, False, True):
            raise GrammarError(field, f"disable_any_whitespace must be true or false, got {disable!r}")
        if disable:
            options = {"whitespace_flexible": False}
        pattern = spec.get("whitespace_pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise GrammarError(field, "whitespace_pattern must be a string")
            if disable:
                raise GrammarError(field, "whitespace_pattern and disable_any_whitespace: choose one")
            options = {"whitespace_pattern": pattern}
        try:
            return str(matcher.grammar_from_json_schema(schema, overrides=options))
        except ValueError as exc:
            raise GrammarError(field, str(exc)) from None
    if "regex" in spec:
        regex = spec["regex"]
        if not isinstance(regex, str) or not regex:
            raise GrammarError(field, "must be a non-empty string (a regular expression)")
        return str(matcher.grammar_from_regex(regex))
    if "choice" in spec:
        choices = spec["choice"]
        if (
            not isinstance(choices, list)
            or not 1 <= len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError(field, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        escaped = ("".join("\\" + c if c in REGEX_META else c for c in choice) for choice in choices)
        return str(matcher.grammar_from_regex("(" + "|".join(escaped) + ")"))
    grammar = spec.get("grammar")
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError(field, "must be a non-empty string (a Lark or GBNF grammar)")
    if "::=" in grammar:  # GBNF (llama.cpp's, xgrammar's): llguidance converts it to Lark
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = gbnf_to_lark(grammar)
        except Exception as exc:
            raise GrammarError(field, f"not a GBNF grammar llguidance can convert ({exc})") from None
    return str(matcher.grammar_from_lark(grammar))


class _ByteVocabulary:
    """The byte tokenizer as llguidance's ``TokenizerWrapper`` sees it."""

    def __init__(self, vocab_size: int) -> None:
        self.eos_token_id = BYTE_EOS
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<|id{i}|>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class Grammars:
    """Compiles constraints for one tokenizer; the compiled matchers are cached by grammar text.
    Safe from any thread (HTTP threads compile, the engine thread uses its copies)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.source = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer: Any = None
        self._unavailable: str | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _ll_tokenizer(self, field: str) -> Any:
        if self._tokenizer is None and self._unavailable is None:
            llg = load_llguidance()
            source = self.source
            try:
                if isinstance(source, HFTokenizer):
                    eos = list(source.eos_token_ids) or None
                    self._tokenizer = llg.LLTokenizer(
                        source.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                    )
                elif isinstance(source, ByteTokenizer):
                    if self.vocab_size <= BYTE_EOS:
                        raise ValueError(
                            f"the byte tokenizer needs an id past the bytes for end-of-sequence "
                            f"(vocabulary {self.vocab_size})"
                        )
                    wrapper = llg.TokenizerWrapper(_ByteVocabulary(self.vocab_size))
                    self._tokenizer = llg.LLTokenizer(wrapper, n_vocab=self.vocab_size)
                else:
                    raise ValueError(f"no grammar support for the tokenizer {type(source).__name__}")
            except Exception as exc:
                self._unavailable = f"structured outputs are not available for this model's tokenizer ({exc})"
        if self._tokenizer is None:
            raise GrammarError(field, self._unavailable or "structured outputs are not available")
        return self._tokenizer

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for ``constraint`` (a copy of the cached compiled one);
        ``GrammarError`` naming its field if the grammar does not compile."""
        with self._lock:
            tokenizer = self._ll_tokenizer(constraint.field)
            compiled = self._cache.get(constraint.grammar)
            if compiled is not None:
                self._cache.move_to_end(constraint.grammar)
                return compiled.deep_copy()
        llg = load_llguidance()
        error = llg.LLMatcher.validate_grammar(constraint.grammar, tokenizer)
        if error:
            raise GrammarError(constraint.field, first_line(error))
        compiled = llg.LLMatcher(tokenizer, constraint.grammar, log_level=0)  # drops the GIL
        if compiled.is_error():
            raise GrammarError(constraint.field, first_line(compiled.get_error()))
        probe = compiled.deep_copy()  # a mask moves a matcher on (into an error, for a dead end)
        if not allowed_tokens([probe], self.vocab_size).any() or probe.is_error() or probe.is_stopped():
            raise GrammarError(constraint.field, "the grammar matches no text this model's tokens can write")
        with self._lock:
            self._cache[constraint.grammar] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled.deep_copy()


class Markers:
    """How a grammar writes a chat format's markers (``<tool_call>``, ``<|channel|>``) for one
    tokenizer: a marker that is an added token of the tokenizer, special or not, as that token
    (``<[id]>``: llguidance's lexer spells text, and it takes every added token for a special one,
    which no text spells), any other as its text."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    def token(self, text: str) -> int | None:
        return self.tokenizer.marker_id(text) if self.tokenizer is not None else None

    def __call__(self, text: str) -> str:
        """`text` as a term of llguidance's Lark."""
        token = self.token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)


TEXT_MARKERS = Markers()  # every marker written as text (the byte tokenizer's only choice)

# A reasoning model's thinking (regular expressions of llguidance's Lark): opened by the model (or
# by the template), then anything up to the one closing marker and the whitespace after it. One
# lexeme, so that a "</think>" inside it cannot be taken for the answer's text, nor the other way.
OPENED = r"[ \t\r\n]*<think>"
THINKING = r"(?s:.*)<\/think>[ \t\r\n]*"
TWO_CLOSES = r"(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)"
TEXT_AND_SPACE = "TEXT: /(?s:.+)/\nSPACE: /[ \\t\\r\\n]+/"  # text between special tokens


def after_thinking(
    constraint: Constraint, starts_inside: bool, markers: Markers = TEXT_MARKERS
) -> Constraint:
    """`constraint` for the answer only: the thinking before it (up to ``</think>``) is free, as
    vLLM starts a reasoning model's grammar after its reasoning. ``starts_inside``: the chat
    template opened the thinking, so the output is thinking until ``</think>``; otherwise the
    model may open it with ``<think>`` or answer at once. Where the tokenizer has ``</think>`` as
    an added token (Qwen3, DeepSeek-R1, GLM-4.5) the thinking ends at that token."""
    if markers.token("</think>") is None:
        opened = "" if starts_inside else OPENED
        rules = f"thinking: THINKING\nTHINKING: /{opened}{THINKING}/ & ~/{opened}{TWO_CLOSES}/"
    else:
        opened = "" if starts_inside else f"SPACE? {markers('<think>')} "
        rules = f"thinking: {opened}TEXT? {markers('</think>')} SPACE?\n{TEXT_AND_SPACE}"
    start = "start: thinking @answer" if starts_inside else "start: thinking? @answer"
    return answer_after(constraint, f"{start}\n{rules}\n")


def answer_after(constraint: Constraint, lark: str) -> Constraint:
    """`constraint` as the ``@answer`` of the Lark grammar `lark` (a chat format's preamble)."""
    text = constraint.grammar.strip()
    if text.startswith("{"):  # a top-level grammar of one grammar (JSON schema, regex, choice)
        (grammar,) = json.loads(text)["grammars"]
        answer = {**grammar, "name": "answer"}
    else:  # Lark
        answer = {"name": "answer", "lark_grammar": text}
    top = {"grammars": [{"name": "thinking", "lark_grammar": lark}, answer]}
    return Constraint(constraint.field, json.dumps(top))


def first_line(error: str) -> str:
    """An llguidance error's reason: its first line (the parser's state follows it), and where that
    line only announces what follows ("regex parse error:"), the reason given below it (its
    ``error:`` line: "unclosed character class"). At most 500 characters."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    reason = lines[0]
    if reason.endswith(":") and len(lines) > 1:
        below = next((line for line in reversed(lines) if line.startswith("error:")), lines[1])
        reason = f"{reason} {below.removeprefix('error:').strip()}"
    return reason[:500]


_executor: Any = None
_executor_lock = threading.Lock()


def allowed_tokens(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher allows next (one parallel pass)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = load_llguidance().LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
    _executor.unsafe_compute_mask_ptr(
        [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4, len(matchers)
    )
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()
