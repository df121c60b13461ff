"""``AttentionService``: the attention client as a long-running HTTP server (what AttentionPool pods run).

    service = AttentionService(checkpoint, placement_file, discovery, ServeOptions(port=8000)).start()
    ...  # POST /v1/completions, GET /v1/models, /healthz, /readyz, /metrics (see ``http_api``)
    service.stop()

Pieces: the attention side of the checkpoint (loaded once), a ``RemoteExperts`` for the current
placement, one worker thread that owns the ``Decoder``, and the HTTP API. With
``batching="continuous"`` (the default) the worker runs the serving ``Engine``: requests join and
leave the running batch between decoder steps, over a paged KV cache (``runtime/serving``), and
their tokens stream back as they are sampled (``completions.py``). ``batching="static"`` keeps the
earlier ``BatchScheduler`` (greedy only), the baseline ``benchmarks/serving.py`` compares with.

Placement: the committed placement is read at start and again every ``placement_poll_s`` from a
:class:`~eaas.runtime.placement.source.PlacementSource`: the placement file, and in Kubernetes a
watch on the placement ConfigMap (whichever is newer; never an older placement than one read). It
may be missing at first (the operator commits the first placement once every expert server is
ready); until one is read the service answers 503. When it changes, a new ``RemoteExperts``
is built and connected beside the old one and swapped in between two batches (a batch in flight
finishes on the placement it started with); the old one's slots are then released. Before the
first placement is published, and so before ``/readyz`` says ready, the paged KV cache is
allocated and one short generation warms the model and the expert servers (``_warm_up``): a new
pod's first requests wait for neither.

Discovery: expert-server URLs come from an explicit ``{ordinal: url}`` map, or from the headless
Service of the expert pool: ordinal ``n`` of pool ``p`` is ``http://p-n.<service>:<port>``
(``expert_urls``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from eaas.runtime.client.errors import ExpertUnavailable, HandshakeError
from eaas.runtime.client.remote_experts import ClientOptions, RemoteExperts
from eaas.runtime.contract import PLACEMENT_KEY
from eaas.runtime.model import AttentionSide, CheckpointReader, Decoder
from eaas.runtime.model.tokenizer import chat_template, load_tokenizer, special_tokens
from eaas.runtime.placement import Placement, PlacementError, stored
from eaas.runtime.placement.source import MountedFiles, PlacementSource
from eaas.runtime.serving import responses
from eaas.runtime.serving.batch_scheduler import BatchScheduler, Job, QueueFull
from eaas.runtime.serving.chat import ChatTemplate, parse_chat, parse_messages
from eaas.runtime.serving.completions import Completions, result_of
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.engine_worker import EngineWorker
from eaas.runtime.serving.grammar import Grammars, Markers
from eaas.runtime.serving.http_api import (
    ApiError,
    ApiServer,
    CompletionRequest,
    Limits,
    apply_stop,
    bad,
    overloaded,
    parse_completion,
    unknown_model,
)
from eaas.runtime.serving.metrics import AttentionMetrics
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.reasoning import reasoning_style
from eaas.runtime.serving.response_output import response_events, response_object
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.text_stream import token_bytes
from eaas.runtime.serving.tools import parse_tools, tool_format
from eaas.runtime.transport import RemoteError

log = logging.getLogger("eaas.client.serve")

_WARM_UP_PROMPT = 16  # tokens: a prefill step and a decode step, routed to most experts

Discovery = Callable[[Placement], dict[int, str]]  # placement -> {ordinal: control-port URL}


def expert_urls(ordinals: tuple[int, ...] | list[int], expert_service: str, port: int) -> dict[int, str]:
    """URLs of the expert servers behind headless Service ``expert_service`` (``<pool>.<ns>.svc``).

    The operator names expert-server pods ``<pool>-<ordinal>`` and their headless Service
    ``<pool>``, so pod ``n`` resolves as ``<pool>-<n>.<pool>.<ns>.svc``.
    """
    service = expert_service.strip().rstrip(".")
    pool = service.split(".", 1)[0]
    if not pool:
        raise ValueError(f"expert service: expected <pool>[.<namespace>.svc], got {expert_service!r}")
    return {ordinal: f"http://{pool}-{ordinal}.{service}:{port}" for ordinal in ordinals}


def static_discovery(servers: Mapping[int, str]) -> Discovery:
    return lambda placement: dict(servers)


def dns_discovery(expert_service: str, port: int) -> Discovery:
    expert_urls([], expert_service, port)  # validates the name now
    return lambda placement: expert_urls(placement.ordinals, expert_service, port)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    model_name: str = "eaas"
    model_revision: str | None = None  # the checkpoint's revision, named in every answer (system_fingerprint)
    api_keys: tuple[str, ...] = ()  # accepted bearer keys of /v1/ (empty: no authentication)
    max_batch_size: int = 16  # sequences generated together
    max_batch_tokens: int = 8192  # prompt + new tokens of one batch (at least one sequence always runs)
    max_queue: int = 64  # sequences waiting; more are refused with 503
    max_tokens: int = 1024  # most new tokens one request may ask for
    default_max_tokens: int | None = None  # a chat request naming none: None = the rest of the context
    batching: str = "continuous"  # or "static": one generate() call per batch (the baseline)
    kv_cache_bytes: int = 256 << 20  # continuous: the paged KV cache
    prefix_caching: bool = True  # continuous: reuse the KV blocks of shared prefixes
    micro_batches: int | str = 1  # continuous: micro-batches per step (1, 2, 3 or "auto"; ``micro_batches``)
    block_size: int = 16  # continuous: positions per KV block
    attention: str = "paged"  # how attention reads the cache (``attention.PATHS``; reference: the oracle)
    request_timeout_s: float = 300.0  # a request still unanswered after this gets 504
    placement_poll_s: float = 1.0
    tool_call_parser: str | None = None  # the format of the model's tool calls (None: by its family)
    reasoning_parser: str | None = None  # how its thinking is marked (None: by its family; "none")
    # A reasoning model's grammar (structured outputs, a required call) from its first token, not
    # from the end of its thinking (vLLM's structured-outputs enable_in_reasoning)
    structured_outputs_in_reasoning: bool = False
    client: ClientOptions = field(default_factory=lambda: ClientOptions(transport="tcp"))


class AttentionService:
    def __init__(
        self,
        checkpoint: str | Path,
        placement: str | Path | PlacementSource,
        discovery: Discovery,
        options: ServeOptions | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`placement`: the committed placement's file (re-read when it changes), or a source that
        also watches the placement ConfigMap (started and stopped with the service)."""
        self.options = options or ServeOptions()
        if not isinstance(placement, PlacementSource):
            placement = PlacementSource(MountedFiles(Path(placement)))
        self.source = placement
        self.discovery = discovery
        reader = CheckpointReader(checkpoint)
        self.config = reader.config
        self.tokenizer = load_tokenizer(checkpoint, self.config.vocab_size)
        self.tool_format = tool_format(self.options.tool_call_parser, self.config.family, self.tokenizer)
        self.reasoning = reasoning_style(self.options.reasoning_parser, self.config.family)
        if (
            self.tool_format is not None
            and self.tool_format.name == "harmony"
            and (self.reasoning is None or self.reasoning.name != "harmony")
        ):
            # it reads the calls the harmony reasoning parser takes out of gpt-oss's channels
            if self.options.tool_call_parser not in (None, "", "auto"):
                raise ValueError("tool-call-parser harmony needs reasoning-parser harmony")
            log.warning("no tool calls: the harmony format needs --reasoning-parser harmony")
            self.tool_format = None  # chosen by the family only: tools get a 400 that says why
        # the markers the formats read decode to their text, and grammars write them as tokens
        formats = (self.tool_format, self.reasoning)
        self.tokenizer.keep(m for form in formats if form is not None for m in form.markers)
        self.markers = Markers(self.tokenizer)
        self.chat_template = ChatTemplate(chat_template(checkpoint), special_tokens(checkpoint))
        self.side = AttentionSide.from_checkpoint(reader, dtype=dtype, attention=self.options.attention)
        o = self.options
        context = self.config.max_position_embeddings
        # One sequence holds no more positions than the KV cache has; a cache that holds no block is
        # refused here, not when the first placement makes the engine.
        if o.batching == "continuous":
            blocks = Engine.pool_blocks(self.config, self._engine_options(o.kv_cache_bytes), self.side.dtype)
            context = min(context, blocks * o.block_size)
        self.limits = Limits(
            self.config.vocab_size, context, min(o.max_tokens, context - 1), o.default_max_tokens
        )
        self.decoder: Decoder | None = None  # owned by the scheduler's worker thread
        self.engine: Engine | None = None  # continuous batching: the worker's, over the decoder
        self.experts: RemoteExperts | None = None
        self._counts_before = (0, 0)  # failovers and rejoins of the placements swapped out
        self.placement: Placement | None = None
        self.leaving_since: float | None = None  # monotonic time of SIGTERM (:meth:`begin_leaving`)
        self.placement_error = "no placement read yet"
        self._placement_text: bytes | None = None
        self._next: tuple[Placement, RemoteExperts] | None = None  # prepared, swapped in by the worker
        # the experts of the last step and their expert seconds then (``_on_step``)
        self._stepped: tuple[RemoteExperts | None, float] = (None, 0.0)
        self.expert_wait: tuple[float, int] = (0.0, 0)  # every step's expert seconds, and steps (the Lease)
        # Called when the servers routed around change (a failover, a rejoin, a new placement):
        # the heartbeat renews at once with :meth:`failed_servers`.
        self.on_liveness: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.metrics = AttentionMetrics(o.model_name)
        if o.batching not in ("continuous", "static"):
            raise ValueError(f"batching: must be 'continuous' or 'static', got {o.batching!r}")
        self.worker: EngineWorker | None = None
        self.scheduler: BatchScheduler | None = None
        self.completions: Completions | None = None
        if o.batching == "continuous":
            self.worker = EngineWorker(
                self._engine_for,
                o.max_queue,
                on_idle=self._housekeeping,
                on_error=_api_error,
                on_step=self._on_step,
                on_token_gap=self.metrics.inter_token_latency.observe,
            )
            self.completions = Completions(
                self.worker,
                self.tokenizer.decode,
                o.model_name,
                o.request_timeout_s,
                self.metrics,
                _api_error,
                Grammars(self.tokenizer, self.config.vocab_size),
                self.reasoning,
                o.model_revision,
                token_bytes(self.tokenizer),
            )
        else:
            self.scheduler = BatchScheduler(
                self._generate,
                max_batch_size=o.max_batch_size,
                max_batch_tokens=o.max_batch_tokens,
                max_queue=o.max_queue,
                on_idle=self._housekeeping,
                on_batch=self.metrics.batch_sequences.observe,
            )
        self.metrics.bind(
            self._queued,
            lambda: float(self.readiness()[0]),
            lambda: len(self.experts.live_servers) if self.experts is not None else 0,
            running=lambda: self.worker.running if self.worker else 0,
            kv_cache_usage=lambda: self.worker.kv_usage if self.worker else 0.0,
            engine=lambda: self.worker.engine_counters if self.worker else (0, 0, 0),
            failovers=self._failover_counts,
        )
        if any(not key.strip() for key in o.api_keys):
            raise ValueError("api_keys: keys must not be empty")
        self.api = ApiServer(self, o.host, o.port, o.api_keys)
        self.port = self.api.port
        self._watcher = threading.Thread(target=self._watch_placement, name="eaas-placement", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"http://{host}:{self.port}"

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> AttentionService:
        self.source.start()
        self._poll_placement()
        self._housekeeping()  # install the first placement before serving
        self._runner.start()
        self._watcher.start()
        self.api.start()
        log.info("attention client serving %s on %s", self.options.model_name, self.url)
        return self

    def begin_leaving(self) -> None:
        """SIGTERM: report not ready (Kubernetes takes the pod out of the Service) and answer on;
        requests still arriving through a stale endpoint are served too (see :meth:`idle`)."""
        if self.leaving_since is None:
            self.leaving_since = time.monotonic()
            log.info("leaving: not ready any more; finishing the requests in flight")

    def idle(self) -> bool:
        """No request being answered, queued or generating."""
        return self.api.in_flight.count == 0 and self._queued() == 0 and self._running() == 0

    def _running(self) -> int:
        return self.worker.running if self.worker is not None else 0

    def stop(self) -> None:
        self._stop.set()
        self.source.wake()
        self.api.stop()
        self._runner.stop()
        if self._watcher.is_alive():
            self._watcher.join(timeout=5)
        self.source.stop()
        with self._lock:
            pending, self._next = self._next, None
        for experts in (pending[1] if pending else None, self.experts):
            if experts is not None:
                experts.close()

    def __enter__(self) -> AttentionService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- placement -------------------------------------------------------------------------------
    def _watch_placement(self) -> None:
        while not self._stop.is_set():
            self.source.wait(self.options.placement_poll_s)  # a watched change ends it at once
            if self._stop.is_set():
                break
            try:
                self._poll_placement()
            except Exception:  # never let the watcher die
                log.exception("reading the placement failed")

    def _poll_placement(self) -> None:
        """Reads the committed placement (:attr:`source`); a changed one gets connected
        ``RemoteExperts`` for the worker."""
        texts = self.source.read()
        text = texts.committed
        if text is None:
            if self.placement is None:
                self.placement_error = f"{texts.origin}: no {PLACEMENT_KEY} yet"
            return
        if text == self._placement_text:
            return
        self._placement_text = text
        try:
            placement = stored.unpack(text)
            client_options = replace(self.options.client, client_id=f"attention-{uuid.uuid4().hex[:8]}")
            experts = RemoteExperts(self.config, placement, self.discovery(placement), client_options)
        except (PlacementError, ValueError) as exc:
            self.placement_error = f"{texts.origin} {PLACEMENT_KEY}: {exc}"
            log.error("%s; keeping the current placement", self.placement_error)
            return
        experts.on_liveness = self._liveness_changed
        experts.connect(require_all=False)  # unreachable servers start dead and rejoin when they answer
        log.info(
            "placement version %s read; %d of %d expert servers connected",
            placement.version,
            len(experts.live_servers),
            len(placement.ordinals),
        )
        with self._lock:
            stale, self._next = self._next, (placement, experts)
        if stale is not None:
            stale[1].close()

    def failed_servers(self) -> tuple[int, ...]:
        """The expert servers of the placement served now that it routes around (any thread)."""
        experts = self.experts
        return experts.failed_servers if experts is not None else ()

    def _liveness_changed(self) -> None:
        if self.on_liveness is not None:
            self.on_liveness()

    def _failover_counts(self) -> tuple[int, int]:
        """Failovers and rejoins since start: of every placement's ``RemoteExperts`` so far."""
        with self._lock:
            failovers, rejoins = self._counts_before
            if self.experts is not None:
                failovers += self.experts.counters.failovers
                rejoins += self.experts.counters.rejoins
            return failovers, rejoins

    def _on_step(self, sequences: int) -> None:
        """After each decoder step (worker thread): its batch and the time it spent on the experts.
        Experts are swapped only between steps, and a new ``RemoteExperts`` counts from 0."""
        self.metrics.batch_sequences.observe(sequences)
        experts = self.experts
        if experts is None:
            return
        last, before = self._stepped
        total = experts.counters.expert_seconds
        spent = total - (before if experts is last else 0.0)
        self.metrics.step_expert_seconds.observe(spent)
        self._stepped = (experts, total)
        seconds, steps = self.expert_wait
        self.expert_wait = (seconds + spent, steps + 1)  # one tuple: a reader never sees half of it

    def _housekeeping(self) -> None:
        """On the worker thread between batches: swap in a new placement, apply server rejoins."""
        with self._lock:
            ready, self._next = self._next, None
        if ready is not None:
            placement, experts = ready
            old = self.experts
            if self.decoder is None:
                # All a first request would otherwise wait for, made before the placement is
                # published (so before the pod reports ready): the KV pool, the first forward.
                self.decoder = Decoder(self.side, experts)
                if self.worker is not None:
                    self.engine = Engine(self.decoder, self._engine_options(self.options.kv_cache_bytes))
                self._warm_up(self.decoder)
                self._stepped = (experts, experts.counters.expert_seconds)  # the steps' own from here
            else:
                self.decoder.experts = experts
            with self._lock:  # the counters stay monotonic across the swap (``_failover_counts``)
                if old is not None:
                    failovers, rejoins = self._counts_before
                    self._counts_before = (failovers + old.counters.failovers, rejoins + old.counters.rejoins)
                self.experts, self.placement = experts, placement
            self.placement_error = ""
            self._liveness_changed()
            if old is not None:  # channels closed here; the slots released off the worker (round trips)
                slots = old.close_channels()
                threading.Thread(
                    target=RemoteExperts.release, args=(slots,), name="eaas-release-slots", daemon=True
                ).start()
        if self.experts is not None:
            self.experts.refresh()

    def _warm_up(self, decoder: Decoder) -> None:
        """One short generation through a throwaway engine before the first placement is served
        (so before the pod reports ready): the first forward of a process pays for torch's first
        calls, the pages of the weights and the expert servers' first requests from this client,
        and without it the first requests a new pod takes wait for that. Best effort: a failure
        (an expert server down) is logged, and the requests then pay for it as before."""
        started = time.monotonic()
        vocab = self.config.vocab_size
        prompt = [i % vocab for i in range(_WARM_UP_PROMPT)]
        try:  # its own engine, so the worker's starts with an empty cache and counters at 0
            blocks = -(-(len(prompt) + 2) // self.options.block_size)
            per_block = KVPool.bytes_per_block(self.config, self.options.block_size, decoder.side.dtype)
            engine = Engine(decoder, self._engine_options(blocks * per_block))
            engine.add(prompt, SamplingParams(max_tokens=2))
            while engine.has_work():
                engine.step()
        except Exception as exc:
            log.warning("warm-up failed after %.2f s: %s", time.monotonic() - started, exc)
            return
        seconds = time.monotonic() - started
        log.info("warm-up: %d tokens through the model and its experts in %.2f s", len(prompt) + 1, seconds)

    # --- the ApiTarget ---------------------------------------------------------------------------
    @property
    def _runner(self) -> EngineWorker | BatchScheduler:
        runner = self.worker or self.scheduler
        assert runner is not None
        return runner

    def _queued(self) -> float:
        return self._runner.queued

    def is_healthy(self) -> bool:
        return self._runner.is_running and not self._stop.is_set()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        experts, placement = self.experts, self.placement
        if self.leaving_since is not None:
            return False, {"ready": False, "reason": "leaving (SIGTERM): finishing the requests in flight"}
        if experts is None or placement is None:
            return False, {"ready": False, "reason": self.placement_error}
        live = experts.live.clone()
        unserved = experts.table.unserved(live)
        live_servers = [o for o, alive in zip(experts.table.ordinals, live.tolist(), strict=True) if alive]
        down = [o for o in experts.table.ordinals if o not in live_servers]
        ok = not unserved and self.is_healthy()
        detail: dict[str, Any] = {
            "ready": ok,
            "placement_version": placement.version,
            "live_servers": live_servers,
            "down_servers": down,
            "unserved_experts": len(unserved),
        }
        if not self.is_healthy():
            detail["reason"] = "the engine worker is not running (see this process's log)"
        elif unserved:
            layer, expert = unserved[0]
            detail["reason"] = (
                f"{len(unserved)} (layer, expert) pair(s) have no connected expert server, "
                f"e.g. (layer {layer}, expert {expert}); down: {down}"
            )
        return ok, detail

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.options.model_name, "object": "model", "created": 0, "owned_by": "eaas"}],
        }

    def complete(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        return self._answer(read_body, chat=False, gone=gone)

    def chat(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        return self._answer(read_body, chat=True, gone=gone)

    def responses(
        self, read_body: Callable[[], Any], gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI's Responses API: the request as a chat request (``responses.py``), its answer
        as a Response or its events (``response_output.py``)."""
        body: dict[str, Any] = {}

        def read_chat_body() -> dict[str, Any]:
            nonlocal body
            body = read_body()
            return responses.chat_body(body)

        try:
            answer = self._answer(read_chat_body, chat=True, gone=gone)
        except ApiError as exc:
            raise responses.renamed(exc) from None
        if isinstance(answer, dict):
            return response_object(body, answer)
        return response_events(body, answer, self.options.model_name)

    def tokenize(self, read_body: Callable[[], Any]) -> dict[str, Any]:
        body = read_body()
        if not isinstance(body, dict):
            raise bad("body", "must be a JSON object")
        self._check_model(body.get("model"))
        if ("prompt" in body) == ("messages" in body):
            raise bad("prompt", "give either prompt (a string) or messages")
        if "messages" in body:
            tools = parse_tools(body)
            text = self.chat_template.render(parse_messages(body["messages"]), tools.tools if tools else None)
        elif isinstance(body["prompt"], str):
            text = body["prompt"]
        else:
            raise bad("prompt", "must be a string")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise bad("add_special_tokens", f"must be true or false, got {special!r}")
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        if not special and bos is not None and ids[:1] == [bos]:
            ids = ids[1:]
        return {"count": len(ids), "max_model_len": self.limits.max_context, "tokens": ids}

    def detokenize(self, read_body: Callable[[], Any]) -> dict[str, Any]:
        body = read_body()
        if not isinstance(body, dict):
            raise bad("body", "must be a JSON object")
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = self.config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad("tokens", f"must be a list of token ids in [0, {vocab})")
        return {"prompt": self.tokenizer.decode(tokens)}

    def _check_model(self, model: Any) -> None:
        if model is not None and not isinstance(model, str):
            raise bad("model", "must be a string")
        if model is not None and model != self.options.model_name:
            raise unknown_model(model, self.options.model_name)

    def _answer(
        self, read_body: Callable[[], Any], chat: bool, gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        start = time.monotonic()
        try:
            body, encode = read_body(), self.tokenizer.encode
            if chat:
                call = parse_chat(
                    body, self.limits, self.chat_template, encode, self.tool_format, self.markers
                )[0]
                thinking = self.reasoning if self.completions is not None else None
                in_reasoning = self.options.structured_outputs_in_reasoning or not call.thinking
                if call.constraint and thinking and not in_reasoning:
                    call = replace(call, constraint=thinking.answer_grammar(call.constraint, self.markers))
            else:
                call = parse_completion(body, self.limits, encode)
            if self.tokenizer.eos_token_ids and not (isinstance(body, dict) and body.get("ignore_eos")):
                stop_ids = tuple(sorted({*call.params.stop_token_ids, *self.tokenizer.eos_token_ids}))
                call = replace(call, params=replace(call.params, stop_token_ids=stop_ids))
            self._check_model(call.model)
            if self.experts is None:
                raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: {self.placement_error}")
            if self.completions is None:
                if chat:
                    raise bad("batching", "static batching serves /v1/completions only")
                if call.constraint is not None:
                    raise bad(call.constraint.field, "static batching has no structured outputs")
                return self._complete_static(call, start)
            requests = self.completions.submit(call)
        except ApiError as exc:
            self.metrics.requests.labels(result=result_of(exc)).inc()
            self.metrics.request_seconds.observe(time.monotonic() - start)
            raise
        except Exception:
            self.metrics.requests.labels(result="error").inc()
            raise
        if chat:
            if call.stream:
                return self.completions.chat_chunks(call, requests, start, gone)
            return self.completions.chat_collect(call, requests, start, gone)
        if call.stream:
            return self.completions.chunks(call, requests, start, gone=gone)
        return self.completions.collect(call, requests, start, gone=gone)

    def _complete_static(self, request: CompletionRequest, start: float) -> dict[str, Any]:
        """The static-batching baseline: greedy, whole answers, one choice per prompt."""
        assert self.scheduler is not None
        p = request.params
        if not p.greedy or request.stream or request.n != 1 or p.logprobs is not None or request.echo:
            raise bad("batching", "static batching serves greedy (temperature 0), non-streaming, n=1 only")
        # What the baseline cannot do is refused, never ignored.
        for name, value in (
            ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty),
            ("min_tokens", p.min_tokens),
            ("include_stop_str_in_output", request.include_stop),
            ("skip_special_tokens", not request.skip_special_tokens),
        ):
            if value:
                raise bad(
                    name, "static batching has no such option (start the server with continuous batching)"
                )
        if p.prompt_logprobs is not None:
            raise bad(
                "prompt_logprobs", "static batching scores no prompts (start it with continuous batching)"
            )
        name = self.options.model_name
        jobs = [Job(prompt, request.max_tokens) for prompt in request.prompts]
        try:
            self.scheduler.submit(jobs)
        except QueueFull as exc:
            raise overloaded(str(exc)) from exc
        deadline = start + self.options.request_timeout_s
        for job in jobs:
            if not job.done.wait(max(0.0, deadline - time.monotonic())):
                raise ApiError(
                    HTTPStatus.GATEWAY_TIMEOUT,
                    f"no answer within {self.options.request_timeout_s:.0f} s",
                    kind="timeout",
                )
            if job.error is not None:
                raise _api_error(job.error)
        choices = []
        completion_tokens = 0
        for index, job in enumerate(jobs):
            assert job.tokens is not None
            tokens, text, stopped = self._finish(job.tokens, request.stop)
            completion_tokens += len(tokens)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "token_ids": tokens,  # extension: the byte tokenizer drops ids >= 256 from text
                    "logprobs": None,
                    "finish_reason": "stop" if stopped else "length",
                }
            )
        prompt_tokens = sum(len(p) for p in request.prompts)
        self.metrics.requests.labels(result="ok").inc()
        self.metrics.request_seconds.observe(time.monotonic() - start)
        self.metrics.generated_tokens.inc(completion_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            **({"system_fingerprint": self.options.model_revision} if self.options.model_revision else {}),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _finish(self, tokens: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
        """Tokens up to and including the first stop string, the text before it, and whether it stopped."""
        if stops:
            for end in range(1, len(tokens) + 1):
                text, stopped = apply_stop(self.tokenizer.decode(tokens[:end]), stops)
                if stopped:
                    return tokens[:end], text, True
        return tokens, self.tokenizer.decode(tokens), False

    def _engine_for(self) -> Engine | None:
        """The worker's engine, once the first placement made one (``_housekeeping``)."""
        return self.engine

    def _engine_options(self, kv_cache_bytes: int) -> EngineOptions:
        o = self.options
        return EngineOptions(
            kv_cache_bytes=kv_cache_bytes,
            block_size=o.block_size,
            max_batch_tokens=o.max_batch_tokens,
            max_seqs=o.max_batch_size,
            prefix_caching=o.prefix_caching,
            micro_batches=o.micro_batches,
        )

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if self.decoder is None:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: {self.placement_error}")
        generated, _ = self.decoder.generate(prompts, max_new_tokens)
        return generated


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ExpertUnavailable | HandshakeError):
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), kind="unavailable")
    if isinstance(exc, RemoteError):
        return ApiError(HTTPStatus.BAD_GATEWAY, f"an expert server refused the request: {exc}")
    if isinstance(
        exc, ValueError
    ):  # the engine refused the request itself ("max_tokens: ...", "prompt: ...")
        param = str(exc).split(":", 1)[0]
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc), param if param.isidentifier() else None)
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed: {exc}")
