"""Tool calls in chat: the request's ``tools`` and ``tool_choice``, the model's calls found in its
text, and the grammar that makes a required or named call always parse.

A model writes tool calls in its family's format; ``ToolFormat`` knows one. The format is chosen
by the checkpoint's family or by ``--tool-call-parser``: ``hermes``, the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of Qwen2.5/Qwen3 (and of the
many models fine-tuned on the Hermes format); ``glm45``, GLM-4.5's ``<tool_call>NAME`` blocks of
``<arg_key>``/``<arg_value>`` pairs; ``deepseek_v3`` and ``kimi_k2``, sections of marker
tokens (``SectionFormat``; both families' checkpoints say ``deepseek_v3``: the tokenizer's
section marker tells them apart); ``harmony``, gpt-oss's channels (``harmony.py``). A family
without a format refuses ``tools`` with a 400 that says how to choose one.

A format's markers are tokens of the real tokenizers: the server keeps the special ones in the
decoded text (``Tokenizer.keep``), and grammars write a marker that is an added token as that
token (``grammar.Markers``).

``tool_choice``:

- ``none``: the tools are still shown to the template, and the answer is text.
- ``auto`` (the default with tools): free generation. Calls in the text become ``tool_calls``
  (the first only, with ``parallel_tool_calls: false``), and ``finish_reason`` is ``tool_calls``
  (``length`` where the answer was cut off). A block that does not parse stays in the content, as
  vLLM leaves it.
- ``required``, or a named function: the output is constrained (``grammar.Constraint``) to one
  or more calls whose ``name`` is one of the tools (one call with ``parallel_tool_calls: false``,
  and always one to a named function).
  Their ``arguments`` validate against the tool's ``parameters`` schema (the schema is the root
  of the arguments' JSON, so its ``$ref``s resolve as the tool wrote them), so they always parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from eaas.runtime.model.tokenizer import Tokenizer
from eaas.runtime.serving import harmony
from eaas.runtime.serving.grammar import JSON_WHITESPACE, Constraint, Markers, load_llguidance
from eaas.runtime.serving.http_api import bad
from eaas.runtime.serving.text_stream import partial_suffix

MAX_TOOLS = 128
Parameters = dict[str, dict[str, Any]]  # function name -> its parameters' JSON schema
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FORMAT_BY_FAMILY = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "glm4_moe": "glm45", "gpt_oss": "harmony"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as the request gave them (the chat template renders them)
    parameters: Parameters
    choice: str  # "auto", "none", "required", or the name of the function to call
    parallel: bool  # more than one call may be made (``parallel_tool_calls``)

    def callable(self) -> list[str]:
        """The functions a constrained call may name: the named one, or any of the tools."""
        return [self.choice] if self.choice in self.parameters else list(self.parameters)

    @property
    def named(self) -> bool:
        return self.choice in self.parameters

    @property
    def one_call(self) -> bool:
        """At most one call: ``parallel_tool_calls: false``, or a named function (called once, as
        OpenAI and vLLM do). An ``auto`` answer with more keeps its first."""
        return not self.parallel or self.named

    def finish_reason(self, finish: str | None) -> str | None:
        """An answer's ``finish_reason`` once it made calls: ``tool_calls``, but ``length`` where the
        answer was cut off (a call may be missing, as vLLM says). For a named function too (OpenAI
        says ``stop`` there; a client that acts on ``tool_calls`` acts on both)."""
        return finish if finish == "length" else "tool_calls"


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body; ``ApiError`` names the
    bad field. None without tools (a ``tool_choice`` other than ``none`` is then an error)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"must be a list of at most {MAX_TOOLS} tools")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise bad("tools", f"{where} must be {{'type': 'function', 'function': {{name, parameters}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad("tools", f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _, . and -")
        if name in parameters:
            raise bad("tools", f"{where}.function.name {name!r} is given twice")
        schema = function.get("parameters")
        if schema is None:  # absent or null: no parameters
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise bad("tools", f"{where}.function.parameters must be a JSON schema object")
        if not isinstance(schema.get("properties", {}), dict):
            raise bad("tools", f"{where}.function.parameters.properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise bad("tools", f"{where}.function.parameters.required must be a list of names")
        parameters[name] = schema
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad(
                "tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name'}}"
            )
        if name not in parameters:
            raise bad("tool_choice", f"names {name!r}, which is not one of the tools")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f"must be none, auto, required or a named function, got {choice!r}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    return ToolRequest(tools, parameters, choice, parallel)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class HermesFormat:
    """``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one block per call."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, parameters: Parameters | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls): the text before the first call, and every block that parses as a call.
        Text with a block that does not parse is all content. (``parameters``: unused, the
        arguments are JSON.)"""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for block in self._block.findall(text[first:]):
            try:
                value = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return text, []
            arguments = value.get("arguments", {})
            calls.append(
                ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
            )
        if not calls:
            return text, []
        return text[:first].rstrip(), calls

    def constraint(self, request: ToolRequest, markers: Markers) -> Constraint:
        """The grammar of one call (or, when parallel calls are allowed, one or more) to the named
        function, or to any of the tools for ``required``."""
        names = request.callable()
        rules = []
        for i, name in enumerate(names):
            # The arguments are their own JSON document (the tool's schema its root, so that its
            # "$ref"s resolve as written), inside the call object's text as Qwen's template writes it.
            arguments = {
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
                **_arguments(request.parameters[name]),
            }
            head = _lark_text(f'\n{{"name": {json.dumps(name)}, "arguments": ')
            body = f'"{head}" %json {json.dumps(arguments)} "}}\\n"'
            rules.append(f"call{i}: {markers(self.start)} {body} {markers(self.end)}")
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        repeat = "" if request.one_call else ' ("\\n" call)*'
        lark = "\n".join([f"start: call{repeat}", f"call: {calls}", *rules]) + "\n"
        # A tool's parameters schema that does not compile is the tools' fault: the 400 names them.
        return Constraint("tools", str(load_llguidance().LLMatcher.grammar_from_lark(lark)))


class GlmFormat:
    """GLM-4.5's calls: one ``<tool_call>NAME`` block per call, each argument a pair of lines
    ``<arg_key>KEY</arg_key>`` ``<arg_value>VALUE</arg_value>``, then ``</tool_call>``. A value is
    raw text where the tool's schema says the argument is a string, else JSON (as the family's
    chat template writes it: ``tojson`` unless a string); a value that is not JSON is kept as
    text, as vLLM's ``glm45`` parser does."""

    name = "glm45"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _pair = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    _name = re.compile(r"\s*([^\s<]+)")

    def parse(self, text: str, parameters: Parameters | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls), as ``HermesFormat.parse``; ``parameters`` type the values."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for block in self._block.findall(text[first:]):
            head = self._name.match(block)
            if head is None:
                return text, []
            name, at, arguments = head.group(1), head.end(), {}
            properties = ((parameters or {}).get(name) or {}).get("properties") or {}
            while (pair := self._pair.match(block, at)) is not None:
                key, value = pair.group(1).strip(), pair.group(2)
                arguments[key] = value if _is_string(properties.get(key)) else _json_or_text(value)
                at = pair.end()
            if block[at:].strip():
                return text, []  # something other than argument pairs: not a call
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:first].rstrip(), calls

    def constraint(self, request: ToolRequest, markers: Markers) -> Constraint:
        """One call (or, when parallel calls are allowed, one or more) to the named function or to
        any of the tools, laid out as the chat template writes calls. Each function's arguments are
        its schema's properties in the schema's order (the required ones always, the others
        optionally); a string is text up to the next ``<`` (or one of its ``enum``), any other
        value JSON valid against the property's schema. Other keys, with text values, only where the
        schema's ``additionalProperties`` allows them (a function without parameters takes none)."""
        names = request.callable()
        key, end_key, value, end_value = (markers(m) for m in self.markers[2:])
        rules: list[str] = []
        terminals: list[str] = []  # a string argument's pattern (``_lark_value``)
        for i, name in enumerate(names):
            schema = request.parameters[name]
            properties = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            # Each argument's value is a JSON document of its own: the schema's definitions go with it.
            defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
            for ref in _refs([*properties.values(), *defs.values()]):
                if ref == "#" or (ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/"))):
                    raise bad(
                        "tools",
                        f"{name}: $ref {ref!r} points into the parameters schema outside $defs and "
                        "definitions, which the glm45 format cannot resolve (each argument is written alone)",
                    )
            pairs = []
            for argument, subschema in properties.items():
                if not isinstance(argument, str) or "<" in argument:
                    raise bad(
                        "tools", f"{name}: argument name {argument!r} cannot be written in the glm45 format"
                    )
                typed = _lark_value(subschema, defs, terminals)
                written = f'{key} "{_lark_text(argument)}" {end_key} "\\n" {value} {typed}'
                pair = f'{written} {end_value} "\\n"'
                pairs.append(pair if argument in required else f"({pair})?")
            if schema.get("additionalProperties") not in (False, None):  # other keys, where allowed
                free = f'{key} /[A-Za-z0-9_.-]+/ {end_key} "\\n" {value}'
                pairs.append(f'({free} /[^<]*/ {end_value} "\\n")*')
            head = f'{markers(self.start)} "{_lark_text(name)}\\n"'
            rules.append(f"call{i}: {head} {' '.join(pairs)} {markers(self.end)}")
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        repeat = "" if request.one_call else ' ("\\n" call)*'
        lark = "\n".join([f"start: call{repeat}", f"call: {calls}", *rules, *terminals]) + "\n"
        return Constraint("tools", str(load_llguidance().LLMatcher.grammar_from_lark(lark)))


COMBINATORS = ("anyOf", "oneOf", "allOf", "not", "$ref", "patternProperties", "additionalProperties")


def _arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema as its calls' grammar takes it: a schema of ``properties``
    takes no other keys unless ``additionalProperties`` says so (a function without parameters
    takes none), as OpenAI's strict function calling and the glm45 grammar have it. A schema
    built otherwise (``anyOf``, ``$ref``, ...) is taken as it is."""
    if "properties" not in schema or any(key in schema for key in COMBINATORS):
        return schema
    return {**schema, "additionalProperties": False}


def _is_string(schema: Any) -> bool:
    """Whether an argument's schema admits strings only (as the template writes them: raw)."""
    if not isinstance(schema, dict):
        return False
    if "type" in schema:
        return schema["type"] == "string"
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _lark_text(text: str) -> str:
    """`text` inside a Lark string literal."""
    return json.dumps(text)[1:-1]


def _refs(schemas: list[Any]) -> list[str]:
    """Every ``$ref`` in `schemas`, at any depth."""
    found, stack = [], list(schemas)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _lark_value(schema: Any, defs: dict[str, Any] | None = None, terminals: list[str] | None = None) -> str:
    """A glm45 argument value: text for a string (its ``const`` or one of its ``enum``; within
    its ``minLength`` and ``maxLength``, and matching its ``pattern``: a terminal of the pattern
    and the text, appended to `terminals`), else JSON of `schema` (with the tool's definitions,
    `defs`, which its ``$ref``s name)."""
    if _is_string(schema):
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            return "(" + " | ".join(f'"{_lark_text(c)}"' for c in choices) + ")"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or not isinstance(high, int | None) or (high is not None and high < low):
            raise bad("tools", f"minLength / maxLength of a string argument: bad bounds in {schema}")
        text = f"/[^<]{{{low},{'' if high is None else high}}}/"
        pattern = schema.get("pattern")
        if pattern is None or terminals is None:
            return text
        if not isinstance(pattern, str):
            raise bad("tools", f"pattern of a string argument must be a string, got {pattern!r}")
        name = f"ARG{len(terminals)}"
        terminals.append(f"{name}: /{_whole_match(pattern)}/ & {text}")
        return name
    subschema = schema if isinstance(schema, dict) else {}
    document = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **(defs or {}), **subschema}
    return f"%json {json.dumps(document)}"


