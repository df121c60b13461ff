"""The serving mode's batch scheduler: concurrent requests share one ``Decoder.generate`` call.

Requests wait in a bounded FIFO queue. One worker thread owns the decoder; whenever it is free it
admits the oldest waiting sequences (up to ``max_batch_size`` sequences and ``max_batch_tokens``
prompt + new tokens) and generates them together as one batch: every decoder step (prefill, then
one token per step) runs all of them at once, so each MoE layer sends one request per expert
server for the whole batch. The batch runs ``max(max_new_tokens)`` steps; a shorter request keeps
the first ``max_new_tokens`` of its tokens (greedy generation of a sequence does not depend on the
other rows of its batch, so its answer is exactly what it would get alone). Sequences that arrive
while a batch runs wait for the next one (batching between ``generate`` calls, not within them).

A full queue refuses new work at once (``QueueFull``); a failing batch fails only its own
requests. While idle, the worker runs ``on_idle`` every ``idle_interval_s`` (the service uses it to
apply expert-server rejoins and placement changes on the decoder's own thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("eaas.client.scheduler")

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, max_new_tokens) -> tokens


class QueueFull(RuntimeError):
    """The request queue holds ``max_queue`` sequences already."""


@dataclass
class Job:
    """One prompt to complete; ``done`` is set once ``tokens`` or ``error`` is filled in."""

    prompt: list[int]
    max_new_tokens: int
    enqueued_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] | None = None
    error: BaseException | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens


def take_batch(waiting: deque[Job], max_batch_size: int, max_batch_tokens: int) -> list[Job]:
    """Pops the oldest sequences that fit one batch (always at least one, so none starves)."""
    batch: list[Job] = []
    tokens = 0
    while waiting and len(batch) < max_batch_size:
        candidate = waiting[0]
        if batch and tokens + candidate.num_tokens > max_batch_tokens:
            break
        batch.append(waiting.popleft())
        tokens += candidate.num_tokens
    return batch


class BatchScheduler:
    def __init__(
        self,
        generate: GenerateFn,
        max_batch_size: int = 16,
        max_batch_tokens: int = 8192,
        max_queue: int = 64,
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = 0.1,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size, max_batch_tokens and max_queue must be >= 1")
        self.generate = generate
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.on_idle = on_idle
        self.on_batch = on_batch
        self.idle_interval_s = idle_interval_s
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="eaas-batch-scheduler", daemon=True)

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> BatchScheduler:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the running batch; sequences still waiting fail with ``RuntimeError``."""
        with self._cond:
            self._stopped = True
            left = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for seq in left:
            seq.error = RuntimeError("the server is shutting down")
            seq.done.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queues all of ``jobs`` or none (``QueueFull``)."""
        with self._cond:
            if self._stopped:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(
                    f"request queue full ({len(self._waiting)} of {self.max_queue} sequences waiting); "
                    "retry later"
                )
            self._waiting.extend(jobs)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._waiting and not self._stopped:
                    self._cond.wait(self.idle_interval_s)
                if self._stopped:
                    return
                batch = take_batch(self._waiting, self.max_batch_size, self.max_batch_tokens)
            if not batch:
                self._idle()
                continue
            self._generate(batch)

    def _idle(self) -> None:
        if self.on_idle is None:
            return
        try:
            self.on_idle()
        except Exception:  # housekeeping must never stop the worker
            log.exception("idle housekeeping failed")

    def _generate(self, batch: list[Job]) -> None:
        steps = max(seq.max_new_tokens for seq in batch)
        if self.on_batch is not None:
            self.on_batch(len(batch))
        try:
            self._idle()  # rejoins and placement changes land between batches
            generated = self.generate([seq.prompt for seq in batch], steps)
        except Exception as exc:
            log.warning("batch of %d sequence(s) failed: %s", len(batch), exc)
            for seq in batch:
                seq.error = exc
                seq.done.set()
            return
        for seq, tokens in zip(batch, generated, strict=True):
            seq.tokens = tokens[: seq.max_new_tokens]
            seq.done.set()
