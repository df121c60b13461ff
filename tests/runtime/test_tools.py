"""Tool calls: the request's tools and tool_choice checked field by field, each family's calls
found in the model's text (whole and streamed), and the grammar of a required call, which takes
the format's own text."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from eaas.runtime.commands.options import TOOL_CALL_PARSERS
from eaas.runtime.model.tokenizer import HFTokenizer
from eaas.runtime.serving.chat import ChatTemplate, parse_messages
from eaas.runtime.serving.grammar import TEXT_MARKERS, Grammars
from eaas.runtime.serving.http_api import ApiError
from eaas.runtime.serving.reasoning import STYLES
from eaas.runtime.serving.tools import (
    DEEPSEEK_V3,
    FORMATS,
    KIMI_K2,
    HermesFormat,
    StreamedCalls,
    parse_tools,
    tool_format,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HERMES = HermesFormat()
HARMONY = FORMATS["harmony"]


def accepts(grammar: str, text: str) -> bool:
    """Whether `grammar` (a ``Constraint``'s) takes `text` whole, byte by byte."""
    from eaas.runtime.model.tokenizer import ByteTokenizer
    from eaas.runtime.serving.grammar import Constraint

    matcher = Grammars(ByteTokenizer(512), 512).matcher(Constraint("tools", grammar))
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def function_with(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [function_with({"properties": [1]})]}, "tools"),
        ({"tools": [function_with({"required": 1})]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_requests_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_tools(body)
    assert caught.value.param == field


def test_tool_choices() -> None:
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    assert parse_tools({"tools": [WEATHER]}).choice == "auto"  # type: ignore[union-attr]
    named = parse_tools(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named is not None and named.choice == "get_weather" and named.parallel
    assert parse_tools({"tools": [WEATHER], "parallel_tool_calls": False}).parallel is False  # type: ignore[union-attr]
    bare = parse_tools({"tools": [function_with(None)]})  # parameters: null, as absent (vLLM's reading)
    assert bare is not None and bare.parameters == {"f": {"type": "object", "properties": {}}}


def test_formats_by_family_and_by_flag() -> None:
    assert (
        tool_format(None, "qwen3_moe") is HERMES.__class__.__call__
        or tool_format(None, "qwen3_moe") is not None
    )
    assert tool_format("auto", "mixtral") is None
    assert tool_format("hermes", "mixtral") is not None
    with pytest.raises(ValueError, match="tool-call-parser"):
        tool_format("pythonic", "mixtral")
    assert set(TOOL_CALL_PARSERS) == {"auto", *FORMATS}  # the CLI offers exactly the formats


def test_hermes_calls_are_found_in_the_text() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    openai_call = calls[0].as_openai(0)
    assert (
        openai_call["index"] == 0
        and openai_call["id"].startswith("call_")
        and openai_call["type"] == "function"
    )
    for broken in ("<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>", "no calls at all"):
        assert HERMES.parse(broken) == (broken, [])


def test_streamed_content_is_held_from_where_a_call_may_start() -> None:
    stream = StreamedCalls(HERMES)
    pieces = [
        "Sure",
        ", one <",
        "too",
        "l_c",
        "all>\n{",
        '"name": "get_weather", "arguments": {}}',
        "\n</tool_call>",
    ]
    sent = "".join(stream.push(p) for p in pieces)
    assert sent == "Sure, one "  # "<too" was held until it was clearly a call, never sent
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    plain = StreamedCalls(HERMES)
    sent = "".join(plain.push(p) for p in ["a < b", " and <tool", "box>"])
    rest, calls = plain.finish()
    assert sent + rest == "a < b and <toolbox>" and not calls


def test_conversations_with_calls_and_results_reach_the_template() -> None:
    messages = parse_messages(
        [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
        ]
    )
    rendered = ChatTemplate(None).render(messages, [WEATHER])
    assert rendered.startswith("<|tools|>\n") and json.loads(rendered.split("\n")[1]) == WEATHER["function"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rendered
    assert "<|tool|>\n12 C, rain\n" in rendered and rendered.endswith("<|assistant|>\n")
    # without tools the default template renders exactly as before
    plain = ChatTemplate(None).render([{"role": "user", "content": "hi"}])
    assert plain == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ApiError) as caught:
        parse_messages([{"role": "user", "content": "x", "tool_calls": []}])
    assert caught.value.param == "messages"


# A template in the manner of the families' own (GLM-4.5's arguments walked as key/value pairs,
# Qwen3's reasoning_content of earlier turns, tools written with tojson), using what transformers
# gives templates: tojson without sorted keys or HTML escaping, break, {% generation %}.
FAMILY_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>\n{% for tool in tools %}{{ tool['function'] | tojson }}\n"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content or '' }}{% for call in m.tool_calls or [] %}<tool_call>{{ call.function.name }}\n"
    "{% for key, value in call.function.arguments.items() %}<arg_key>{{ key }}</arg_key>"
    "<arg_value>{{ value if value is string else value | tojson }}</arg_value>\n{% endfor %}</tool_call>"
    "{% endfor %}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n"
    "{% if m.role == 'tool' %}{% continue %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_templates_render_as_transformers_renders_them(train_tokenizer: Any) -> None:
    """A conversation with tools, a call (OpenAI's arguments: a JSON string) and its result renders
    exactly as transformers' ``apply_chat_template`` renders it (whose arguments are objects)."""
    from transformers import PreTrainedTokenizerFast

    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "description": "book a room <b>now</b> & pay",
            "parameters": {
                "type": "object",
                "properties": {"room": {"type": "string"}, "nights": {"type": "integer"}},
            },
        },
    }
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "book", "arguments": '{"room": "101", "nights": 3}'},
    }
    conversation = [
        {"role": "system", "content": "Be brief. Prices in €."},
        {"role": "user", "content": "book 101 for 3 nights"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "They want 101."},
        {"role": "tool", "tool_call_id": "call_1", "content": "booked"},
    ]
    ours = ChatTemplate(FAMILY_STYLE_TEMPLATE, {"bos_token": "<s>"}).render(
        parse_messages(conversation), [tool]
    )
    transformers_tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(["x"]), bos_token="<s>")
    decoded = [
        {
            **m,
            "tool_calls": [{**call, "function": {"name": "book", "arguments": {"room": "101", "nights": 3}}}],
        }
        if m.get("tool_calls")
        else m
        for m in conversation
    ]
    theirs = transformers_tokenizer.apply_chat_template(
        decoded, tools=[tool], chat_template=FAMILY_STYLE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '"description": "book a room <b>now</b> & pay", "parameters"' in ours  # in order, unescaped
    assert (
        "<arg_key>room</arg_key><arg_value>101</arg_value>" in ours
        and "<think>They want 101.</think>" in ours
    )
    with pytest.raises(ApiError) as caught:  # arguments that are no JSON object cannot be walked
        parse_messages(
            [{**conversation[2], "tool_calls": [{**call, "function": {"name": "book", "arguments": "[1]"}}]}]
        )
    assert caught.value.param == "messages" and "tool_calls[0].function.arguments" in caught.value.message


def test_deepseek_v3_calls_are_found_in_both_template_versions() -> None:
    v31 = (
        "Checking both."
        "<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    content, calls = DEEPSEEK_V3.parse(v31)
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET"}),
    ]
    v3 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert [(c.name, json.loads(c.arguments)) for c in DEEPSEEK_V3.parse(v3)[1]] == [
        ("get_weather", {"city": "Rome"})
    ]
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
    assert DEEPSEEK_V3.parse(broken) == (broken, [])


def test_kimi_k2_calls_are_found_and_streamed() -> None:
    text = (
        "On it. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1 <|tool_call_argument_begin|> {"city": "Rome"} '
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    content, calls = KIMI_K2.parse(text)
    assert content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    for broken in (
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>",
        "plain text",
    ):
        assert KIMI_K2.parse(broken) == (broken, [])  # no index, arguments not an object, no call
    stream = StreamedCalls(KIMI_K2)
    sent = "".join(stream.push(text[i : i + 7]) for i in range(0, len(text), 7))
    assert sent == "On it. "  # the section's marker was held until it was one, then nothing more
    rest, streamed = stream.finish()
    assert rest == "" and [c.name for c in streamed] == ["get_weather", "get_weather"]


def test_marker_token_formats_are_chosen_by_the_tokenizer_or_the_flag_and_constrain_calls(
    train_tokenizer: Any, tmp_path: Path
) -> None:
    assert tool_format("auto", "deepseek_v3") is None  # DeepSeek-V3 and Kimi-K2 checkpoints look alike
    assert tool_format("kimi_k2", "deepseek_v3") is KIMI_K2
    assert tool_format("deepseek_v3", "deepseek_v3") is DEEPSEEK_V3
    for form in (DEEPSEEK_V3, KIMI_K2):  # ... but for their tokenizers' section markers
        (tmp_path / form.name).mkdir()
        train_tokenizer(["x"], added=form.markers).save(str(tmp_path / form.name / "tokenizer.json"))
        assert tool_format("auto", "deepseek_v3", HFTokenizer(tmp_path / form.name, 320)) is form
    request = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    single = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None and single is not None
    oslo, rome = '{"city": "Oslo"}', '{"city":"Rome"}'
    written = {
        DEEPSEEK_V3: [
            f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city}<｜tool▁call▁end｜>"
            for city in (oslo, rome)
        ],
        KIMI_K2: [
            f"<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>{city}<|tool_call_end|>"
            for i, city in enumerate((oslo, rome))
        ],
    }
    for form, calls in written.items():
        one, two = (f"{form.start}{''.join(calls[:n])}{form.end}" for n in (1, 2))
        grammar = form.constraint(request, TEXT_MARKERS).grammar
        assert accepts(grammar, one) and accepts(grammar, two)
        assert accepts(form.constraint(single, TEXT_MARKERS).grammar, one)
        assert not accepts(form.constraint(single, TEXT_MARKERS).grammar, two)  # one call only
        assert not accepts(grammar, one.replace('"Oslo"', "Oslo"))  # no longer JSON
        assert not accepts(grammar, one.replace('"city"', '"town"'))  # not the schema
        assert not accepts(grammar, one.replace("get_weather", "get_time"))  # not a tool
        assert [(c.name, json.loads(c.arguments)) for c in form.parse(two)[1]] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_weather", {"city": "Rome"}),
        ]