def _whole_match(pattern: str) -> str:
    """A JSON schema ``pattern`` (found anywhere in the string unless anchored) as a Lark regex
    that matches whole strings: its ``^`` and ``$`` anchors taken off, any text allowed where it
    has none; ``/`` escaped for the regex literal."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if start else 0 : -1 if end else None]
    body = ("" if start else "(?s:.*)") + f"(?:{core})" + ("" if end else "(?s:.*)")
    return re.sub(r"(?<!\\)/", r"\\/", body)


@dataclass(frozen=True)
class SectionFormat:
    """Calls in a section of marker tokens, one call per ``call_start`` ... ``call_end``, whose
    head names the function and whose arguments are one JSON object:

    - ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
      <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (DeepSeek-V3.1's template; ``function<｜tool▁sep｜>NAME``
      followed by a fenced ```json block, V3-0324's, is read too);
    - ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
      <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``.

    A required or named call is constrained to the first form of each (with any index for Kimi's
    ``IDX``)."""

    name: str
    start: str  # the section's first marker: content ends here
    call_start: str
    arguments: str  # the marker between a call's head and its arguments
    call_end: str
    end: str  # the section's last marker
    head: re.Pattern[str]  # matches a call's text up to its arguments; its last group is the name
    prefix: str = ""  # written before the function's name
    index: bool = False  # ":IDX" after the name

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.call_start, self.arguments, self.call_end, self.end)

    def parse(self, text: str, parameters: Parameters | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls), as ``HermesFormat.parse``."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        block_pattern = re.escape(self.call_start) + r"(.*?)" + re.escape(self.call_end)
        for block in re.findall(block_pattern, text[first:], re.DOTALL):
            head = self.head.match(block)
            if head is None:
                return text, []
            body = block[head.end() :].strip()
            fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
            try:
                arguments = json.loads(fenced.group(1) if fenced else body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(arguments, dict):
                return text, []
            calls.append(ToolCall(head.group(head.lastgroup or 0), json.dumps(arguments)))
        if not calls:
            return text, []
        return text[:first].rstrip(), calls

    def constraint(self, request: ToolRequest, markers: Markers) -> Constraint:
        """One section of one call (or, when parallel calls are allowed, one or more) to the named
        function or to any of the tools, whose arguments validate against its schema."""
        names = request.callable()
        index = ' ":" /[0-9]+/' if self.index else ""
        rules = []
        for i, name in enumerate(names):
            schema = {
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
                **_arguments(request.parameters[name]),
            }
            head = f'{markers(self.call_start)} "{_lark_text(self.prefix + name)}"{index}'
            head += f" {markers(self.arguments)}"
            rules.append(f"call{i}: {head} %json {json.dumps(schema)} {markers(self.call_end)}")
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        repeat = "" if request.one_call else "+"
        lark = "\n".join(
            [f"start: {markers(self.start)} call{repeat} {markers(self.end)}", f"call: {calls}", *rules]
        )
        return Constraint("tools", str(load_llguidance().LLMatcher.grammar_from_lark(lark + "\n")))


DEEPSEEK_V3 = SectionFormat(
    "deepseek_v3",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    re.compile(r"\s*(?:function<｜tool▁sep｜>(?P<fenced>[^\s`]+)|(?P<name>[^<\s]+)<｜tool▁sep｜>)"),
)
KIMI_K2 = SectionFormat(
    "kimi_k2",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    re.compile(r"\s*(?:functions\.)?(?P<name>[^:\s<]+):\d+\s*<\|tool_call_argument_begin\|>"),
    prefix="functions.",
    index=True,
)


