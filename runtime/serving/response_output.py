"""A chat answer written as the Responses API's: a Response object (``response_object``), or the
events of a streamed one (``response_events``).

Output items, in the order the answer has them: a ``reasoning`` item (a reasoning model's
thinking), a ``message`` with one ``output_text`` part, then one ``function_call`` item per call.
A stream's events, each with its ``sequence_number``: ``response.created``,
``response.in_progress``; per item ``response.output_item.added``, ``response.content_part.added``
(text and reasoning), the deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events and ``response.output_item.done``; last ``response.completed``, or
``response.incomplete`` (``incomplete_details.reason: max_output_tokens``) when the bound cut the
answer short, or ``response.failed`` (``status: failed``, ``error: {code, message}``) when the
answer failed after the stream began (an expert lost for good, the engine stopped): the items sent
so far are in its output, unfinished. Chat sends a tool call whole when its choice ends, so its
arguments arrive as one delta.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from eaas.runtime.httpd import ClientGone, HttpError

log = logging.getLogger(__name__)


def response_object(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The Response of a request (its Responses ``body``) from the chat answer (one choice)."""
    [choice] = answer["choices"]
    message = choice["message"]
    response = _shell(body, answer["created"], answer["model"])
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"], "completed"))
    if message.get("content"):
        output.append(_message_item(message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call, call["function"]["arguments"], "completed"))
    return _finished(response, output, choice["finish_reason"], answer.get("usage"))


def response_events(
    body: dict[str, Any], chunks: Iterator[dict[str, Any]], model: str
) -> Iterator[dict[str, Any]]:
    """The stream events of a request (its Responses ``body``) from the chat chunks of its
    answer (one choice; the usage in the last chunk). Closing the events closes ``chunks`` (a
    client that went away: the answer's generation is cancelled)."""
    stream = _EventStream(_shell(body, int(time.time()), model))
    try:
        yield from stream.start()
        finish, usage = None, None
        try:
            for chunk in chunks:
                if chunk.get("usage") is not None and not chunk["choices"]:
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
                    yield from stream.delta(choice["delta"])
        except ClientGone:
            raise
        except HttpError as exc:
            yield from stream.fail(_error_code(exc.status), exc.message)
            return
        except Exception as exc:  # a bug: the stream says so instead of ending without a word
            log.exception("a Responses stream failed")
            yield from stream.fail("server_error", str(exc) or type(exc).__name__)
            return
        yield from stream.end(finish, usage)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


class _EventStream:
    """The events of one streamed Response; one output item is open at a time."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item receiving deltas
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> Iterator[dict[str, Any]]:
        opening = {**self.response, "status": "in_progress", "output": [], "usage": None}
        yield self.event("response.created", response=opening)
        yield self.event("response.in_progress", response=opening)

    def delta(self, delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat delta: its thinking, its text, its (whole) tool calls."""
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            yield from self._close()
            item = _call_item(call, "", "in_progress")
            index = self._add(item)
            yield self.event("response.output_item.added", output_index=index, item={**item})
            arguments = call["function"]["arguments"]
            where = {"item_id": item["id"], "output_index": index}
            yield self.event("response.function_call_arguments.delta", **where, delta=arguments)
            item.update(arguments=arguments, status="completed")
            yield self.event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=arguments
            )
            yield self.event("response.output_item.done", output_index=index, item=item)

    def end(self, finish_reason: str | None, usage: dict[str, int] | None) -> Iterator[dict[str, Any]]:
        yield from self._close()
        response = _finished(self.response, self.output, finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=response)

    def fail(self, code: str, message: str) -> Iterator[dict[str, Any]]:
        """``response.failed``: the items so far stay in the output, as they were (unfinished)."""
        response = {
            **self.response,
            "output": self.output,
            "status": "failed",
            "error": {"code": code, "message": message},
            "usage": None,
        }
        yield self.event("response.failed", response=response)

    def _add(self, item: dict[str, Any]) -> int:
        self.output.append(item)
        return len(self.output) - 1

    def _text(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        """Text for the open item of ``kind`` (reasoning or message), opening one if needed."""
        if self.open is None or self.open["type"] != kind:
            yield from self._close()
            self.open = (
                _reasoning_item("", "in_progress")
                if kind == "reasoning"
                else _message_item("", "in_progress")
            )
            index = self._add(self.open)
            yield self.event(
                "response.output_item.added", output_index=index, item={**self.open, "content": []}
            )
            part = self.open["content"][0]
            yield self.event(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=index,
                content_index=0,
                part={**part},
            )
        part = self.open["content"][0]
        part["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            yield self.event("response.reasoning_text.delta", **where, delta=text)
        else:
            yield self.event("response.output_text.delta", **where, delta=text, logprobs=[])

    def _close(self) -> Iterator[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.output) - 1
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            yield self.event("response.reasoning_text.done", **where, text=part["text"])
        else:
            yield self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield self.event("response.content_part.done", **where, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)


def _shell(body: dict[str, Any], created: int, model: str) -> dict[str, Any]:
    """A Response without its output, status and usage (the request's settings echoed)."""
    text = body.get("text") or {}
    return {
        "id": _new_id("resp"),
        "object": "response",
        "created_at": created,
        "model": model,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "store": False,
        "background": False,
        "previous_response_id": None,
        "truncation": "disabled",
        "service_tier": "default",
        "error": None,
        "incomplete_details": None,
    }


def _finished(
    response: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, int] | None,
) -> dict[str, Any]:
    """``response`` with its output, status (from chat's finish reason) and usage."""
    cut = finish_reason == "length"
    return {
        **response,
        "output": output,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _error_code(status: int) -> str:
    """The Responses API's error code for an HTTP status raised mid-stream."""
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return "rate_limit_exceeded"
    return "invalid_prompt" if status < 500 else "server_error"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [part], "status": status}


def _message_item(text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": status, "content": [part]}


def _call_item(call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }
