"""The serving mode's HTTP API (stdlib): an OpenAI-compatible subset, probes and metrics.

| method | path | answer |
|---|---|---|
| POST | ``/v1/completions`` | completions: sampling, ``n``, stops, logprobs, echo, JSON/regex/grammar, SSE |
| POST | ``/v1/chat/completions`` | the same for a conversation, through the checkpoint's chat template |
| GET | ``/v1/models`` | the one served model |
| POST | ``/tokenize``, ``/detokenize`` | vLLM's: a prompt or messages to token ids, and back |
| POST | ``/v1/responses`` | OpenAI's Responses API over the chat path (``responses.py``) |
| GET | ``/healthz`` | 200 while the process and its batch worker run (liveness) |
| GET | ``/readyz``, ``/health`` | 200 when every expert of the current placement has a connected server
  and the engine worker runs, else 503 with the reason (``/health`` is vLLM's spelling, which
  gateways and benchmark tools probe) |
| GET, POST | ``/ping`` | vLLM's and SageMaker's liveness ping: 200 as ``/healthz`` |
| GET | ``/version`` | ``{"version": ...}``: the ``eaas`` package's version |
| GET | ``/metrics`` | Prometheus text |

With API keys configured, every ``/v1/`` route (and ``/tokenize``, ``/detokenize``) needs
``Authorization: Bearer <key>`` (401 otherwise); the probes and ``/metrics`` stay open for the
kubelet and Prometheus.

Errors are JSON in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
``param`` naming the offending field: 400 for a bad request, 503 when the queue is full or the
experts are unavailable, 504 when a request outlives ``request_timeout_s``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from eaas.runtime.auth import Tokens
from eaas.runtime.httpd import BackgroundServer, HttpError, JsonHandler
from eaas.runtime.serving.grammar import Constraint, GrammarError, parse_constraint
from eaas.runtime.serving.sampling import MAX_LOGPROBS, SamplingParams

MAX_BODY_BYTES = 1 << 20
MAX_PROMPTS = 32
MAX_STOP = 4


class ApiError(HttpError):
    """An answer other than 200: status, message and the request field at fault (if any)."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        param: str | None = None,
        kind: str = "",
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{param}: {message}", param)


def unknown_model(asked: str, served: str) -> ApiError:
    """404 with OpenAI's ``model_not_found`` (the ``openai`` client raises ``NotFoundError``)."""
    return ApiError(
        HTTPStatus.NOT_FOUND,
        f"model: the model {asked!r} does not exist here; this server serves {served!r}",
        "model",
        code="model_not_found",
    )


def overloaded(message: str) -> ApiError:
    """A full queue: 429 at once with ``Retry-After`` (the ``openai`` client backs off and retries)
    rather than a wait without bound. 503 stays for a service that cannot serve at all."""
    return ApiError(HTTPStatus.TOO_MANY_REQUESTS, message, kind="overloaded", headers={"Retry-After": "1"})


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # prompt + new tokens of one sequence (the model's context, or the KV cache's room)
    max_tokens: int  # most new tokens a request may ask for
    # new tokens of a chat request that names none: None = the rest of the context (OpenAI's and
    # vLLM's default), else at most this many (vLLM: --override-generation-config max_new_tokens)
    default_max_tokens: int | None = None


MAX_N = 16
MAX_STOP_TOKEN_IDS = 16


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]  # token ids of every prompt (OpenAI: n choices per prompt)
    params: SamplingParams  # max_tokens, sampling, stop token ids, logprobs (choice i of n: seed + i)
    stop: list[str]
    model: str | None
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False
    constraint: Constraint | None = None  # structured outputs (response_format, structured_outputs)
    tools: Any = None  # chat: the request's ``tools.ToolRequest`` when its calls are to be parsed
    tool_format: Any = None  # ... and the model's ``tools.ToolFormat``
    thinking: bool = True  # chat: a reasoning model thinks (chat_template_kwargs can switch it off)
    include_stop: bool = False  # include_stop_str_in_output: the stop string (or stop token's text) kept
    skip_special_tokens: bool = True  # False: special tokens decode to their text
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage in every chunk

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise bad(name, f"must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


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


# Every field a completion request may carry (chat maps its own onto these: ``chat.parse_chat``).
COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
        "frequency_penalty", "n", "best_of", "stop", "stop_token_ids", "logprobs", "echo", "stream",
        "stream_options", "user", "suffix", "ignore_eos", "response_format", "structured_outputs",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
        "spaces_between_special_tokens", "priority", "prompt_logprobs",
    }
)  # fmt: skip
# vLLM's and OpenAI's sampling fields that change nothing at these values (SDKs send defaults):
# accepted so, refused otherwise, as every other field this server does not implement.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "length_penalty": (1, 1.0),
}


