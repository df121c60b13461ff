"""``EngineWorker``: the thread that owns the serving ``Engine``, and the requests it serves.

HTTP threads ``submit`` requests (one per choice) and read their tokens as they come
(``Request.events``); the worker thread adds them to the engine between steps, runs one step at
a time while there is work, hands each sampled token to its request, and applies cancellations
(a client that went away) before the next step. While idle it runs ``on_idle`` (placement swaps,
expert-server rejoins) every ``idle_interval_s``; while busy, every ``busy_housekeeping_s``.
Requests beyond ``max_queue`` waiting are refused at once (``QueueFull``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eaas.runtime.serving.batch_scheduler import QueueFull
from eaas.runtime.serving.engine import Engine, StepFailed
from eaas.runtime.serving.sampling import Sampled, SamplingParams, Scored
from eaas.runtime.serving.scheduler import Sequence

log = logging.getLogger("eaas.client.engine")


Events = queue.SimpleQueue[tuple["Request", Sampled | BaseException | None]]


@dataclass(eq=False)
class Request:
    """One sequence to generate. ``events`` (shareable by the choices of one API call) gets
    (request, ``Sampled``) per token, then (request, None) when it finished (``finish_reason``)
    or (request, exception) when it failed."""

    prompt: list[int]
    params: SamplingParams
    index: int = 0  # the choice it answers
    events: Events = field(default_factory=queue.SimpleQueue)
    enqueued_at: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    # The reader's count of ``tokens`` its answer took: a stop string ends an answer while the worker
    # may still step the sequence until it sees the cancellation; the tokens past it are no answer's.
    answered: int = 0
    sampled: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None
    started_at: float | None = None  # first scheduled (the end of its queue time)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seq: Sequence | None = None
    matcher: Any = None  # structured outputs: this choice's own grammar matcher
    # params.prompt_logprobs: the prompt's tokens 1, 2, ... scored (set before its first event)
    prompt_logprobs: list[Scored] | None = None

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)


class EngineWorker:
    def __init__(
        self,
        engine_for: Callable[[], Engine | None],
        max_queue: int,
        on_idle: Callable[[], None] = lambda: None,
        idle_interval_s: float = 0.05,
        busy_housekeeping_s: float = 0.5,
        on_error: Callable[[BaseException], BaseException] = lambda exc: exc,
        on_step: Callable[[int], None] = lambda sequences: None,
        on_token_gap: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self._engine_for = engine_for
        self.max_queue = max_queue
        self._on_idle = on_idle
        self._idle_interval_s = idle_interval_s
        self._busy_housekeeping_s = busy_housekeeping_s
        self.busy_seconds = 0.0  # spent in engine steps since start (the heartbeat's busy fraction)
        self._on_error = on_error
        self._on_step = on_step
        self._on_token_gap = on_token_gap  # seconds between two tokens of a sequence
        self._inbox: list[Request] = []
        self._cancelled: list[Request] = []
        self._live: dict[int, Request] = {}  # sequence id -> request
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eaas-engine", daemon=True)
        self.engine: Engine | None = None

    # --- any thread ------------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        with self._lock:
            waiting = len(self._inbox) + (self.engine.num_waiting if self.engine else 0)
            if waiting + len(requests) > self.max_queue:
                raise QueueFull(
                    f"queue full: {waiting} sequences waiting (max {self.max_queue}); retry later"
                )
            self._inbox.extend(requests)
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """Stops ``request`` and frees its KV cache (a client that disconnected)."""
        with self._lock:
            self._cancelled.append(request)
            self._lock.notify()

    @property
    def queued(self) -> int:
        return len(self._inbox) + (self.engine.num_waiting if self.engine else 0)

    @property
    def running(self) -> int:
        return self.engine.num_running if self.engine else 0

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage if self.engine else 0.0

    @property
    def engine_counters(self) -> tuple[int, int, int]:
        """(queries, hits) of the prefix cache, in tokens, and preemptions so far."""
        engine = self.engine
        if engine is None:
            return 0, 0, 0
        return engine.allocator.queries, engine.allocator.hits, engine.scheduler.preemptions

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # --- the worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        last_housekeeping = 0.0
        while not self._stop.is_set():
            try:
                busy = self.engine is not None and self.engine.has_work()
                now = time.monotonic()
                if not busy or now - last_housekeeping > self._busy_housekeeping_s:
                    self._on_idle()
                    last_housekeeping = now
                    self.engine = self.engine or self._engine_for()
                self._take_new_work()
                if self.engine is not None and self.engine.has_work():
                    started = time.monotonic()
                    self._step(self.engine)
                    self.busy_seconds += time.monotonic() - started
                    continue
                with self._lock:
                    if not self._inbox and not self._cancelled and not self._stop.is_set():
                        self._lock.wait(self._idle_interval_s)
            except Exception:  # never let the worker die
                log.exception("the engine worker's loop failed")
                time.sleep(self._idle_interval_s)
        for request in [*self._live.values(), *self._inbox]:
            self._fail(request, RuntimeError("the attention client is shutting down"))

    def _take_new_work(self) -> None:
        engine = self.engine
        with self._lock:
            cancelled, self._cancelled = self._cancelled, []
            for request in cancelled:  # not started yet: never reaches the engine
                if request in self._inbox:
                    self._inbox.remove(request)
                    self._finish(request, "abort")
            new, self._inbox = (self._inbox, []) if engine is not None else ([], self._inbox)
        for request in cancelled:
            if request.seq is not None and engine is not None and request.seq.id in self._live:
                engine.abort(request.seq)
                self._finish(request, "abort")
        for request in new:
            assert engine is not None
            try:
                request.seq = engine.add(request.prompt, request.params, request.matcher)
            except ValueError as exc:  # the request cannot fit this server's KV cache, or bad ids
                self._fail(request, self._on_error(exc))
                continue
            self._live[request.seq.id] = request

    def _step(self, engine: Engine) -> None:
        try:
            events = engine.step()
        except StepFailed as failure:
            error = self._on_error(failure.cause)
            log.warning("a step of %d sequence(s) failed: %s", len(failure.seqs), failure.cause)
            for seq in failure.seqs:
                request = self._live.get(seq.id)
                if request is not None:
                    self._fail(request, error)
            return
        self._on_step(engine.last_step_sequences)
        now = time.monotonic()
        for request in self._live.values():
            if request.started_at is None and request.seq is not None and request.seq.status != "waiting":
                request.started_at = now
        for event in events:
            request = self._live.get(event.seq.id)
            if request is None:
                continue
            if request.prompt_logprobs is None and event.seq.params.prompt_logprobs is not None:
                request.prompt_logprobs = event.seq.prompt_logprobs  # complete: the prompt is through
            if event.sampled is not None:
                if request.first_token_at is None:
                    request.first_token_at = time.monotonic()
                else:
                    self._on_token_gap(now - request.last_token_at)
                request.last_token_at = now
                request.tokens.append(event.sampled.token)
                request.sampled.append(event.sampled)
                request.events.put((request, event.sampled))
            if event.finished and event.seq.finish_reason == "error":
                # the request's grammar led nowhere (its fault: a 400), or the grammar engine failed
                self._fail(request, self._on_error(ValueError(event.seq.error or "the sequence failed")))
            elif event.finished:
                self._finish(request, event.seq.finish_reason or "length")

    def _finish(self, request: Request, reason: str) -> None:
        if request.seq is not None:
            self._live.pop(request.seq.id, None)
        request.finish_reason = reason
        request.done.set()
        request.events.put((request, None))

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.seq is not None:
            self._live.pop(request.seq.id, None)
        request.error = error
        request.done.set()
        request.events.put((request, error))