HARMONY_OUTPUT = (
    "<|channel|>analysis<|message|>The user wants the weather; 2 < 3.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}'
)


def test_harmony_channels_are_split_and_calls_found_whole_and_streamed() -> None:
    """gpt-oss: the analysis channel is reasoning, a commentary without recipient is content, a
    message to functions.NAME is a call (cut off by <|call|>, which ends generation and never
    reaches the text); the same split whatever the pieces a stream brings."""
    reasoning_style = STYLES["harmony"]
    assert tool_format("auto", "gpt_oss") is HARMONY
    reasoning, content = reasoning_style.split(HARMONY_OUTPUT)
    assert reasoning == "The user wants the weather; 2 < 3."
    text, calls = HARMONY.parse(content)
    assert text == "Looking it up." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert reasoning_style.split(final) == ("Easy.", "It is 4.")
    assert reasoning_style.split("no harmony <here>") == ("", "no harmony <here>")  # all content
    assert HARMONY.parse("It is 4.") == ("It is 4.", [])
    for size in (1, 2, 3, 5, 8, 13):
        stream = reasoning_style.stream()
        calls_stream = StreamedCalls(HARMONY)
        reasoning = sent = ""
        for i in range(0, len(HARMONY_OUTPUT), size):
            r, c = stream.push(HARMONY_OUTPUT[i : i + size])
            reasoning, sent = reasoning + r, sent + calls_stream.push(c)
        r, c = stream.finish()
        reasoning, sent = reasoning + r, sent + calls_stream.push(c)
        rest, streamed = calls_stream.finish()
        assert (reasoning, sent + rest) == ("The user wants the weather; 2 < 3.", "Looking it up."), size
        assert [c.name for c in streamed] == ["get_weather"]


