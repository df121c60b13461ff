"""The serving mode's HTTP API (stdlib): an OpenAI-compatible subset, probes and metrics.

| method | path | answer |
|---|---|---|
| POST | ``/v1/completions`` | greedy completion of one or more prompts (byte tokenizer) |
| GET | ``/v1/models`` | the one served model |
| GET | ``/healthz`` | 200 while the process and its batch worker run (liveness) |
| GET | ``/readyz`` | 200 when every expert of the current placement has a connected server, else 503 |
| GET | ``/metrics`` | Prometheus text |

Errors are JSON in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
``param`` naming the offending field: 400 for a bad request, 503 when the queue is full or the
experts are unavailable, 504 when a request outlives ``request_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from eaas.runtime.httpd import BackgroundServer, HttpError, JsonHandler

MAX_BODY_BYTES = 1 << 20
MAX_PROMPTS = 32
MAX_STOP = 4


class ApiError(HttpError):
    """An answer other than 200: status, message and the request field at fault (if any)."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(status, message)
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{param}: {message}", param)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # prompt + new tokens of one sequence
    max_tokens: int  # most new tokens a request may ask for


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]  # token ids of every prompt (OpenAI: one choice per prompt)
    max_tokens: int
    stop: list[str]
    model: str | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_ids(value: Any, param: str, limits: Limits, encode: Any) -> list[int]:
    if isinstance(value, str):
        ids = list(encode(value))
    elif isinstance(value, list) and all(_is_int(v) for v in value):
        ids = list(value)
        out_of_range = [v for v in ids if not 0 <= v < limits.vocab_size]
        if out_of_range:
            raise bad(param, f"token ids must be in [0, {limits.vocab_size}), got {out_of_range[0]}")
    else:
        raise bad(param, "must be a string, a list of token ids, or a list of those")
    if not ids:
        raise bad(param, "must not be empty")
    return ids


def parse_completion(body: Any, limits: Limits, encode: Any) -> CompletionRequest:
    """Validates an OpenAI ``/v1/completions`` body; ``ApiError`` (400) names the first bad field.

    ``encode`` turns a string prompt into token ids. Accepted: ``model``, ``prompt`` (string, token
    ids, or a list of either), ``max_tokens`` (default 16), ``temperature`` (only 0: greedy),
    ``top_p`` (only 1), ``n`` (only 1), ``stop`` (string or up to 4 strings), ``stream`` (only false),
    ``user``. ``echo``, ``logprobs``, ``best_of``, ``suffix`` are refused unless at their defaults.
    """
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "body: must be a JSON object", "body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    if "prompt" not in body:
        raise bad("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        prompts = [_prompt_ids(p, f"prompt[{i}]", limits, encode) for i, p in enumerate(prompt)]
    else:
        prompts = [_prompt_ids(prompt, "prompt", limits, encode)]
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_tokens:
        raise bad("max_tokens", f"must be an integer in [1, {limits.max_tokens}], got {max_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > limits.max_context:
        raise bad(
            "max_tokens",
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"of {limits.max_context} tokens",
        )
    temperature = body.get("temperature", 0)
    if temperature is not None and (not isinstance(temperature, int | float) or temperature != 0):
        raise bad("temperature", f"only 0 (greedy decoding) is supported, got {temperature!r}")
    for name, default in (("top_p", 1), ("n", 1), ("best_of", 1)):
        value = body.get(name, default)
        if value is not None and value != default:
            raise bad(name, f"only {default} is supported, got {value!r}")
    for name in ("stream", "echo"):
        if body.get(name) not in (None, False):
            raise bad(name, f"only false is supported, got {body[name]!r}")
    for name in ("logprobs", "suffix"):
        if body.get(name) is not None:
            raise bad(name, "is not supported")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    if any(not s for s in stops):
        raise bad("stop", "stop strings must not be empty")
    return CompletionRequest(prompts, int(max_tokens), stops, model)


def apply_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class ApiTarget(Protocol):
    """What the HTTP API needs from the service behind it."""

    def is_healthy(self) -> bool: ...
    def readiness(self) -> tuple[bool, dict[str, Any]]: ...
    def metrics_text(self) -> bytes: ...
    def models(self) -> dict[str, Any]: ...
    def complete(self, read_body: Callable[[], Any]) -> dict[str, Any]:
        """Answers a completion; ``read_body`` returns the parsed JSON body or raises ``ApiError``."""
        ...


def _handler(target: ApiTarget) -> type[JsonHandler]:
    class Handler(JsonHandler):
        server_version = "eaas-attention-client"
        max_body_bytes = MAX_BODY_BYTES
        error_type = ApiError

        def body_error(self, message: str) -> HttpError:
            return ApiError(HTTPStatus.BAD_REQUEST, message, "body")

        def dispatch(self, method: str, path: str) -> None:
            if method == "GET" and path == "/healthz":
                self.send_probe(target.is_healthy(), "ok", "unhealthy")
            elif method == "GET" and path == "/readyz":
                ok, detail = target.readiness()
                self.send_json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, detail)
            elif method == "GET" and path == "/metrics":
                self.send_bytes(HTTPStatus.OK, target.metrics_text(), CONTENT_TYPE_LATEST)
            elif method == "GET" and path == "/v1/models":
                self.send_json(HTTPStatus.OK, target.models())
            elif method == "POST" and path == "/v1/completions":
                self.send_json(HTTPStatus.OK, target.complete(self.read_json))
            elif path in ("/healthz", "/readyz", "/metrics", "/v1/models", "/v1/completions"):
                raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}")
            else:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")

    return Handler


class ApiServer(BackgroundServer):
    """The HTTP API in a daemon thread (one thread per connection; generation runs in the scheduler)."""

    def __init__(self, target: ApiTarget, host: str, port: int) -> None:
        super().__init__(_handler(target), host, port, name="eaas-api")
