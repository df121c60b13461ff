"""Structured outputs on the engine: a tiny *random* model, whose free output is noise, sampled at
temperature 1 still produces output that parses and validates, every time, for JSON schemas,
regular expressions, choices and grammars; through preemption; beside unconstrained rows, which
are left exactly as they were. Malformed constraints are refused naming their field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from eaas.runtime.model import load_reference
from eaas.runtime.model.decoder import Decoder
from eaas.runtime.model.tokenizer import ByteTokenizer, HFTokenizer
from eaas.runtime.serving import harmony
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.grammar import (
    TEXT_MARKERS,
    Constraint,
    GrammarError,
    Grammars,
    Markers,
    after_thinking,
    parse_constraint,
)
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.reasoning import STYLES
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Sequence
from eaas.runtime.serving.tools import FORMATS, parse_tools

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
MAX_TOKENS = 400  # far more than any output of PERSON's takes; a "length" finish is a failure
PROMPT = [ord(c) for c in "Describe a person as JSON: "]


@pytest.fixture(scope="module")
def decoder(tiny_checkpoints: dict[str, Path]) -> Decoder:
    return load_reference(tiny_checkpoints["mixtral"])


@pytest.fixture(scope="module")
def grammars(decoder: Decoder) -> Grammars:
    return Grammars(ByteTokenizer(decoder.config.vocab_size), decoder.config.vocab_size)


def generate(
    decoder: Decoder,
    grammars: Grammars,
    body: dict[str, Any] | Constraint,
    seeds: range,
    blocks: int = 256,
    max_tokens: int = MAX_TOKENS,
    written: list[int] | None = None,
) -> tuple[Engine, list[Sequence]]:
    """Sequences sampled under the constraint. ``written``: tokens the model is taken to have
    written already (the matcher consumes them, the prompt ends with them)."""
    constraint = body if isinstance(body, Constraint) else parse_constraint(body)
    assert constraint is not None
    written = written or []

    def matcher() -> Any:
        fresh = grammars.matcher(constraint)
        assert all(fresh.consume_token(t) for t in written)
        return fresh

    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    engine = Engine(
        decoder,
        EngineOptions(kv_cache_bytes=blocks * per_block, block_size=4, max_batch_tokens=64, max_seqs=8),
    )
    seqs = [
        engine.add(
            PROMPT + written, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s), matcher()
        )
        for s in seeds
    ]
    while engine.has_work():
        engine.step()
    return engine, seqs


def text(seq: Sequence) -> str:
    return ByteTokenizer(512).decode(seq.output)


def test_a_random_model_always_writes_json_that_validates(decoder: Decoder, grammars: Grammars) -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    _, seqs = generate(decoder, grammars, body, range(12))
    outputs = set()
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, text(seq))
        value = json.loads(text(seq))
        jsonschema.validate(value, PERSON)
        outputs.add(text(seq))
    assert len(outputs) > 6  # noise within the grammar: the mask did not pick the answers


def test_free_output_of_the_random_model_is_not_json(decoder: Decoder) -> None:
    """The control: without the mask the same model and seeds write noise."""
    engine = Engine(decoder, EngineOptions())
    seqs = [engine.add(PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=s)) for s in range(4)]
    while engine.has_work():
        engine.step()
    for seq in seqs:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text(seq))


def test_json_object_regex_choice_and_grammars(decoder: Decoder, grammars: Grammars) -> None:
    _, seqs = generate(decoder, grammars, {"structured_outputs": {"regex": r"[a-f]{3}-[0-9]{2,4}"}}, range(6))
    for seq in seqs:
        assert seq.finish_reason == "stop" and re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", text(seq)), text(seq)
    choices = ["yes", "no", "a.b*c (maybe)"]  # regex metacharacters are matched literally
    _, seqs = generate(decoder, grammars, {"structured_outputs": {"choice": choices}}, range(8))
    assert {text(s) for s in seqs} <= set(choices) and len({text(s) for s in seqs}) > 1
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]'
    for grammar in (lark, gbnf):
        _, seqs = generate(decoder, grammars, {"structured_outputs": {"grammar": grammar}}, range(4))
        for seq in seqs:
            assert seq.finish_reason == "stop" and re.fullmatch(r"\(\d(\+\d)*\)", text(seq)), text(seq)
    # vLLM's older spelling, and a schema given as a JSON string
    _, seqs = generate(decoder, grammars, {"guided_json": json.dumps(PERSON)}, range(2))
    for seq in seqs:
        jsonschema.validate(json.loads(text(seq)), PERSON)


def test_any_json_object_parses_when_it_ends(decoder: Decoder, grammars: Grammars) -> None:
    """json_object has no bound on its size: a noise model may run to max_tokens, but whatever
    ended by itself is one JSON object."""
    _, seqs = generate(decoder, grammars, {"response_format": {"type": "json_object"}}, range(8))
    for seq in seqs:
        assert seq.output and text(seq).lstrip()[0] == "{"
        if seq.finish_reason == "stop":
            assert isinstance(json.loads(text(seq)), dict)


def test_the_grammar_holds_through_preemption(decoder: Decoder, grammars: Grammars) -> None:
    body = {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
    engine, seqs = generate(decoder, grammars, body, range(8), blocks=40, max_tokens=120)
    assert engine.scheduler.preemptions > 0
    for seq in seqs:
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(text(seq)), PERSON)


def test_rows_without_a_grammar_are_left_as_they_were(decoder: Decoder, grammars: Grammars) -> None:
    alone, _ = decoder.generate([PROMPT], 24)
    engine = Engine(decoder, EngineOptions())
    constraint = parse_constraint({"structured_outputs": {"choice": ["x"]}})
    assert constraint is not None
    constrained = engine.add(PROMPT, SamplingParams(max_tokens=24), grammars.matcher(constraint))
    free = engine.add(PROMPT, SamplingParams(max_tokens=24))
    while engine.has_work():
        engine.step()
    assert free.output == alone[0]
    assert text(constrained) == "x" and constrained.finish_reason == "stop"


SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {**SCHEMA, "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}}, "structured_outputs.json"),
        (
            {"structured_outputs": {"json": {}, "disable_any_whitespace": True, "whitespace_pattern": " "}},
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"response_format": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(GrammarError) as caught:
        parse_constraint(body)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (
            {"response_format": {**SCHEMA, "json_schema": {"schema": {"type": "frob"}}}},
            "response_format",
            "frob",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "unclosed group"),
        (  # the reason, not only "regex parse error:"
            {"response_format": {**SCHEMA, "json_schema": {"schema": {"type": "string", "pattern": "(["}}}},
            "response_format",
            "unclosed character class",
        ),
        (
            {"structured_outputs": {"grammar": "start: undefined_rule"}},
            "structured_outputs.grammar",
            "undefined",
        ),
    ],
)
def test_grammars_that_do_not_compile_are_refused_naming_the_field(
    grammars: Grammars, body: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        constraint = parse_constraint(body)
        assert constraint is not None
        grammars.matcher(constraint)
    assert caught.value.field == field and message in str(caught.value)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher(grammars: Grammars) -> None:
    constraint = Constraint("structured_outputs.choice", parse_constraint({"guided_choice": ["ab"]}).grammar)  # type: ignore[union-attr]
    first, second = grammars.matcher(constraint), grammars.matcher(constraint)
    assert first is not second and len(grammars._cache) >= 1
    assert first.consume_token(ord("a"))
    assert not first.is_stopped() and not second.is_stopped()
    assert second.consume_token(ord("a")) and second.consume_token(ord("b")) and second.is_stopped()


TOOLS = [
    {"type": "function", "function": {"name": "describe", "parameters": PERSON}},
    {"type": "function", "function": {"name": "now"}},
]


@pytest.mark.parametrize("name", ["hermes", "glm45", "deepseek_v3", "kimi_k2"])
def test_a_random_model_always_writes_calls_that_validate(
    decoder: Decoder, grammars: Grammars, name: str
) -> None:
    """A required call in each family's format (GLM-4.5's: text values for strings, JSON for the
    rest), sampled from the random model: every output parses into calls that name a tool and
    validate."""
    request = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    form = FORMATS[name]
    _, seqs = generate(decoder, grammars, form.constraint(request, TEXT_MARKERS), range(12))
    names = set()
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, text(seq))
        content, calls = form.parse(text(seq), request.parameters)
        assert content == "" and len(calls) == 1, text(seq)
        names.add(calls[0].name)
        arguments = json.loads(calls[0].arguments)
        if calls[0].name == "describe":
            jsonschema.validate(arguments, PERSON)
    assert names == {"describe", "now"}  # the mask chose neither: the noise did


def test_a_random_model_always_writes_harmony_calls_that_validate(
    decoder: Decoder, grammars: Grammars
) -> None:
    """gpt-oss: a required call comes after the model's analysis, which is free text up to
    ``<|end|>``; a random model would hardly ever end it, so the analysis is taken as written
    and the call is sampled."""
    request = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    assert request is not None
    analysis = "<|channel|>analysis<|message|>Pick a tool: a < b.<|end|><|start|>assistant"
    written = list(analysis.encode())
    _, seqs = generate(
        decoder, grammars, FORMATS["harmony"].constraint(request, TEXT_MARKERS), range(8), written=written
    )
    names = set()
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, text(seq))
        reasoning, content = STYLES["harmony"].split(analysis + text(seq))
        assert reasoning == "Pick a tool: a < b."
        _, calls = FORMATS["harmony"].parse(content)
        assert len(calls) == 1, text(seq)
        names.add(calls[0].name)
        if calls[0].name == "describe":
            jsonschema.validate(json.loads(calls[0].arguments), PERSON)
    assert names == {"describe", "now"}


@pytest.mark.parametrize("starts_inside", [False, True])
def test_a_reasoning_grammar_starts_after_the_thinking(grammars: Grammars, starts_inside: bool) -> None:
    """``after_thinking``: free thinking up to its one ``</think>``, then the request's grammar.
    The model may answer at once unless the template opened the thinking (``starts_inside``)."""
    answer = parse_constraint({"structured_outputs": {"regex": "(yes|no)"}})
    assert answer is not None
    wrapped = after_thinking(answer, starts_inside)
    assert wrapped.field == answer.field  # errors still name the request's field

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(wrapped)
        return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()

    opened = "" if starts_inside else "<think>"
    assert accepts(f"{opened}a </thin <b> {{not json}}</think>\n\nyes")
    assert not accepts(f"{opened}a</think>maybe")  # the answer keeps its grammar
    assert not accepts(f"{opened}a</think>x</think>no")  # thinking ends at its first </think>
    assert accepts("no") is not starts_inside  # answering at once: only if the model opens thinking
    if not starts_inside:
        assert accepts(" \n<think>b</think>no") and not accepts("x<think>b</think>no")
    lark = parse_constraint({"structured_outputs": {"grammar": 'start: "n=" /[0-9]+/'}})
    json_schema = parse_constraint({"response_format": {"type": "json_object"}})
    for inner, answer_text in ((lark, "n=42"), (json_schema, '{"a": [1]}')):
        assert inner is not None
        wrapped = after_thinking(inner, starts_inside)
        assert accepts(f"{opened}hm</think>{answer_text}")


HARMONY_MARKERS = list(harmony.MARKERS)
KIMI_MARKERS = list(FORMATS["kimi_k2"].markers)
DEEPSEEK_MARKERS = list(FORMATS["deepseek_v3"].markers)


@pytest.fixture(scope="module")
def marked(decoder: Decoder, tmp_path_factory: pytest.TempPathFactory, train_tokenizer: Any) -> Path:
    """A tokenizer as the real families have them: byte-level BPE whose harmony, Kimi-K2 and
    ``<think>`` markers are special tokens and whose DeepSeek-V3 markers are added, non-special
    tokens; it fits the tiny model's vocabulary."""
    corpus = ['{"name": "Ann", "age": 30}', "analysis assistant commentary"] * 20
    specials = [*HARMONY_MARKERS, *KIMI_MARKERS, "<think>", "</think>"]
    tokenizer = train_tokenizer(corpus, specials, DEEPSEEK_MARKERS)
    assert tokenizer.get_vocab_size() <= decoder.config.vocab_size
    directory = tmp_path_factory.mktemp("marked")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_special_markers_decode_only_where_a_format_reads_them(decoder: Decoder, marked: Path) -> None:
    vocab = decoder.config.vocab_size
    plain, harmony_reader = HFTokenizer(marked, vocab), HFTokenizer(marked, vocab, HARMONY_MARKERS)
    text = "<s><|channel|>final<|message|>hi<|tool_call_begin|><｜tool▁sep｜></s>"
    ids = plain.encode(text)
    assert plain.marker_id("<|channel|>") in ids and plain.marker_id("<｜tool▁sep｜>") in ids
    assert plain.decode(ids) == "finalhi<｜tool▁sep｜>"  # special tokens dropped, added ones kept
    assert harmony_reader.decode(ids) == "<|channel|>final<|message|>hi<｜tool▁sep｜>"  # but the format's


def test_grammars_write_special_markers_as_their_tokens(decoder: Decoder, marked: Path) -> None:
    """Calls constrained with a tokenizer whose markers are added tokens: the model writes each
    marker as its one token (a lexer could not spell it), the text decodes with the markers, and
    every call parses and validates. Kimi-K2 (special), DeepSeek-V3 (non-special: to llguidance
    added tokens all the same), gpt-oss (special, after its analysis)."""
    request = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    vocab = decoder.config.vocab_size
    for name, markers in (
        ("kimi_k2", KIMI_MARKERS),
        ("deepseek_v3", DEEPSEEK_MARKERS),
        ("harmony", HARMONY_MARKERS),
    ):
        tokenizer = HFTokenizer(marked, vocab, markers)
        form, grammars = FORMATS[name], Grammars(tokenizer, vocab)
        analysis = (
            "<|channel|>analysis<|message|>I will call.<|end|><|start|>assistant" if name == "harmony" else ""
        )
        written = tokenizer.encode(analysis)
        _, seqs = generate(
            decoder, grammars, form.constraint(request, Markers(tokenizer)), range(6), written=written
        )
        for seq in seqs:
            output = tokenizer.decode(written + seq.output)
            assert seq.finish_reason == "stop", (name, output)
            tokens = {tokenizer.marker_id(m) for m in markers}
            assert None not in tokens and tokens & set(seq.output), (name, seq.output)  # markers as tokens
            if name == "harmony":
                reasoning, output = STYLES["harmony"].split(output)
                assert reasoning == "I will call."
            content, calls = form.parse(output, request.parameters)
            assert content == "" and len(calls) == 1, (name, output)
            if calls[0].name == "describe":
                jsonschema.validate(json.loads(calls[0].arguments), PERSON)