class HarmonyFormat:
    """gpt-oss's calls, as ``harmony.HarmonyReasoning`` writes them into the content:
    ``<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>``."""

    name = "harmony"
    start = harmony.CALL_OPEN
    markers = harmony.MARKERS
    _call = re.compile(
        re.escape(harmony.CALL_OPEN)
        + r"(\S+?)"
        + re.escape(harmony.MESSAGE)
        + r"(.*?)"
        + re.escape(harmony.CALL),
        re.DOTALL,
    )

    def parse(self, text: str, parameters: Parameters | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls), as ``HermesFormat.parse``."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for recipient, body in self._call.findall(text[first:]):
            try:
                arguments = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(arguments, dict):
                return text, []
            name = recipient.removeprefix(harmony.FUNCTIONS)
            calls.append(ToolCall(name, json.dumps(arguments)))
        if not calls:
            return text, []
        return text[:first].rstrip(), calls

    def constraint(self, request: ToolRequest, markers: Markers) -> Constraint:
        """One call to the named function or to any of the tools, after an optional analysis, as
        gpt-oss writes calls; the arguments validate against the tool's schema. One call whatever
        ``parallel_tool_calls`` says: the model's turn ends at ``<|call|>``."""
        names = request.callable()
        rules = []
        for i, name in enumerate(names):
            schema = {
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
                **_arguments(request.parameters[name]),
            }
            head = f'{markers(harmony.CHANNEL)} "commentary to={harmony.FUNCTIONS}{_lark_text(name)} "'
            body = (
                f'{markers(harmony.CONSTRAIN)} "json" {markers(harmony.MESSAGE)} %json {json.dumps(schema)}'
            )
            rules.append(f"call{i}: {head} {body} {markers(harmony.CALL)}")
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        lark = "\n".join(["start: analysis? call", f"call: {calls}", *rules])
        return Constraint(
            "tools",
            str(load_llguidance().LLMatcher.grammar_from_lark(f"{lark}\n{harmony.analysis_rules(markers)}")),
        )


ToolFormat = HermesFormat | GlmFormat | SectionFormat | HarmonyFormat
FORMATS: dict[str, ToolFormat] = {
    "hermes": HermesFormat(),
    "glm45": GlmFormat(),
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": KIMI_K2,
    "harmony": HarmonyFormat(),
}


def tool_format(parser: str | None, family: str, tokenizer: Tokenizer | None = None) -> ToolFormat | None:
    """The format ``--tool-call-parser`` names (``auto``/None: by the checkpoint's family; for
    ``deepseek_v3``, whose checkpoints are DeepSeek's or Kimi-K2's, by the section marker the
    tokenizer has as a token)."""
    if parser in (None, "", "auto"):
        if family == "deepseek_v3":
            found = [
                f for f in (DEEPSEEK_V3, KIMI_K2) if tokenizer is not None and tokenizer.marker_id(f.start)
            ]
            return found[0] if len(found) == 1 else None
        name = FORMAT_BY_FAMILY.get(family)
        return FORMATS[name] if name else None
    if parser not in FORMATS:
        raise ValueError(f"tool-call-parser: must be auto or one of {', '.join(FORMATS)}, got {parser!r}")
    return FORMATS[parser]


class StreamedCalls:
    """Streaming with tools: content is released until a call may be starting, then held. The
    calls are parsed when the choice ends and sent as whole ``tool_calls`` deltas. Trailing
    whitespace is held too until more content follows it: the content before a call ends without
    it, as ``parse`` gives it to an answer that is not streamed."""

    def __init__(self, form: ToolFormat, parameters: Parameters | None = None) -> None:
        self.form = form
        self.parameters = parameters
        self.text = ""
        self.released = 0  # characters of ``text`` already sent as content
        self.calling = False  # a call's marker was seen: nothing more goes out as content

    def push(self, delta: str) -> str:
        """The content that may go out now."""
        self.text += delta
        if self.calling:
            return ""
        marker = self.form.start
        start = self.text.find(marker, self.released)
        if start >= 0:
            out, self.calling = self.text[self.released : start].rstrip(), True
        else:
            pending = self.text[self.released :]
            out = pending[: len(pending) - partial_suffix(pending, marker)].rstrip()
        self.released += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the choice ended."""
        _, calls = self.form.parse(self.text, self.parameters)
        return ("", calls) if calls else (self.text[self.released :], [])