def refuse_unknown_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """A 400 naming the first field this server would otherwise ignore: not one it implements, not
    null, and not a sampling field at its neutral value."""
    for name, value in body.items():
        if name in known or value is None:
            continue
        neutral = NEUTRAL_VALUES.get(name, ())
        if any(type(value) is type(v) and value == v for v in neutral):
            continue
        raise bad(name, "is not supported by this server (a request is never answered as if it were absent)")


def parse_completion(body: Any, limits: Limits, encode: Any) -> CompletionRequest:
    """Validates an OpenAI ``/v1/completions`` body; ``ApiError`` (400) names the first bad field.

    ``encode`` turns a string prompt into token ids. Accepted: ``model``, ``prompt`` (string, token
    ids, or a list of either), ``max_tokens`` (default 16), ``temperature`` (default 1, as OpenAI;
    0 is greedy), ``top_p``, ``top_k`` (vLLM's extension), ``seed``, ``presence_penalty``,
    ``frequency_penalty``, ``n``, ``best_of`` (only equal to ``n``), ``stop`` (string or up to 4
    strings), ``stop_token_ids``, ``logprobs`` (0-20; with ``echo`` the prompt's tokens too, and
    ``max_tokens`` may be 0), ``prompt_logprobs`` (vLLM's, 0-20; not with ``stream``), ``echo``,
    ``stream``, ``stream_options``, ``user``, ``ignore_eos``, and structured outputs
    (``response_format``, ``structured_outputs``, ``guided_*``: ``grammar.parse_constraint``).
    vLLM's extensions: ``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
    ``stream_options.continuous_usage_stats`` (honoured), ``spaces_between_special_tokens`` and
    ``priority`` (checked, then ignored: this server's tokenizers are fast ones, which vLLM does not
    apply it to either, and its queue is first come, first served). ``suffix`` is refused, and so
    is any other field (``refuse_unknown_fields``): never answered as if it were absent.
    """
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "body: must be a JSON object", "body")
    refuse_unknown_fields(body, COMPLETION_FIELDS)
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
    echo = _flag(body, "echo")
    if not _is_int(max_tokens) or not (0 if echo else 1) <= max_tokens <= limits.max_tokens:
        raise bad(
            "max_tokens",
            f"must be an integer in [1, {limits.max_tokens}] (0 only with echo: the prompt alone, "
            f"scored with logprobs), got {max_tokens!r}",
        )
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > limits.max_context:
        raise bad(
            "max_tokens",
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{limits.max_context} tokens this server gives one sequence",
        )
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad("n", f"must be an integer in [1, {MAX_N}], got {n!r}")
    if len(prompts) * n > MAX_PROMPTS:
        raise bad("n", f"prompts x n must be at most {MAX_PROMPTS}, got {len(prompts)} x {n}")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):  # (true == 1 in Python)
        raise bad("best_of", f"only best_of == n is supported, got {best_of!r}")
    if body.get("suffix") is not None:
        raise bad("suffix", "is not supported")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise bad("seed", f"must be an integer in [0, 2**63), got {seed!r}")
    top_k = body.get("top_k", 0)
    if top_k is None or top_k == -1:  # -1: off, as vLLM spells it
        top_k = 0
    # Above the vocabulary it keeps every token (as vLLM); the sampler holds it in an int64 tensor.
    if not _is_int(top_k) or not 0 <= top_k < 2**63:
        raise bad("top_k", f"must be -1 or 0 (off) or an integer in [1, 2**63), got {top_k!r}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    _flag(body, "ignore_eos")  # read by the service (it keeps the tokenizer's EOS out); checked here
    _flag(body, "spaces_between_special_tokens")  # checked; see the docstring
    priority = body.get("priority")
    if priority is not None and not _is_int(priority):
        raise bad("priority", f"must be an integer, got {priority!r}")
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise bad("min_tokens", f"must be an integer in [0, max_tokens = {max_tokens}], got {min_tokens!r}")
    skip_special = body.get("skip_special_tokens", True)
    if skip_special is None:
        skip_special = True
    if not isinstance(skip_special, bool):
        raise bad("skip_special_tokens", f"must be true or false, got {skip_special!r}")
    stream = _flag(body, "stream")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if not _is_int(prompt_logprobs) or not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise bad(
                "prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {prompt_logprobs!r}"
            )
        if stream and prompt_logprobs > 0:  # as vLLM: the list is no stream chunk's (echo's are)
            raise bad("prompt_logprobs", "is not available with stream: true (echo with logprobs is)")
    elif echo:  # the echoed prompt's tokens get their log-probabilities too (as vLLM)
        prompt_logprobs = logprobs
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad(
                "stream_options", "must be an object with at most include_usage and continuous_usage_stats"
            )
        for name in ("include_usage", "continuous_usage_stats"):
            if options.get(name) is not None and not isinstance(options[name], bool):
                raise bad("stream_options", f"{name} must be true or false, got {options[name]!r}")
        continuous_usage = bool(options.get("continuous_usage_stats"))
        # asked for continuous usage and silent on include_usage: usage, as vLLM defaults it
        asked = options.get("include_usage")
        include_usage = continuous_usage if asked is None else asked
        continuous_usage = continuous_usage and include_usage
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
    stop_ids = body.get("stop_token_ids") or []
    if (
        not isinstance(stop_ids, list)
        or len(stop_ids) > MAX_STOP_TOKEN_IDS
        or not all(_is_int(t) and 0 <= t < limits.vocab_size for t in stop_ids)
    ):
        raise bad(
            "stop_token_ids",
            f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {limits.vocab_size})",
        )
    params = SamplingParams(
        max_tokens=int(max_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        top_k=int(top_k),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stop_token_ids=tuple(stop_ids),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_tokens=min_tokens,
    )
    try:
        constraint = parse_constraint(body)
    except GrammarError as exc:
        raise bad(exc.field, exc.message) from None
    return CompletionRequest(
        prompts,
        params,
        stops,
        model,
        n,
        stream,
        include_usage,
        echo,
        constraint,
        include_stop=_flag(body, "include_stop_str_in_output"),
        skip_special_tokens=skip_special,
        continuous_usage=continuous_usage,
    )


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
    def complete(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Answers a completion: a JSON object, or the chunks of a stream (server-sent events).
        ``read_body`` returns the parsed JSON body or raises ``ApiError``; ``gone`` says whether
        the client went away (a JSON answer then stops with ``ClientGone``)."""
        ...

    def chat(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Answers a chat completion (as ``complete``)."""
        ...

    def responses(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Answers OpenAI's Responses API (as ``complete``; a stream's items are its events)."""
        ...

    def tokenize(self, read_body: Callable[[], Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a prompt or chat messages -> ``count``, ``max_model_len``, ``tokens``."""
        ...

    def detokenize(self, read_body: Callable[[], Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``tokens`` -> ``prompt`` (the text)."""
        ...


# The routes that generate: path -> the ``ApiTarget`` method that answers it.
GENERATION_ROUTES = {
    "/v1/completions": "complete",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}
VERSION = importlib.metadata.version("eaas")


class InFlight:
    """Generation requests being answered (from their arrival to their last byte, streams too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._lock:
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1


def _handler(target: ApiTarget, in_flight: InFlight, api_keys: tuple[str, ...] = ()) -> type[JsonHandler]:
    keys = Tokens(api_keys)

    class Handler(JsonHandler):
        server_version = "eaas-attention-client"
        max_body_bytes = MAX_BODY_BYTES
        error_type = ApiError

        def body_error(self, message: str) -> HttpError:
            return ApiError(HTTPStatus.BAD_REQUEST, message, "body")

        def dispatch(self, method: str, path: str) -> None:
            if (
                keys.required
                and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize"))
                and not keys.allows(self.headers.get("Authorization"))
            ):
                self.close_connection = True  # the body (if any) was not read
                raise ApiError(
                    HTTPStatus.UNAUTHORIZED,
                    "a valid API key is required (Authorization: Bearer <key>)",
                    kind="invalid_api_key",
                )
            if (method == "GET" and path == "/healthz") or (method in ("GET", "POST") and path == "/ping"):
                self.send_probe(target.is_healthy(), "ok", "unhealthy")
            elif method == "GET" and path in ("/readyz", "/health"):
                ok, detail = target.readiness()
                self.send_json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, detail)
            elif method == "GET" and path == "/version":
                self.send_json(HTTPStatus.OK, {"version": VERSION})
            elif method == "GET" and path == "/metrics":
                self.send_bytes(HTTPStatus.OK, target.metrics_text(), CONTENT_TYPE_LATEST)
            elif method == "GET" and path == "/v1/models":
                self.send_json(HTTPStatus.OK, target.models())
            elif method == "POST" and path in GENERATION_ROUTES:
                with in_flight.request():
                    answer = getattr(target, GENERATION_ROUTES[path])(self.read_json, self.client_gone)
                    if isinstance(answer, dict):
                        self.send_json(HTTPStatus.OK, answer)
                    else:
                        self.send_event_stream(answer)
            elif method == "POST" and path in ("/tokenize", "/detokenize"):
                self.send_json(
                    HTTPStatus.OK,
                    (target.tokenize if path == "/tokenize" else target.detokenize)(self.read_json),
                )
            elif path in (
                "/healthz",
                "/readyz",
                "/health",
                "/ping",
                "/version",
                "/metrics",
                "/v1/models",
                *GENERATION_ROUTES,
                "/tokenize",
                "/detokenize",
            ):
                raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}")
            else:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")

    return Handler


class ApiServer(BackgroundServer):
    """The HTTP API in a daemon thread (one thread per connection; generation runs in the scheduler)."""

    def __init__(self, target: ApiTarget, host: str, port: int, api_keys: tuple[str, ...] = ()) -> None:
        self.in_flight = InFlight()
        super().__init__(_handler(target, self.in_flight, api_keys), host, port, name="eaas-api")