def test_harmony_grammar_is_one_call_after_an_optional_analysis() -> None:
    request = parse_tools(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert request is not None and request.parallel  # asked for, but a harmony turn holds one call
    grammar = HARMONY.constraint(request, TEXT_MARKERS).grammar
    call = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    )
    analysis = "<|channel|>analysis<|message|>Think: a < b, c <= d.<|end|><|start|>assistant"
    assert accepts(grammar, call) and accepts(grammar, analysis + call)
    assert not accepts(grammar, call + call)
    assert not accepts(grammar, analysis.replace("Think", "<|end|>") + call)  # a marker in the thinking
    content = STYLES["harmony"].split(analysis + call)[1]
    assert [json.loads(c.arguments) for c in HARMONY.parse(content)[1]] == [{"city": "Oslo"}]
    # the reasoning parser leaves it as it is (a call is no final message: it holds the analysis)
    constraint = HARMONY.constraint(request, TEXT_MARKERS)
    assert STYLES["harmony"].answer_grammar(constraint, TEXT_MARKERS) is constraint
    # a message to a built-in tool is the model's own work, not a call of the request's
    browsing = (
        '<|channel|>analysis to=browser.search code<|message|>{"q": "oslo"}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Sunny."
    )
    assert STYLES["harmony"].split(browsing) == ('{"q": "oslo"}', "Sunny.")


