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
from eaas.runtime.model.tokenizer import ByteTokenizer
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.grammar import Constraint, GrammarError, Grammars, after_thinking, parse_constraint
from eaas.runtime.serving.paged_cache import KVPool
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
) -> tuple[Engine, list[Sequence]]:
    constraint = body if isinstance(body, Constraint) else parse_constraint(body)
    assert constraint is not None
    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    engine = Engine(
        decoder,
        EngineOptions(kv_cache_bytes=blocks * per_block, block_size=4, max_batch_tokens=64, max_seqs=8),
    )
    seqs = [
        engine.add(
            PROMPT,
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s),
            grammars.matcher(constraint),
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
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", ""),
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


def test_a_random_model_always_writes_glm45_calls_that_validate(decoder: Decoder, grammars: Grammars) -> None:
    """A required call in GLM-4.5's format (text values for strings, JSON for the rest), sampled
    from the random model: every output parses into calls that name a tool and validate."""
    tools = [
        {"type": "function", "function": {"name": "describe", "parameters": PERSON}},
        {"type": "function", "function": {"name": "now"}},
    ]
    request = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    glm = FORMATS["glm45"]
    _, seqs = generate(decoder, grammars, glm.constraint(request), range(12))
    names = set()
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, text(seq))
        content, calls = glm.parse(text(seq), request.parameters)
        assert content == "" and len(calls) == 1, text(seq)
        names.add(calls[0].name)
        arguments = json.loads(calls[0].arguments)
        if calls[0].name == "describe":
            jsonschema.validate(arguments, PERSON)
    assert names == {"describe", "now"}  # the mask chose neither: the noise did


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
