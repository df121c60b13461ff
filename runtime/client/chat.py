"""Chat messages to a prompt: the checkpoint's chat template, rendered in a sandboxed Jinja
environment (templates are data from the checkpoint: no access to Python attributes, files or
imports), or a plain default for checkpoints that ship none."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eaas.runtime.client.http_api import CompletionRequest, Limits, bad, parse_completion

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 256


class ChatTemplate:
    def __init__(self, template: str | None, special: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = template or DEFAULT_TEMPLATE
        self.is_default = template is None
        self.special = special or {}
        try:
            self.template = env.from_string(self.source)
        except TemplateError as exc:
            raise ValueError(f"chat template: does not compile ({exc})") from exc

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as exc:  # includes raise_exception() from the template itself
            raise bad("messages", f"the chat template refused them: {exc}") from exc


def _raise(message: str) -> None:
    raise TemplateError(message)


def parse_messages(value: Any) -> list[dict[str, str]]:
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
        if not isinstance(content, str):
            raise bad("messages", f"{where}.content must be a string or a list of text parts")
        messages.append({"role": role, "content": content})
    return messages


def parse_chat(
    body: Any, limits: Limits, template: ChatTemplate, encode: Any
) -> tuple[CompletionRequest, list[dict[str, str]]]:
    """An OpenAI ``/v1/chat/completions`` body as the completion of the rendered conversation.

    Chat's own spellings map to the completion fields: ``max_completion_tokens`` (or
    ``max_tokens``), ``logprobs: true`` with ``top_logprobs``. ``echo``, ``prompt`` and
    ``suffix`` do not apply to chat and are refused; so are ``tools`` (and a ``tool_choice``
    other than ``none``) until tool calls exist.
    """
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object")
    for name in ("prompt", "echo", "suffix", "best_of"):
        if name in body:
            raise bad(name, "does not apply to chat completions")
    # Until tool calls exist they are refused, never ignored (a client would wait for a call).
    if body.get("tools"):
        raise bad("tools", "tool calls are not supported by this server yet")
    if body.get("tool_choice") not in (None, "none"):
        raise bad("tool_choice", "tool calls are not supported by this server yet (only 'none')")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise bad(name, "function calls are not supported by this server yet")
    messages = parse_messages(body.get("messages"))
    completion = {
        k: v
        for k, v in body.items()
        if k not in ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice")
    }
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        completion["max_tokens"] = max_tokens
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, False, True):
        raise bad("logprobs", f"must be true or false, got {logprobs!r}")
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    if logprobs:
        completion["logprobs"] = 0 if top is None else top
    prompt_ids = encode(template.render(messages))
    if not prompt_ids:
        raise bad("messages", "render to an empty prompt")
    if max_tokens is None:  # OpenAI's default: as long as the context allows
        completion["max_tokens"] = max(1, min(limits.max_tokens, limits.max_context - len(prompt_ids)))
    return parse_completion({**completion, "prompt": prompt_ids}, limits, encode), messages