def test_answers_after_special_thinking_markers(decoder: Decoder, marked: Path) -> None:
    """Structured outputs after the thinking where its markers are special tokens: ``</think>``
    (Qwen3-style) and harmony's analysis end the free part at their tokens."""
    vocab = decoder.config.vocab_size
    tokenizer = HFTokenizer(marked, vocab, [*HARMONY_MARKERS, "<think>", "</think>"])
    grammars, markers = Grammars(tokenizer, vocab), Markers(tokenizer)
    answer = parse_constraint({"structured_outputs": {"regex": "(yes|no)"}})
    assert answer is not None

    def accepts(constraint: Constraint, text: str) -> bool:
        matcher = grammars.matcher(constraint)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    think = STYLES["qwen3"].answer_grammar(answer, markers)
    assert accepts(think, "<think>a </think> b</think>\n\nyes") is False  # the closing token ends it once
    assert accepts(think, "<think>a </thin <b> {x}</think>\n\nyes") and accepts(think, "no")
    assert not accepts(think, "<think>a</think>maybe")
    final = STYLES["harmony"].answer_grammar(answer, markers)
    assert accepts(
        final, "<|channel|>analysis<|message|>hm, <b><|end|><|start|>assistant<|channel|>final<|message|>no"
    )
    assert accepts(final, "<|channel|>final<|message|>yes")
    assert not accepts(final, "<|channel|>final<|message|>maybe")
    assert not accepts(final, "<|channel|>commentary<|message|>yes")
    # the same grammars with the markers as text (a byte tokenizer)
    assert STYLES["harmony"].answer_grammar(answer, TEXT_MARKERS).grammar != final.grammar
