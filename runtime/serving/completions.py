"""OpenAI completions on the continuous-batching engine: one engine request per (prompt, choice),
answered as stream chunks (server-sent events) or joined into one JSON answer.

Both forms come from the same chunks: each sampled token is turned into final text by a
``TextStream`` (held back while a character or a stop string is incomplete). A stop string ends
its choice at once and cancels the rest of its generation; a stop token ends it without being
shown. Closing the chunk iterator early (a streaming client that went away) cancels every
choice still running, which frees its KV cache.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from http import HTTPStatus
from itertools import chain
from typing import Any

from eaas.runtime.httpd import ClientGone
from eaas.runtime.serving.batch_scheduler import QueueFull
from eaas.runtime.serving.engine_worker import EngineWorker, Events, Request
from eaas.runtime.serving.grammar import GrammarError, Grammars
from eaas.runtime.serving.http_api import ApiError, CompletionRequest, bad, overloaded
from eaas.runtime.serving.metrics import AttentionMetrics
from eaas.runtime.serving.reasoning import Style
from eaas.runtime.serving.sampling import Sampled
from eaas.runtime.serving.text_stream import TextStream
from eaas.runtime.serving.tools import StreamedCalls

Chunk = dict[str, Any]
# How often a non-streaming answer looks whether its client went away (the choices are then
# cancelled, as vLLM aborts a request whose client disconnected).
GONE_CHECK_S = 0.5


class Completions:
    def __init__(
        self,
        worker: EngineWorker,
        decode: Callable[..., str],  # (ids, skip_special_tokens=True) -> text: ``Tokenizer.decode``
        model_name: str,
        timeout_s: float,
        metrics: AttentionMetrics,
        to_api_error: Callable[[BaseException], ApiError],
        grammars: Grammars | None = None,
        reasoning: Style | None = None,
        revision: str | None = None,
        token_bytes: Callable[[int], bytes | None] = lambda token: None,
    ) -> None:
        self.worker = worker
        # Every answer and chunk names the checkpoint's revision that served it (when it has one).
        self.fingerprint = {"system_fingerprint": revision} if revision else {}
        self.grammars = grammars
        self.reasoning = reasoning  # chat: how the model's thinking is told from its answer
        self.decode = decode
        self.token_bytes = token_bytes  # a token's own bytes, where the tokenizer has them (chat logprobs)
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.to_api_error = to_api_error

    def submit(self, call: CompletionRequest) -> list[Request]:
        """Queues one request per (prompt, choice); choice j of a seeded call uses seed + j. A
        constrained call gives each choice its own matcher of the (cached) compiled grammar."""
        events: Events = queue.SimpleQueue()
        requests = []
        for i, prompt in enumerate(call.prompts):
            for j in range(call.n):
                params = call.params
                if j and params.seed is not None:
                    params = replace(params, seed=params.seed + j)
                matcher = self._matcher(call)
                requests.append(Request(prompt, params, index=i * call.n + j, events=events, matcher=matcher))
        try:
            self.worker.submit(requests)
        except QueueFull as exc:
            raise overloaded(str(exc)) from exc
        return requests

    def _matcher(self, call: CompletionRequest) -> Any:
        if call.constraint is None:
            return None
        if self.grammars is None:
            raise bad(call.constraint.field, "structured outputs are not available on this server")
        try:
            return self.grammars.matcher(call.constraint)
        except GrammarError as exc:
            raise bad(exc.field, exc.message) from None

    def chunks(
        self,
        call: CompletionRequest,
        requests: list[Request],
        start: float,
        chat: bool = False,
        gone: Callable[[], bool] | None = None,
    ) -> Iterator[Chunk]:
        """The answer as stream chunks: per token per choice, then the usage if asked. A chunk's
        ``logprobs`` is completions' object, or with ``chat`` the entries of chat's ``content``.
        ``gone`` says whether the client went away (``ClientGone``: the choices are cancelled); a
        stream finds out on its next write instead."""
        decode = self.decode if call.skip_special_tokens else self._decode_special
        texts = {
            r: TextStream(decode, call.stop, call.params.min_tokens, call.include_stop) for r in requests
        }
        offsets = dict.fromkeys(requests, 0)  # characters of each choice's tokens so far (text_offset)
        # echo: a choice's first chunk starts with its prompt (and the prompt's logprobs), as vLLM's
        echoing = set(requests) if call.echo else set()
        prompt_tokens: dict[Request, list[str]] = {}
        if call.echo and call.params.logprobs is not None:
            prompt_tokens = {r: [self.decode([token]) for token in r.prompt] for r in requests}
            offsets = {r: sum(len(token) for token in prompt_tokens[r]) for r in requests}
        unfinished = set(requests)
        deadline = start + self.timeout_s
        header = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            **self.fingerprint,
        }

        def chunk(request: Request, text: str, logprobs: Any, finish: str | None) -> Chunk:
            if request in echoing:
                echoing.discard(request)
                text = self.decode(request.prompt) + text
                if request in prompt_tokens:
                    echoed = self._echo_logprobs(request, prompt_tokens[request])
                    logprobs = _merge([echoed, logprobs] if logprobs else [echoed])
            choice = {"index": request.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if call.continuous_usage:  # vLLM's: the choice's own usage so far
                return {**header, "choices": [choice], "usage": _usage(len(request.prompt), request.answered)}
            return {**header, "choices": [choice]}

        try:
            check_at = time.monotonic() + GONE_CHECK_S
            while unfinished:
                if gone is not None and time.monotonic() >= check_at:
                    if gone():
                        raise ClientGone()
                    check_at = time.monotonic() + GONE_CHECK_S
                event = self._next(requests[0].events, deadline, None if gone is None else check_at)
                if event is None:
                    continue
                request, item = event
                if request not in unfinished:
                    continue  # the end of a choice already closed by a stop string
                if isinstance(item, BaseException):
                    raise self.to_api_error(item)
                text = texts[request]
                if item is None:
                    unfinished.discard(request)
                    self._observe(request)
                    tail = text.flush()  # may complete a stop string (one ending in U+FFFD)
                    finish = "stop" if text.stopped else _finish_reason(request.finish_reason)
                    yield chunk(request, tail, None, finish)
                    continue
                request.answered += 1
                # a stop token's text is left out, unless include_stop_str_in_output
                stop_token = item.token in call.params.stop_token_ids and not call.include_stop
                delta = "" if stop_token else text.push(item.token)
                logprobs: Any = None
                if call.params.logprobs is not None and chat:
                    logprobs = [self._chat_logprob(item)]
                elif call.params.logprobs is not None:
                    logprobs = self._logprobs(item, offsets[request])
                    offsets[request] += len(logprobs["tokens"][0])
                if text.stopped:
                    unfinished.discard(request)
                    self.worker.cancel(request)
                    self._observe(request)
                yield chunk(request, delta, logprobs, "stop" if text.stopped else None)
            usage = usage_of(call, requests)
            self._count_ok(start, usage)
            if call.include_usage:
                yield {**header, "choices": [], "usage": usage}
        except ApiError as exc:
            self._count_failed(start, exc)
            raise
        except GeneratorExit:  # the client went away: its times so far still count
            for request in unfinished:
                self._observe(request)
            raise
        finally:
            for request in unfinished:
                self.worker.cancel(request)

    def collect(
        self,
        call: CompletionRequest,
        requests: list[Request],
        start: float,
        chat: bool = False,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming answer: the chunks joined per choice (``chat``, ``gone``: as ``chunks``)."""
        choices: dict[int, dict[str, Any]] = {
            r.index: {"index": r.index, "text": "", "logprobs": None, "finish_reason": None} for r in requests
        }
        pieces: dict[int, list[Any]] = {r.index: [] for r in requests}
        completion_id = ""
        for item in self.chunks(call, requests, start, chat, gone):
            completion_id = item["id"]
            for piece in item["choices"]:
                choice = choices[piece["index"]]
                choice["text"] += piece["text"]
                choice["finish_reason"] = piece["finish_reason"] or choice["finish_reason"]
                if piece["logprobs"] is not None:
                    pieces[piece["index"]].append(piece["logprobs"])
        for request in requests:
            # extension: the generated ids (up to the one that completed a stop string)
            choices[request.index]["token_ids"] = request.tokens[: request.answered]
            if call.params.logprobs is not None:
                joined = pieces[request.index]  # chat's are lists of entries
                choices[request.index]["logprobs"] = list(chain(*joined)) if chat else _merge(joined)
            if call.params.prompt_logprobs is not None:  # vLLM's extension
                choices[request.index]["prompt_logprobs"] = self._prompt_logprobs(request)
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            **self.fingerprint,
            "choices": [choices[i] for i in sorted(choices)],
            "usage": usage_of(call, requests),
        }

    def chat_chunks(self, call: CompletionRequest, requests: list[Request], start: float) -> Iterator[Chunk]:
        """The chat form of ``chunks``: ``chat.completion.chunk`` objects whose choices carry a
        ``delta`` (the role first, then content pieces). A reasoning model's thinking goes out as
        ``reasoning_content`` (and ``reasoning``) deltas. With tools, content is held from where a
        call may start, and the calls go out as whole ``tool_calls`` deltas when the choice ends."""
        announced: set[int] = set()
        streams: dict[int, StreamedCalls] = {}
        if call.tools:
            streams = {r.index: StreamedCalls(call.tool_format, call.tools.parameters) for r in requests}
        style = self.reasoning if call.thinking else None
        thinking = {r.index: style.stream() for r in requests} if style else {}
        for item in self.chunks(call, requests, start, chat=True):
            choices = []
            for piece in item["choices"]:
                index, finish = piece["index"], piece["finish_reason"]
                delta: dict[str, Any] = {}
                if index not in announced:
                    announced.add(index)
                    delta["role"] = "assistant"
                text, reasoning = piece["text"], ""
                if index in thinking:
                    reasoning, text = thinking[index].push(text)
                    if finish is not None:
                        more_reasoning, more_text = thinking[index].finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                if reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = reasoning
                if index in streams:
                    text = streams[index].push(text)
                    if finish is not None:
                        rest, calls = streams[index].finish()
                        text += rest
                        if calls and call.tools is not None:
                            calls = calls[:1] if call.tools.one_call else calls
                            delta["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
                            finish = call.tools.finish_reason(finish)
                if text:
                    delta["content"] = text
                logprobs = None if piece["logprobs"] is None else {"content": piece["logprobs"]}
                choices.append(
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                )
            yield {
                **item,
                "object": "chat.completion.chunk",
                "id": item["id"].replace("cmpl-", "chatcmpl-"),
                "choices": choices,
            }

    def chat_collect(
        self,
        call: CompletionRequest,
        requests: list[Request],
        start: float,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming chat answer (a reasoning model's thinking apart; with tools, the calls
        found in the answer)."""
        answer = self.collect(call, requests, start, chat=True, gone=gone)
        choices = []
        for choice in answer["choices"]:
            logprobs = choice["logprobs"]
            text, reasoning = choice["text"], ""
            if self.reasoning is not None and call.thinking:
                reasoning, text = self.reasoning.split(text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = choice["finish_reason"]
            if call.tools:
                # the calls in the answer, never in the thinking
                content, calls = call.tool_format.parse(text, call.tools.parameters)
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content or None,
                        "tool_calls": [c.as_openai() for c in calls[: 1 if call.tools.one_call else None]],
                    }
                    finish = call.tools.finish_reason(finish)
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            choices.append(
                {
                    "index": choice["index"],
                    "message": message,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                    "finish_reason": finish,
                    "token_ids": choice["token_ids"],
                }
            )
        # vLLM's extension: the conversation's prompt, scored once for the answer (not per choice)
        scored = answer["choices"][0].get("prompt_logprobs", None) if answer["choices"] else None
        return {
            **answer,
            "id": answer["id"].replace("cmpl-", "chatcmpl-"),
            "object": "chat.completion",
            "choices": choices,
            **({"prompt_logprobs": scored} if call.params.prompt_logprobs is not None else {}),
        }

    def _next(
        self, events: Events, deadline: float, until: float | None = None
    ) -> tuple[Request, Sampled | BaseException | None] | None:
        """The next event; None if none came by ``until`` (a time before the deadline)."""
        try:
            return events.get(timeout=max(0.0, min(deadline, until or deadline) - time.monotonic()))
        except queue.Empty:
            if time.monotonic() < deadline:
                return None
            raise ApiError(
                HTTPStatus.GATEWAY_TIMEOUT, f"no answer within {self.timeout_s:.0f} s", kind="timeout"
            ) from None

    def _decode_special(self, ids: list[int]) -> str:
        """``ids`` to text with the special tokens' text in it (``skip_special_tokens: false``)."""
        return self.decode(ids, skip_special_tokens=False)

    def _logprobs(self, sampled: Sampled, offset: int) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` object for one token. ``offset``: the characters of the
        choice's tokens before it (as vLLM: the sum of their ``tokens`` texts, whatever a stop string
        or an incomplete character holds back of the answer's text)."""
        top: dict[str, float] = {}
        for token, logprob in sampled.top:  # most likely first
            # Keyed by text, so two ids that decode alike are one entry (OpenAI's format): it keeps
            # the more likely one. Chat's list has them all (``_chat_logprob``).
            top.setdefault(self.decode([token]), logprob)
        return {
            "tokens": [self.decode([sampled.token])],
            "token_logprobs": [sampled.logprob],
            "top_logprobs": [top],
            "text_offset": [offset],
        }

    def _echo_logprobs(self, request: Request, tokens: list[str]) -> dict[str, Any]:
        """The completions ``logprobs`` object of an echoed prompt (``tokens``: its tokens' texts):
        the first token has none (null), each other its own and, as vLLM, ``top_logprobs`` with it
        first and then the N most likely (keyed by text: of two ids that read alike, the likelier)."""
        top: list[dict[str, float] | None] = [None]
        for entry in request.prompt_logprobs or []:
            alternatives: dict[str, float] = {}
            for token, logprob in [(entry.token, entry.logprob), *entry.top]:
                text = self.decode([token])
                alternatives[text] = max(alternatives.get(text, -FLOOR), _floored(logprob))
            top.append(alternatives)
        offsets = [0]
        for piece in tokens[:-1]:
            offsets.append(offsets[-1] + len(piece))
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [_floored(entry.logprob) for entry in request.prompt_logprobs or []],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, request: Request) -> list[dict[int, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: null for the first token, then per token a map from token id
        to ``logprob``, ``rank`` and ``decoded_token``: the token's own first, then the N most likely."""
        out: list[dict[int, dict[str, Any]] | None] = [None]
        for entry in request.prompt_logprobs or []:
            ranked = {entry.token: (entry.logprob, entry.rank)}
            for rank, (token, logprob) in enumerate(entry.top, start=1):
                ranked.setdefault(token, (logprob, rank))
            out.append(
                {
                    token: {"logprob": _floored(logprob), "rank": rank, "decoded_token": self.decode([token])}
                    for token, (logprob, rank) in ranked.items()
                }
            )
        return out

    def _chat_logprob(self, sampled: Sampled) -> dict[str, Any]:
        """Chat's ``logprobs.content`` entry for one token: its ``top_logprobs`` has one entry per
        alternative token id, even where two decode to the same text."""
        return {
            **self._token_logprob(sampled.token, sampled.logprob),
            "top_logprobs": [self._token_logprob(token, logprob) for token, logprob in sampled.top],
        }

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        """``token``, ``logprob`` and ``bytes``: the token's own bytes where the tokenizer has them (a
        piece of a multi-byte character decodes to U+FFFD), else the UTF-8 of its text."""
        text = self.decode([token])
        raw = self.token_bytes(token) if text else None  # no text: a special token kept out of answers
        return {"token": text, "logprob": logprob, "bytes": list(text.encode() if raw is None else raw)}

    def _observe(self, request: Request) -> None:
        m = self.metrics
        if request.started_at is not None:
            m.queue_seconds.observe(request.started_at - request.enqueued_at)
        if request.first_token_at is not None:
            m.time_to_first_token.observe(request.first_token_at - request.enqueued_at)
            if len(request.tokens) > 1:
                tpot = (time.monotonic() - request.first_token_at) / (len(request.tokens) - 1)
                m.time_per_output_token.observe(tpot)
                m.recent_tpot.record(tpot)

    def _count_ok(self, start: float, usage: dict[str, int]) -> None:
        self.metrics.requests.labels(result="ok").inc()
        self.metrics.request_seconds.observe(time.monotonic() - start)
        self.metrics.generated_tokens.inc(usage["completion_tokens"])
        self.metrics.prompt_tokens.inc(usage["prompt_tokens"])

    def _count_failed(self, start: float, exc: ApiError) -> None:
        self.metrics.requests.labels(result=result_of(exc)).inc()
        self.metrics.request_seconds.observe(time.monotonic() - start)


def usage_of(call: CompletionRequest, requests: list[Request]) -> dict[str, int]:
    """OpenAI's ``usage``: each prompt counts once, however many choices (``n``) it has; a choice
    counts the tokens its answer took (``Request.answered``)."""
    return _usage(sum(len(prompt) for prompt in call.prompts), sum(r.answered for r in requests))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def result_of(exc: ApiError) -> str:
    """The ``result`` label of a failed request."""
    if exc.kind == "overloaded":
        return "rejected"
    if exc.status == HTTPStatus.SERVICE_UNAVAILABLE:
        return "unavailable"
    if exc.status == HTTPStatus.GATEWAY_TIMEOUT:
        return "timeout"
    return "bad_request" if exc.status < 500 else "error"


FLOOR = 9999.0  # -inf is no JSON number: a log-probability below -FLOOR reads -FLOOR (as OpenAI and vLLM)


def _floored(logprob: float) -> float:
    return max(logprob, -FLOOR)


def _finish_reason(reason: str | None) -> str:
    return "stop" if reason == "stop" else "length"


def _merge(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for piece in pieces:
        for key in merged:
            merged[key] += piece[key]
    return merged
