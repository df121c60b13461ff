"""Chat messages to a prompt: the checkpoint's chat template, rendered in a sandboxed Jinja
environment (templates are data from the checkpoint: no access to Python attributes, files or
imports), or a plain default for checkpoints that ship none. The request's ``tools`` go to the
template as ``tools`` (as transformers passes them); assistant messages keep their ``tool_calls``
and tool messages their ``tool_call_id`` (``tools.py`` reads the model's calls back). A call's
``arguments``, a JSON string in OpenAI's API, reach the template as the object it encodes, as
transformers' chat format has them (GLM-4.5's template walks ``arguments.items()``, gpt-oss's and
Kimi-K2's write ``arguments | tojson``), as vLLM passes them. An assistant message's
``reasoning_content`` (or ``reasoning``) reaches it too (Qwen3's template reads it)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eaas.runtime.serving.grammar import TEXT_MARKERS, Markers
from eaas.runtime.serving.http_api import CompletionRequest, Limits, bad, parse_completion
from eaas.runtime.serving.tools import ToolFormat, parse_tools

DEFAULT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}"
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}\n"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": {{ call["function"]["name"] | tojson }}, '
    '"arguments": {{ call["function"]["arguments"] | tojson }}}'
    "\n</tool_call>\n{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")
# chat_template_kwargs may not set what the server passes itself
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
MAX_TEMPLATE_KWARGS = 32
EFFORTS = ("minimal", "low", "medium", "high")
THINKING_SWITCHES = ("enable_thinking", "thinking")  # Qwen3's and GLM-4.5's; DeepSeek-V3.1's
MAX_MESSAGES = 256


class ChatTemplate:
    """A chat template rendered as transformers renders it (``apply_chat_template``): the same
    Jinja settings, ``tojson`` writing JSON as ``json.dumps`` does (keys in their order, no HTML
    escaping; Jinja's own sorts keys and escapes ``<``), ``raise_exception``, ``strftime_now``,
    ``break``/``continue`` and the ``{% generation %}`` block (rendered as its body)."""

    def __init__(self, template: str | None, special: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        self.source = template or DEFAULT_TEMPLATE
        self.is_default = template is None
        self.special = special or {}
        try:
            self.template = env.from_string(self.source)
        except TemplateError as exc:
            raise ValueError(f"chat template: does not compile ({exc})") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt; `variables`: the request's own (``chat_template_kwargs``, ``reasoning_effort``),
        which may not shadow the template's functions (``raise_exception``, ``range``, ...)."""
        for name in variables or {}:
            if name in self.template.environment.globals:
                raise bad(
                    f"chat_template_kwargs.{name}", "is a function of the chat template, not a variable"
                )
        extra = {"tools": tools} if tools else {}
        try:
            return self.template.render(
                **(variables or {}), messages=messages, add_generation_prompt=True, **self.special, **extra
            )
        except TemplateError as exc:  # includes raise_exception() from the template itself
            raise bad("messages", f"the chat template refused them: {exc}") from exc


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with
    it): its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat ``messages``: role + content (a string, or text parts); ``ApiError`` names the bad one."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad("messages", f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise bad("messages", f"{where}.content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        calls = message.get("tool_calls")
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"{where}.content must be a string or a list of text parts")
        entry: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls):
                raise bad(
                    "messages",
                    f"{where}.tool_calls: assistant messages only, a list of "
                    "{id, type: function, function: {name, arguments (a JSON string)}}",
                )
            entry["tool_calls"] = [
                _with_arguments(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)
            ]
        for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise bad("messages", f"{where}.{key} must be a string")
                entry[key] = message[key]
        messages.append(entry)
    return messages


