"""The expert server loop: poll slots → batch what is ready → compute → write results → flip flags.

An idle server blocks in the kernel (shm doorbells, tcp sockets: one transport's ``wait``
watches the others' wake-up descriptors), so it costs no CPU and never spins; only ``cuda_ipc``,
whose requests arrive as GPU writes that nothing can wake on, polls its flags. Once a request is
ready the loop waits at most ``batch_wait_s`` for requests of other recently active clients,
then computes whatever it has: a slow or dead client delays others by at most that bound. Every
bad request is answered with an error status; nothing a client sends stops the loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from eaas.runtime.model import ExpertStack
from eaas.runtime.protocol import (
    PAYLOAD_OFFSET,
    FrameKind,
    ProtocolError,
    ServerLimits,
    SlotHeader,
    Status,
    check_experts,
    check_request,
    read_request,
    write_message,
    write_response,
)
from eaas.runtime.server.batch import Job, compute_batch
from eaas.runtime.server.metrics import ServerMetrics
from eaas.runtime.server.stats import LoadCounter
from eaas.runtime.transport import Request, ServerTransport
from eaas.runtime.transport.backoff import reduce_timer_slack_once

log = logging.getLogger("eaas.server")

ACTIVE_CLIENT_WINDOW_S = 1.0  # a client that sent a request this recently is worth waiting for
HOUSEKEEPING_INTERVAL_S = 0.25
NO_WAITER_POLL_S = 50e-6  # polling interval when no transport can wait for all the others
MAX_CONSECUTIVE_FAILURES = 20  # then the loop stops and /healthz turns 503


@dataclass(frozen=True)
class LoopOptions:
    kernel_backend: str = "torch"
    batch_wait_s: float = 200e-6  # longest wait for stragglers once a request is ready
    idle_wait_s: float = 0.05  # longest block between checks of the stop flag when idle
    exit_with_parent: int | None = None  # stop when this parent process goes away


class ServerLoop:
    def __init__(
        self,
        stack: ExpertStack,
        transports: list[ServerTransport],
        limits: ServerLimits,
        metrics: ServerMetrics,
        load: LoadCounter,
        options: LoopOptions,
    ) -> None:
        self.stack = stack
        self.transports = transports
        self.limits = limits
        self.metrics = metrics
        self.load = load
        self.options = options
        self.stop_event = threading.Event()
        self._by_name = {t.name: t for t in transports}
        self._waiter = self._choose_waiter(transports)
        self._last_seen: dict[tuple[str, int], float] = {}
        self._next_housekeeping = 0.0
        self.busy_seconds = 0.0  # time spent serving batches since start (utilisation = its rate)
        self._next_stack: tuple[ExpertStack, ServerLimits, Callable[[], None] | None] | None = None
        self._swap_lock = threading.Lock()

    # --- hosted experts ----------------------------------------------------------------------------
    def swap_stack(
        self, stack: ExpertStack, limits: ServerLimits, on_adopted: Callable[[], None] | None = None
    ) -> None:
        """Serve ``stack`` from the next batch on (any thread). A batch already picked up finishes on
        the stack it was validated against; ``on_adopted`` runs in the loop thread once swapped."""
        with self._swap_lock:
            self._next_stack = (stack, limits, on_adopted)

    def _adopt_next_stack(self) -> None:
        """Called by the loop thread between batches only (never between validation and compute)."""
        if self._next_stack is None:
            return
        with self._swap_lock:
            swap, self._next_stack = self._next_stack, None
        if swap is None:
            return
        self.stack, self.limits, on_adopted = swap
        if on_adopted is not None:
            on_adopted()

    # --- waiting ---------------------------------------------------------------------------------
    @staticmethod
    def _choose_waiter(transports: list[ServerTransport]) -> ServerTransport | None:
        """The transport to block in: alone, or one that watches every other's wake-up descriptor."""
        if len(transports) == 1:
            return transports[0]
        for candidate in transports:
            others = [t.wakeup_fd for t in transports if t is not candidate]
            fds = [fd for fd in others if fd is not None]
            if len(fds) == len(others) and all(candidate.watch(fd) for fd in fds):
                return candidate
        return None

    def _idle_wait(self, timeout_s: float) -> None:
        if self._waiter is not None:
            self._waiter.wait(timeout_s)
        else:  # no transport can wait for all: poll them (a GPU transport cannot be woken)
            time.sleep(min(timeout_s, NO_WAITER_POLL_S))

    def _poll_all(self) -> list[Request]:
        ready: list[Request] = []
        for transport in self.transports:
            ready += transport.poll()
        return ready

    def _gather(self) -> list[Request]:
        """Blocks until at least one request is ready (or stop), then briefly waits for stragglers."""
        requests = self._poll_all()
        while not requests:
            if self.stop_event.is_set():
                return []
            self._housekeeping()
            self._adopt_next_stack()
            self._idle_wait(self.options.idle_wait_s)
            requests = self._poll_all()
        now = time.monotonic()
        expected = sum(1 for seen in self._last_seen.values() if now - seen < ACTIVE_CLIENT_WINDOW_S)
        deadline = now + self.options.batch_wait_s
        while len(requests) < expected and (now := time.monotonic()) < deadline:
            self._idle_wait(deadline - now)
            requests += self._poll_all()
        return requests

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        for transport in self.transports:
            reaped = transport.reap()
            if reaped:
                log.info("released %s slot(s) %s: client gone", transport.name, reaped)
                self.metrics.reaped_slots.labels("client_gone").inc(len(reaped))
                for slot in reaped:
                    self._last_seen.pop((transport.name, slot), None)
            self.metrics.attached_slots.labels(transport.name).set(
                sum(1 for row in transport.slots() if row["state"] != "OFFLINE")
            )
        parent = self.options.exit_with_parent
        if parent is not None and os.getppid() != parent:
            log.warning("parent process %d is gone; stopping", parent)
            self.stop_event.set()

    # --- one step --------------------------------------------------------------------------------
    def run(self) -> None:
        reduce_timer_slack_once()
        failures = 0
        while not self.stop_event.is_set():
            try:
                self.step()
                failures = 0
            except Exception:  # a bug in one step must not kill the server; a persistent one must
                failures += 1
                log.exception("server step failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise
                time.sleep(0.01 * failures)

    def step(self) -> int:
        """Serves one batch; returns the number of requests answered."""
        self._adopt_next_stack()
        self._housekeeping()
        requests = self._gather()
        if not requests:
            return 0
        started = time.perf_counter()
        now = time.monotonic()
        jobs: list[Job] = []
        for request in requests:
            self._last_seen[(request.transport, request.slot)] = now
            try:
                jobs.append(self._validate(request))
            except ProtocolError as exc:
                self._reject(request, exc)
            except Exception as exc:  # a bug: answered all the same, or the slot would wait forever
                log.exception("validating a %s request in slot %d failed", request.transport, request.slot)
                self._reject(request, ProtocolError(Status.INTERNAL, f"validating the request failed: {exc}"))
        if jobs:
            self._compute(jobs)
        elapsed = time.perf_counter() - started
        self.busy_seconds += elapsed
        self.metrics.step_seconds.observe(elapsed)
        return len(requests)

    def _validate(self, request: Request) -> Job:
        header = request.header
        check_request(header, self.limits)
        assert request.payload is not None
        x, ids, weights = read_request(request.payload, header)
        device = self.stack.w13.device
        if x.device != device:  # a host-memory transport in front of experts on a GPU
            x, ids, weights = x.to(device), ids.to(device), weights.to(device)
        groups = check_experts(header.layer, ids, weights, self.stack.group_table)
        return Job(request, x, groups, weights, ids)

    def _compute(self, jobs: list[Job]) -> None:
        try:
            outputs = compute_batch(jobs, self.stack, self.options.kernel_backend)
        except Exception as exc:  # a kernel failure must not take the server down
            log.exception("expert compute failed for a batch of %d request(s)", len(jobs))
            for job in jobs:
                self._reject(job.request, ProtocolError(Status.INTERNAL, f"expert compute failed: {exc}"))
            return
        num_tokens = 0
        for job, y in zip(jobs, outputs, strict=True):
            h = job.request.header
            # Counted before the answer is published (sync-free, also on a GPU): a client that has
            # its answer finds it in /v1/stats. The Prometheus counters below may lag a batch.
            self.load.add(h.layer, job.expert_ids)
            try:
                self._transport(job.request).respond(job.request, partial(_answer, job.request, y))
            except Exception as exc:  # (one answer that cannot be written must not leave the others)
                log.exception("answering a request in slot %d failed", job.request.slot)
                self._reject(job.request, ProtocolError(Status.INTERNAL, f"writing the answer failed: {exc}"))
                continue
            self.metrics.requests.labels(job.request.transport, Status.OK.name).inc()
            num_tokens += h.num_tokens
        entries = sum(int((job.groups >= 0).sum()) for job in jobs)  # after answering: may sync a GPU
        self.metrics.expert_tokens.inc(entries)
        self.metrics.tokens.inc(num_tokens)
        self.metrics.batches.inc()
        self.metrics.batch_tokens.observe(num_tokens)
        self.metrics.batch_requests.observe(len(jobs))

    def _reject(self, request: Request, error: ProtocolError) -> None:
        log.debug("refused a %s request in slot %d: %s", request.transport, request.slot, error)
        try:
            self._transport(request).respond(request, partial(_refusal, request, error))
        except Exception:
            log.exception(
                "answering a %s request in slot %d with an error failed", request.transport, request.slot
            )
            return
        self.metrics.requests.labels(request.transport, error.status.name).inc()

    def _transport(self, request: Request) -> ServerTransport:
        return self._by_name[request.transport]


def _answer(request: Request, y: torch.Tensor) -> SlotHeader:
    """Writes y into the request's slot; its header (``ServerTransport.respond`` calls it, only while
    the request's client still holds the slot)."""
    h = request.header
    assert request.payload is not None
    size = write_response(request.payload, y)
    return SlotHeader(FrameKind.RESPONSE, h.dtype, h.layer, h.num_tokens, h.top_k, h.hidden, h.seq, size)


def _refusal(request: Request, error: ProtocolError) -> SlotHeader:
    """Writes ``error``'s message into the request's slot; its header (as ``_answer``)."""
    h = request.header
    size = write_message(request.slot_buffer[PAYLOAD_OFFSET:], error.message)
    return SlotHeader(
        FrameKind.RESPONSE, h.dtype & 0xFF, h.layer, 0, 0, h.hidden, h.seq, size, status=error.status
    )