def test_schemas_of_other_shapes_constrain_calls_as_they_are() -> None:
    """A tool schema of ``properties`` takes no other keys in a constrained call; one built of
    ``anyOf`` (or ``$ref``, ...) is taken as it is, its alternatives' keys allowed."""
    either = {
        "type": "object",
        "anyOf": [
            {"properties": {"city": {"type": "string"}}, "required": ["city"]},
            {"properties": {"zip": {"type": "integer"}}, "required": ["zip"]},
        ],
    }
    tools = [{"type": "function", "function": {"name": "where", "parameters": either}}, WEATHER]
    request = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    grammar = HERMES.constraint(request, TEXT_MARKERS).grammar

    def call(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

    assert accepts(grammar, call("where", '{"zip": 1234}')) and accepts(
        grammar, call("where", '{"city": "Oslo"}')
    )
    assert not accepts(grammar, call("where", "{}"))
    assert accepts(grammar, call("get_weather", '{"city": "Oslo"}'))
    assert not accepts(grammar, call("get_weather", '{"city": "Oslo", "extra": 1}'))


def test_glm45_calls_are_found_and_typed_by_the_tools_schema() -> None:
    glm = tool_format("auto", "glm4_moe")
    assert glm is FORMATS["glm45"]
    request = parse_tools(
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "book",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "room": {"type": "string"},
                                "nights": {"type": "integer"},
                                "view": {"enum": ["sea", "park"]},
                            },
                        },
                    },
                }
            ]
        }
    )
    assert request is not None
    text = (
        "Booking it.\n<tool_call>book\n<arg_key>room</arg_key>\n<arg_value>101</arg_value>\n"
        "<arg_key>nights</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        "<tool_call>book\n<arg_key>room</arg_key><arg_value>sea view</arg_value>\n"
        "<arg_key>view</arg_key><arg_value>sea</arg_value>\n</tool_call>"
    )
    content, calls = glm.parse(text, request.parameters)
    assert content == "Booking it."
    # "101" stays a string, as the schema says, and so does an enum of strings; 3 is JSON
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("book", {"room": "101", "nights": 3}),
        ("book", {"room": "sea view", "view": "sea"}),
    ]
    required = parse_tools({"tools": request.tools, "tool_choice": "required"})
    assert required is not None
    assert accepts(
        glm.constraint(required, TEXT_MARKERS).grammar,
        "<tool_call>book\n<arg_key>view</arg_key>\n<arg_value>park</arg_value>\n</tool_call>",
    )  # raw, unquoted
    untyped = glm.parse(text)[1][0]  # without the schema: JSON where the value is JSON
    assert json.loads(untyped.arguments) == {"room": 101, "nights": 3}
    for broken in ("<tool_call>book\nroom=101</tool_call>", "<tool_call></tool_call>", "<tool_call>book"):
        assert glm.parse(broken, request.parameters) == (broken, [])
    stream = StreamedCalls(glm, request.parameters)
    sent = "".join(stream.push(text[i : i + 5]) for i in range(0, len(text), 5))
    assert sent == "Booking it.\n"
    rest, streamed = stream.finish()
    assert rest == "" and [json.loads(c.arguments) for c in streamed] == [
        {"room": "101", "nights": 3},
        {"room": "sea view", "view": "sea"},
    ]


