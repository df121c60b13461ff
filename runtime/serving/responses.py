"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A Responses request is turned into a chat completions body (``chat_body``): ``instructions``
become a system message, ``input`` (a string, or a list of messages, ``function_call`` and
``function_call_output`` items) the conversation, ``max_output_tokens`` the answer's bound,
function ``tools`` and ``tool_choice`` chat's, ``text.format`` (``json_schema``, ``json_object``)
a ``response_format``. That body then goes through ``chat.parse_chat`` and the engine like any
chat request (the same template, tool-call parsing and grammars), and the chat answer is written
back as a Response or, streamed, as the Responses API's events (``response_output.py``).

Not kept here, so refused by name (400): stored responses (``store: true``,
``previous_response_id``, ``conversation``), ``background``, built-in tools (``web_search``,
``file_search``, ...), and input other than text (images, files). ``seed`` is accepted as an
extension (as on the chat path), so that sampled answers can be reproduced.
"""

from __future__ import annotations

from typing import Any

from eaas.runtime.serving.http_api import ApiError, bad

# Fields of a Responses request this server reads; any other one (not null) is refused.
FIELDS = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "text", "stream", "store", "metadata", "user",
        "reasoning", "truncation", "include", "background", "previous_response_id", "conversation",
        "service_tier", "seed",
    }
)  # fmt: skip
# What a chat field that failed is called in a Responses request (errors name the caller's field).
RESPONSE_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body of a Responses request; ``ApiError`` (400) names the bad field."""
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object")
    for name, value in body.items():
        if name not in FIELDS and value is not None:
            raise bad(
                name, "is not supported by this server (a request is never answered as if it were absent)"
            )
    if body.get("store"):
        raise bad("store", "responses are not stored here: send store: false (or leave it out)")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad(name, "responses are not stored here: send the whole conversation as input")
    if body.get("background"):
        raise bad("background", "background responses are not supported")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", f"only 'disabled' is supported, got {body['truncation']!r}")
    if body.get("include"):
        raise bad("include", "no extra output data is available here; send [] or leave it out")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad("service_tier", f"must be auto or default, got {body['service_tier']!r}")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad("metadata", "must be an object of string values")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    if not isinstance(body.get("stream", False), bool | None):
        raise bad("stream", f"must be true or false, got {body['stream']!r}")
    for name in ("model", "temperature", "top_p", "seed", "user", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise bad("reasoning", "must be an object with at most effort")
        if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
            raise bad("reasoning.summary", "summaries are not supported (the reasoning text is given)")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def renamed(exc: ApiError) -> ApiError:
    """``exc`` of the chat path, naming the Responses request's field instead of chat's."""
    name = RESPONSE_NAMES.get(exc.param or "")
    if name is None or exc.param is None:
        return exc
    message = exc.message.removeprefix(f"{exc.param}:").removeprefix(" ")
    message = message.replace("max_tokens", "max_output_tokens").replace("messages", "input")
    return ApiError(exc.status, f"{name}: {message}", name, exc.kind, exc.headers, exc.code)


def _messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items join one assistant message,
    and a ``reasoning`` item (an earlier answer's thinking, sent back) becomes the next assistant
    message's ``reasoning_content`` (the chat template decides whether it shows)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "must be a string or a non-empty list of messages and function call items")
    messages: list[dict[str, Any]] = []
    thinking = ""  # of a reasoning item, for the next assistant message

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal thinking
        if thinking:
            message["reasoning_content"], thinking = thinking, ""
        return message

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("input", f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad("input", f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "reasoning":
            thinking += _text(item.get("content") or [], f"{where}.content")
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise bad("input", f"{where}: a function_call needs call_id, name and arguments (strings)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last and not thinking:
                last["tool_calls"].append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad("input", f"{where}.call_id must be a string")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output")}
            )
        else:
            raise bad(
                "input",
                f"{where}.type must be message, reasoning, function_call or function_call_output, "
                f"got {kind!r}",
            )
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad("input", f"{where} must be a string or a list of text parts (input_text, output_text)")


def _tools(value: Any) -> list[dict[str, Any]]:
    """Function tools (``{type: function, name, description, parameters, strict}``) in chat's shape."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "must be a list of function tools")
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad("tool_choice", f"must be none, auto, required or {{'type': 'function', 'name'}}, got {value!r}")


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad("text", "must be an object with format")
    if text.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "only medium (the default) is supported")
    spec = text.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise bad("text.format", "a json_schema format needs schema (a JSON schema object)")
        json_schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        return {"type": "json_schema", "json_schema": {"name": "response", **json_schema}}
    raise bad("text.format", f"type must be text, json_object or json_schema, got {kind!r}")