def _with_arguments(call: dict[str, Any], where: str) -> dict[str, Any]:
    """`call` with its ``function.arguments`` decoded (the template sees an object)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad("messages", f"{where}.function.arguments must be a JSON object (as a string)")
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )


def template_variables(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs`` (``{"enable_thinking": false}`` for Qwen3, ``{"thinking":
    true}`` for DeepSeek-V3.1) and OpenAI's ``reasoning_effort`` (gpt-oss's template reads it):
    variables for the chat template; ``ApiError`` names the bad one."""
    variables = body.get("chat_template_kwargs")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict) or len(variables) > MAX_TEMPLATE_KWARGS:
        raise bad("chat_template_kwargs", f"must be an object of at most {MAX_TEMPLATE_KWARGS} variables")
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise bad("chat_template_kwargs", f"{name!r} is not a template variable name")
        if name in RESERVED:
            raise bad(f"chat_template_kwargs.{name}", "is set by the server, not by a request")
    for name in THINKING_SWITCHES:
        if name in variables and not isinstance(variables[name], bool):
            raise bad(f"chat_template_kwargs.{name}", f"must be true or false, got {variables[name]!r}")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
        variables = {**variables, "reasoning_effort": effort}
    return dict(variables)


def parse_chat(
    body: Any,
    limits: Limits,
    template: ChatTemplate,
    encode: Any,
    tool_format: ToolFormat | None = None,
    markers: Markers = TEXT_MARKERS,
) -> tuple[CompletionRequest, list[dict[str, Any]]]:
    """An OpenAI ``/v1/chat/completions`` body as the completion of the rendered conversation.

    Chat's own spellings map to the completion fields: ``max_completion_tokens`` (or
    ``max_tokens``), ``logprobs: true`` with ``top_logprobs``. ``echo``, ``prompt`` and
    ``suffix`` do not apply to chat and are refused. ``chat_template_kwargs`` and
    ``reasoning_effort`` become template variables (``template_variables``). ``tools`` need the
    model's ``tool_format`` (``tools.py``); a required or named ``tool_choice`` becomes the
    request's constraint (its markers written as the tokenizer has them: ``markers``).
    """
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object")
    for name in ("prompt", "echo", "suffix", "best_of"):
        if body.get(name) not in (None, False):  # null or false: what a client sends for "not set"
            raise bad(name, "does not apply to chat completions")
    for name in ("functions", "function_call"):  # the deprecated spelling of tools
        if body.get(name) is not None:
            raise bad(name, "is deprecated by OpenAI and not supported; use tools and tool_choice")
    tools = parse_tools(body)
    if tools is not None and tools.choice != "none" and tool_format is None:  # "none": shown, not called
        raise bad(
            "tools",
            "this model's family has no tool-call format here; start the server with "
            "--tool-call-parser hermes if the model writes Hermes-style <tool_call> blocks",
        )
    messages = parse_messages(body.get("messages"))
    completion = {
        k: v
        for k, v in body.items()
        if k
        not in (
            "messages",
            "logprobs",
            "top_logprobs",
            "max_completion_tokens",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "chat_template_kwargs",
            "reasoning_effort",
        )
    }
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # absent or null: the older name, if set
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        completion["max_tokens"] = max_tokens
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, False, True):
        raise bad("logprobs", f"must be true or false, got {logprobs!r}")
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    if logprobs:
        completion["logprobs"] = 0 if top is None else top
    variables = template_variables(body)
    prompt_ids = encode(template.render(messages, tools.tools if tools else None, variables))
    if not prompt_ids:
        raise bad("messages", "render to an empty prompt")
    if max_tokens is None:  # OpenAI's default: as long as the context allows (or the server's default)
        if len(prompt_ids) >= limits.max_context:  # (not max_tokens' fault: the client sent none)
            raise bad(
                "messages",
                f"render to a prompt of {len(prompt_ids)} tokens, which leaves no room for an answer in "
                f"the context of {limits.max_context} tokens this server gives one sequence",
            )
        most = min(limits.max_tokens, limits.default_max_tokens or limits.max_tokens)
        completion["max_tokens"] = max(1, min(most, limits.max_context - len(prompt_ids)))
    call = parse_completion({**completion, "prompt": prompt_ids}, limits, encode)
    if any(variables.get(name) is False for name in THINKING_SWITCHES):
        call = replace(call, thinking=False)  # the template switched the thinking off: all answer
    if tools is not None and tools.choice != "none":
        assert tool_format is not None
        constraint = call.constraint
        if tools.choice != "auto":
            if constraint is not None:
                raise bad(
                    "tool_choice", f"a required or named call cannot be combined with {constraint.field}"
                )
            constraint = tool_format.constraint(tools, markers)
        call = replace(call, constraint=constraint, tools=tools, tool_format=tool_format)
    return call, messages