def test_glm45_grammar_refuses_what_the_format_cannot_write() -> None:
    parameters = {"type": "object", "properties": {"<b>": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    request = parse_tools({"tools": tools, "tool_choice": "required"})
    assert request is not None
    with pytest.raises(ApiError) as caught:
        FORMATS["glm45"].constraint(request, TEXT_MARKERS)
    assert caught.value.param == "tools" and "<b>" in caught.value.message


def test_a_tools_refs_resolve_in_its_own_schema_in_constrained_calls() -> None:
    """A tool's ``$defs`` (pydantic's, zod's) and a recursive ``"$ref": "#"`` mean what the tool
    wrote: the arguments are the root of their own JSON document in the call's grammar."""
    located = {
        "type": "object",
        "$defs": {
            "Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        },
        "properties": {"at": {"$ref": "#/$defs/Loc"}},
        "required": ["at"],
    }
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}
    tools = [
        {"type": "function", "function": {"name": "go", "parameters": located}},
        {"type": "function", "function": {"name": "tree", "parameters": tree}},
    ]
    request = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    grammar = HERMES.constraint(request, TEXT_MARKERS).grammar

    def call(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

    assert accepts(grammar, call("go", '{"at": {"city": "Oslo"}}'))
    assert not accepts(grammar, call("go", '{"at": {"town": "Oslo"}}'))
    assert accepts(grammar, call("tree", '{"child": {"child": {}}}'))
    assert not accepts(grammar, call("tree", '{"child": {"name": "f", "arguments": {}}}'))  # not the call's

    located_only = parse_tools({"tools": tools[:1], "tool_choice": "required"})
    assert located_only is not None
    glm = FORMATS["glm45"].constraint(located_only, TEXT_MARKERS).grammar  # $defs go with each argument
    assert accepts(
        glm, '<tool_call>go\n<arg_key>at</arg_key>\n<arg_value>{"city": "Oslo"}</arg_value>\n</tool_call>'
    )
    assert not accepts(
        glm, '<tool_call>go\n<arg_key>at</arg_key>\n<arg_value>{"town": "Oslo"}</arg_value>\n</tool_call>'
    )
    rooted = parse_tools({"tools": [tools[1]], "tool_choice": "required"})
    assert rooted is not None
    with pytest.raises(ApiError) as caught:  # "#" would mean the argument's own schema there
        FORMATS["glm45"].constraint(rooted, TEXT_MARKERS)
    assert caught.value.param == "tools" and "'#'" in caught.value.message


def test_a_named_function_or_no_parallel_calls_means_one_call_and_a_cut_answer_says_length() -> None:
    tools = [WEATHER]
    named = parse_tools(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    auto_single = parse_tools({"tools": tools, "parallel_tool_calls": False})
    auto = parse_tools({"tools": tools})
    assert named is not None and auto_single is not None and auto is not None
    assert named.one_call and auto_single.one_call and not auto.one_call
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    grammar = HERMES.constraint(named, TEXT_MARKERS).grammar
    assert accepts(grammar, one) and not accepts(grammar, f"{one}\n{one}")
    assert auto.finish_reason("stop") == "tool_calls" and named.finish_reason("stop") == "tool_calls"
    assert auto.finish_reason("length") == "length"  # cut off: a call may be missing


def test_glm45_string_arguments_match_their_pattern() -> None:
    """A string argument is raw text in glm45: its schema's ``pattern`` (anchored or found anywhere,
    as JSON schema has it) is enforced on that text, with its length bounds and without ``<``."""
    parameters = {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
            "path": {"type": "string", "pattern": "a/b", "maxLength": 6},
        },
        "required": ["zip"],
    }
    request = parse_tools({"tools": [function_with(parameters)], "tool_choice": "required"})
    assert request is not None
    grammar = FORMATS["glm45"].constraint(request, TEXT_MARKERS).grammar

    def call(zip_code: str, path: str | None = None) -> str:
        text = f"<tool_call>f\n<arg_key>zip</arg_key>\n<arg_value>{zip_code}</arg_value>\n"
        if path is not None:
            text += f"<arg_key>path</arg_key>\n<arg_value>{path}</arg_value>\n"
        return text + "</tool_call>"

    assert accepts(grammar, call("123")) and accepts(grammar, call("123", "xa/by"))
    assert not accepts(grammar, call("12a")) and not accepts(grammar, call("1234"))
    assert not accepts(grammar, call("123", "xyz"))  # the pattern is not in it
    assert not accepts(grammar, call("123", "xxa/byy"))  # longer than maxLength
    bad_pattern = parse_tools(
        {"tools": [function_with({"properties": {"s": {"type": "string", "pattern": 3}}})]}
    )
    assert bad_pattern is not None
    with pytest.raises(ApiError) as caught:
        FORMATS["glm45"].constraint(replace(bad_pattern, choice="required"), TEXT_MARKERS)
    assert caught.value.param == "tools" and "pattern" in caught.value.message
