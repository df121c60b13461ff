"""``RemoteExperts``: the attention client's ``MoEExecutor`` — routed experts on remote expert servers.

For one MoE layer: pick a live replica for every (token, expert) entry (``RoutingTable``), send
each server its tokens once with the expert ids it should apply, wait for all servers in
parallel, and sum the partial results.

Micro-batches: ``submit`` starts a layer's exchange and returns a ``Ticket``; ``wait`` gives its
answer (calling the executor is both at once). Several tickets may be in flight, so the decoder
runs one micro-batch's attention while another's experts compute. Each server's slot carries one
request of this client at a time: a ticket's chunk for a busy server waits its turn (tickets in
submission order), and every ``submit`` and ``wait`` takes the answers that are there and sends
what is due, for all tickets. One thread drives it (the decoding thread); the rejoin and probe
threads only hand it channels and answers.

Failover: a server that closes its connection, dies or hangs is marked dead; the entries it
owed (in flight or still queued, for every ticket) are re-routed to live replicas of the same
experts and sent again once that ticket's round is back, so each is resent once and none is
summed twice: the layer's answer is the same. A background thread re-attaches dead servers
(exponential backoff); a server that answers the handshake again rejoins the routing table at the
next ``submit``. With no
live replica left for an expert, the layer waits up to ``unavailable_wait_s`` for one to rejoin
(servers that only freed this client's slots, after it hung past its Lease, answer within
``rejoin_min_s``), then ``ExpertUnavailable`` names the layer and expert.

A hang is told from slowness by asking: each server's round trips are smoothed as TCP smooths
them (RFC 6298: ``srtt``, ``rttvar``). A request unanswered for ``max(suspect_floor_s, srtt + 4 ×
rttvar)`` gets the server's ``/healthz`` probed (``probe_timeout_s``, off the waiting thread). A
server that does not answer its probe is failed now, about ``suspect + probe timeout`` after the
send (well under a second at the defaults for a server that answered in milliseconds before);
one that answers is slow, not gone, and is asked again after twice as long, up to
``request_timeout_s``, the bound for a server that answers probes but not requests.
Legend: T = tokens, K = top-k, H = hidden, S = servers.
"""

from __future__ import annotations

import logging
import select
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from eaas.runtime.auth import Tokens
from eaas.runtime.client.connection import Expected, ServerConnection
from eaas.runtime.client.errors import ExpertUnavailable, HandshakeError
from eaas.runtime.client.routing import RoutingTable, Share
from eaas.runtime.model import MoEConfig
from eaas.runtime.placement import Placement
from eaas.runtime.transport import Channel, ChannelError, RemoteError
from eaas.runtime.transport.polling import pause

log = logging.getLogger("eaas.client")

WAIT_SLICE_S = 0.02  # longest block while waiting on servers (their liveness is checked between)
SLOW_ANSWER_S = 0.25  # an answer later than this is logged (at most once a second per server)


@dataclass(frozen=True)
class ClientOptions:
    transport: str = "shm"
    request_timeout_s: float = 30.0  # a server that answers probes but not a request: failed after this
    suspect_floor_s: float = 0.25  # unanswered past max(this, srtt + 4 rttvar): probe the server
    probe_timeout_s: float = 0.5  # a probe unanswered this long: the server is hung, fail it over
    connect_timeout_s: float = 2.0
    rejoin_min_s: float = 0.2  # first re-handshake delay after a failure (doubles up to rejoin_max_s)
    rejoin_max_s: float = 5.0
    unavailable_wait_s: float = 2.0  # an expert with no live replica: wait this long for one to rejoin
    spread_threshold: int = 32  # an expert with more tokens than this in a batch is split over replicas
    data_tokens: Tokens = field(default_factory=Tokens)  # the first is presented at every slot handshake
    client_id: str = field(default_factory=lambda: f"client-{uuid.uuid4().hex[:8]}")
    lease: str | None = (
        None  # this client's Lease (in the servers' namespace): slots are freed when it expires
    )
    revision: str | None = None  # the checkpoint's revision: servers of another one are refused


@dataclass(frozen=True)
class FailoverEvent:
    at: float  # time.time()
    kind: str  # "failed", "resent" or "rejoined"
    server: int  # ordinal
    detail: str
    layer: int = -1
    resent_entries: int = 0


@dataclass
class RoundTrip:
    """One server's smoothed round-trip time (RFC 6298's estimator, in seconds)."""

    srtt: float = 0.0
    rttvar: float = 0.0
    samples: int = 0

    def observe(self, seconds: float) -> None:
        if not self.samples:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds
        self.samples += 1

    def suspect_after(self, floor_s: float) -> float:
        """How long an answer may take before the server is probed (1 s before any sample)."""
        return max(floor_s, self.srtt + 4 * self.rttvar) if self.samples else max(floor_s, 1.0)


@dataclass
class ClientCounters:
    requests: int = 0
    tokens_sent: int = 0
    failovers: int = 0
    resent_entries: int = 0
    rejoins: int = 0
    probes: int = 0  # liveness probes of servers slower than their usual round trip
    expert_seconds: float = 0.0  # wall time in MoE layers' expert calls: dispatch, wait, combine, failover


@dataclass(eq=False)
class Ticket:
    """One MoE layer's exchange in flight (:meth:`RemoteExperts.submit`): what is owed, what came back."""

    layer: int
    x: torch.Tensor  # [T, H]
    weights: torch.Tensor  # [T, K] float32
    todo: torch.Tensor  # [T, K] int64 on the host: the entries routed this round (-1: none)
    out: torch.Tensor  # [T, H] float32: the partial results summed so far
    assignment: torch.Tensor | None = None  # [T, K] the server index of each entry this round
    queues: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # chunks to send
    failed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # server -> rows it owes again
    needs_route: bool = False  # an expert had no live replica when it was (re)routed
    give_up_at: float | None = None  # while an expert has no live replica: until rejoins are awaited
    error: RemoteError | None = None


@dataclass(eq=False)
class Flight:
    """The one request of this client a server holds (its slot carries one at a time)."""

    ticket: Ticket
    rows: torch.Tensor  # [T_s] the ticket's rows it answers for
    sent_at: float
    deadline: float
    check_at: float  # past this, unanswered: the server is probed
    probe: Future[str | None] | None = None


class RemoteExperts:
    def __init__(
        self,
        config: MoEConfig,
        placement: Placement,
        servers: Mapping[int, str],
        options: ClientOptions | None = None,
    ) -> None:
        if list(placement.layers) != config.moe_layers or placement.num_experts != config.num_experts:
            raise ValueError(
                f"placement: covers layers {list(placement.layers)} x {placement.num_experts} experts, "
                f"the model has MoE layers {config.moe_layers} x {config.num_experts} experts"
            )
        missing = [o for o in placement.ordinals if o not in servers]
        if missing:
            raise ValueError(f"servers: no address for placement ordinal(s) {missing}")
        self.config = config
        self.placement = placement
        self.options = options or ClientOptions()
        self.table = RoutingTable(placement, spread_threshold=self.options.spread_threshold)
        o = self.options
        shape = (config.hidden_size, config.num_experts, config.top_k)
        self.connections = [
            ServerConnection(
                ordinal,
                servers[ordinal],
                o.transport,
                o.client_id,
                o.request_timeout_s,
                o.connect_timeout_s,
                Expected(*shape, frozenset(placement.experts_of(ordinal)), o.revision),
                o.data_tokens,
                placement.version,
                o.lease,
            )
            for ordinal in self.table.ordinals
        ]
        self.live = torch.zeros(len(self.connections), dtype=torch.bool)
        self.round_trips = [RoundTrip() for _ in self.connections]
        self._prober = ThreadPoolExecutor(max_workers=4, thread_name_prefix="eaas-probe")
        self.events: deque[FailoverEvent] = deque(maxlen=1000)  # the most recent ones
        self.counters = ClientCounters()
        self._retry_at = [0.0] * len(self.connections)
        self._slow_logged_at = [-1.0] * len(self.connections)
        self._retry_delay = [o.rejoin_min_s] * len(self.connections)
        # Whether a server answered a request since it was (re)attached: one that fails again
        # before that (its control port answers, its data path does not) keeps backing off.
        self._answered = [True] * len(self.connections)
        self._rejoined: dict[int, tuple[Channel, dict[str, Any]]] = {}  # index -> new channel, handle
        self._stale_handles: dict[int, dict[str, Any]] = {}  # index -> slot to release on the server
        self._tickets: list[Ticket] = []  # submitted and not yet waited for, oldest first
        self._flights: list[Flight | None] = [None] * len(self.connections)  # per server
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rejoiner: threading.Thread | None = None
        # Called (on the generating thread) when a server fails over or rejoins: the attention
        # client's heartbeat tells the operator at once (:attr:`failed_servers`).
        self.on_liveness: Callable[[], None] | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def connect(self, require_all: bool = True) -> RemoteExperts:
        """Attaches to every server. With ``require_all=False`` unreachable servers start dead."""
        errors = []
        for index, conn in enumerate(self.connections):
            try:
                conn.connect()
                self.live[index] = True
            except (HandshakeError, ChannelError) as exc:
                errors.append(f"server {conn.ordinal} at {conn.url}: {exc}")
                self._mark_dead(index, f"connect failed: {exc}")
        if errors and require_all:
            self.close()
            raise HandshakeError("; ".join(errors))
        self._rejoiner = threading.Thread(
            target=self._rejoin_loop, name=f"eaas-rejoin-{self.options.client_id}", daemon=True
        )
        self._rejoiner.start()
        return self

    def close(self) -> None:
        self.release(self.close_channels())

    def close_channels(self) -> list[tuple[ServerConnection, dict[str, Any]]]:
        """Closes every channel here (no round trip to a server); returns the slots to release on
        the servers (:meth:`release`), which the caller may do on another thread: the channels'
        transports are only ever driven by this one. The rejoin thread is not waited for: it may
        be inside a handshake with a hung or vanished server for its whole connect timeout, and
        the caller is the decoding thread swapping placements. A channel it opens from now on it
        closes and releases itself (it looks at the stop flag under the lock it hands channels
        over with)."""
        self._stop.set()
        with self._lock:
            pending, self._rejoined = self._rejoined, {}
            stale, self._stale_handles = self._stale_handles, {}
        slots = []
        for index, (channel, handle) in pending.items():
            channel.close()
            slots.append((self.connections[index], handle))
        slots += [(self.connections[index], handle) for index, handle in stale.items()]
        slots += [(conn, conn.drop()) for conn in self.connections]
        self._flights = [None] * len(self.connections)
        self._tickets = []
        self.live[:] = False
        self._prober.shutdown(wait=False, cancel_futures=True)
        return slots

    @staticmethod
    def release(slots: list[tuple[ServerConnection, dict[str, Any]]]) -> None:
        """DELETEs each slot on its server (best effort, naming this client: a slot the server has
        handed on since is left alone)."""
        for conn, handle in slots:
            conn.release_remote(handle)

    def __enter__(self) -> RemoteExperts:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live_servers(self) -> list[int]:
        return [self.table.ordinals[i] for i in self.live.nonzero().squeeze(1).tolist()]

    @property
    def failed_servers(self) -> tuple[int, ...]:
        """The servers of the placement routed around now (failed over, or unreachable when
        connecting, and not rejoined since); none once closed. Any thread may read it."""
        if self._stop.is_set():
            return ()
        live = self.live.clone()
        return tuple(self.table.ordinals[i] for i in (~live).nonzero().squeeze(1).tolist())

    def _liveness_changed(self) -> None:
        hook = self.on_liveness
        if hook is not None:
            try:
                hook()
            except Exception:  # telling must never break the serving
                log.exception("the liveness hook failed")

    # --- the MoEExecutor -------------------------------------------------------------------------
    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert output [T, H] for x [T, H], expert ids [T, K], router weights [T, K]."""
        return self.wait(self.submit(layer, x, expert_ids, weights))

    def submit(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> Ticket:
        """Starts one MoE layer's exchange for x [T, H], expert ids [T, K], router weights [T, K]
        and returns at once (or once a server's slot frees up for it): :meth:`wait` gives the
        answer. Several tickets may be in flight (micro-batches); each server carries one request
        of this client at a time, taken in the order the tickets were submitted. Rejoined servers
        enter the routing table here, never under a ticket in flight. x must stay unchanged until
        :meth:`wait` returns."""
        started = time.monotonic()
        try:
            self._apply_rejoins()  # (a server that rejoins has nothing in flight)
            ticket = Ticket(
                layer,
                x,
                weights.to(torch.float32),
                expert_ids.to("cpu", torch.int64),
                torch.zeros(x.shape, dtype=torch.float32, device=x.device),
            )
            self._tickets.append(ticket)
            try:
                self._route(ticket, blocking=True)
                self._pump()
            except BaseException:
                self._forget(ticket)
                raise
            return ticket
        finally:
            self.counters.expert_seconds += time.monotonic() - started

    def wait(self, ticket: Ticket) -> torch.Tensor:
        """The routed-expert output [T, H] of ``ticket`` (in x's dtype); drives every ticket in
        flight meanwhile. A server that fails is failed over for every ticket that owed it."""
        started = time.monotonic()
        try:
            while ticket.queues or ticket.failed or ticket.needs_route or self._in_flight(ticket):
                if ticket.error is not None:
                    raise ticket.error
                if ticket.needs_route:
                    self._route(ticket, blocking=True)
                if not self._pump():
                    self._wait_any()
            if ticket.error is not None:
                raise ticket.error
            return ticket.out.to(ticket.x.dtype)
        finally:
            self._forget(ticket)
            self.counters.expert_seconds += time.monotonic() - started

    def _forget(self, ticket: Ticket) -> None:
        """Drops ``ticket``: its chunks not yet sent are never sent, an answer in flight for it is
        read and thrown away (the slot must be free for the next request)."""
        ticket.queues.clear()
        if ticket in self._tickets:
            self._tickets.remove(ticket)

    def _route(self, ticket: Ticket, blocking: bool) -> None:
        """Assigns ``ticket``'s owed entries to live replicas and queues them per server. With no
        live replica of an expert: ``blocking`` waits for a rejoin (``unavailable_wait_s``, then
        ``ExpertUnavailable``); otherwise the ticket is left for its waiter to route."""
        while True:
            try:
                assignment = self.table.assign(ticket.layer, ticket.todo, self.live)  # [T, K]
                break
            except ExpertUnavailable:
                # Every replica down is often every slot freed at once, not every server gone: a
                # client that hung past its Lease, or whose servers all restarted. They answer the
                # rejoin handshake within rejoin_min_s; fail only if none does in time. A server
                # in a long backoff (down for a while, back now) is tried at once, not when due.
                ticket.needs_route = True
                if not blocking:
                    return
                if ticket.give_up_at is None:
                    self._retry_now()
                    ticket.give_up_at = time.monotonic() + self.options.unavailable_wait_s
                if not self._await_rejoin(ticket.give_up_at):
                    raise
        ticket.needs_route = False
        ticket.assignment = assignment
        for share in RoutingTable.split(assignment, ticket.todo):
            ticket.queues[share.server] = self._chunks(share)

    def _pump(self) -> bool:
        """One pass over every server without blocking: takes the answers that are there (or
        fails the servers that hung or broke), sends each free server the next chunk owed to it,
        and re-routes the tickets whose round came back with failures. True if anything moved."""
        moved = False
        now = time.monotonic()
        for server, flight in enumerate(self._flights):
            if flight is None:
                continue
            channel = self.connections[server].channel
            assert channel is not None
            if now < flight.deadline and not channel.answered():
                hung = self._hung(server, flight, now)
                if hung is not None:
                    self._fail(server, hung)
                    moved = True
                continue
            moved = True
            self._flights[server] = None
            ticket = flight.ticket
            try:  # an answer already there is taken even past the deadline
                y = channel.receive(flight.deadline)  # [T_s, H]
                took = time.monotonic() - flight.sent_at
                self.round_trips[server].observe(took)
                self._answered[server] = True
                if took > SLOW_ANSWER_S:
                    self._slow(server, ticket.layer, took)
                if ticket in self._tickets:
                    ticket.out.index_add_(
                        0, flight.rows.to(ticket.out.device), y.to(ticket.out.device, torch.float32)
                    )
            except ChannelError as exc:
                ticket.failed.setdefault(server, []).append(flight.rows)
                self._fail(server, str(exc))
            except RemoteError as exc:
                ticket.error = ticket.error or RemoteError(
                    exc.status, f"server {self.table.ordinals[server]}: {exc.message}"
                )
                ticket.queues.pop(server, None)
        for server in range(len(self.connections)):
            if self._flights[server] is None and self._send_next(server):
                moved = True
        for ticket in list(self._tickets):
            if ticket.failed and not ticket.queues and not self._in_flight(ticket):
                self._resend(ticket)
                moved = True
        return moved

    def _send_next(self, server: int) -> bool:
        """Sends ``server`` the first chunk a ticket owes it (tickets in submission order)."""
        ticket = next((t for t in self._tickets if t.queues.get(server) and t.error is None), None)
        if ticket is None:
            return False
        chunks = ticket.queues[server]
        rows, ids = chunks.pop(0)
        if not chunks:
            del ticket.queues[server]
        x = ticket.x
        channel = self.connections[server].channel
        try:
            if channel is None:
                raise ChannelError("not connected")
            on_device = rows.to(x.device)
            staged = (  # (an autograd graph cannot write into it: x is then copied)
                None if x.requires_grad else channel.staging(len(rows), x.shape[1], x.dtype, x.device)
            )
            # gathered straight into the transport's send memory where it has some: one copy fewer
            share_x = x[on_device] if staged is None else torch.index_select(x, 0, on_device, out=staged)
            channel.send(ticket.layer, share_x, ids, ticket.weights[on_device])
        except ChannelError as exc:
            ticket.failed.setdefault(server, []).append(rows)
            self._fail(server, f"send failed: {exc}")
            return True
        sent_at = time.monotonic()
        suspect = self.round_trips[server].suspect_after(self.options.suspect_floor_s)
        self._flights[server] = Flight(
            ticket, rows, sent_at, sent_at + self.options.request_timeout_s, sent_at + suspect
        )
        self.counters.requests += 1
        self.counters.tokens_sent += int(rows.numel())
        return True

    def _fail(self, server: int, reason: str) -> None:
        """Fails ``server`` over for every ticket: what it had in flight and what was queued for
        it is owed again, and re-routed once its ticket's round has come back."""
        flight, self._flights[server] = self._flights[server], None
        if flight is not None:
            flight.ticket.failed.setdefault(server, []).append(flight.rows)
        layer = flight.ticket.layer if flight is not None else -1
        for ticket in self._tickets:
            queued = ticket.queues.pop(server, [])
            if queued:
                ticket.failed.setdefault(server, []).extend(rows for rows, _ in queued)
        self._mark_dead(server, reason, layer)

    def _in_flight(self, ticket: Ticket) -> bool:
        return any(flight is not None and flight.ticket is ticket for flight in self._flights)

    def _resend(self, ticket: Ticket) -> None:
        """Routes the entries ``ticket`` is owed by failed servers to live replicas: exactly the
        entries whose answers did not arrive, so none is summed twice."""
        assert ticket.assignment is not None  # (a ticket with failures was routed)
        redo = torch.zeros_like(ticket.todo, dtype=torch.bool)
        for server, parts in ticket.failed.items():
            rows = torch.cat(parts)
            owed = torch.zeros_like(redo)
            owed[rows] = ticket.assignment[rows] == server
            redo |= owed
            resent = int(owed.sum())
            self.counters.resent_entries += resent
            self.events.append(
                FailoverEvent(
                    time.time(),
                    "resent",
                    self.table.ordinals[server],
                    "share re-routed to replicas",
                    ticket.layer,
                    resent,
                )
            )
        ticket.failed = {}
        ticket.todo = torch.where(redo, ticket.todo, -1)
        self._route(ticket, blocking=False)

    def _wait_any(self) -> None:
        """Blocks until a server in flight may have its answer, or for a liveness check's slice."""
        channels = [self.connections[s].channel for s, f in enumerate(self._flights) if f is not None]
        waits = [(channel, channel.wakeup_fd()) for channel in channels if channel is not None]
        if not waits:
            return
        fds = [fd for _, fd in waits if fd is not None]
        if len(fds) < len(waits):  # a channel that cannot be waited on (GPU flags, NIXL): poll
            pause(min(channel.poll_interval_s() for channel, fd in waits if fd is None))
            return
        deadline = min(f.deadline for f in self._flights if f is not None)
        timeout = min(max(deadline - time.monotonic(), 0.0), WAIT_SLICE_S)
        ready = set(select.select(fds, [], [], timeout)[0])
        for channel, fd in waits:
            if fd in ready:
                channel.clear_wakeup()

    def _slow(self, server: int, layer: int, took: float) -> None:
        """Logs a late answer: where a step's time went when a client stalls without a failure."""
        now = time.monotonic()
        if now >= self._slow_logged_at[server] + 1.0:
            self._slow_logged_at[server] = now
            conn = self.connections[server]
            log.warning(
                "expert server %d (instance %s) answered layer %d after %.2f s",
                conn.ordinal,
                conn.instance,
                layer,
                took,
            )

    def _hung(self, server: int, flight: Flight, now: float) -> str | None:
        """Why ``server`` counts as hung (its probe failed), or None while it may still answer.

        Past its check time the server is probed (off this thread); a probe that succeeds moves
        the next check to twice the time waited so far."""
        waited = now - flight.sent_at
        if flight.probe is None:
            if now >= flight.check_at:
                self.counters.probes += 1
                connection = self.connections[server]
                flight.probe = self._prober.submit(connection.probe, self.options.probe_timeout_s)
            return None
        if not flight.probe.done():
            return None
        reason = flight.probe.result()
        flight.probe = None
        if reason is None:
            flight.check_at = now + max(waited, self.options.suspect_floor_s)
            return None
        return f"no answer after {waited:.2f} s and no answer to its liveness probe ({reason})"

    def _chunks(self, share: Share) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = self.connections[share.server].max_tokens
        return [
            (share.rows[i : i + size], share.expert_ids[i : i + size])
            for i in range(0, share.rows.numel(), size)
        ]

    # --- failure and rejoin ----------------------------------------------------------------------
    def _mark_dead(self, index: int, reason: str, layer: int = -1) -> None:
        conn = self.connections[index]
        was_live = bool(self.live[index])
        self.live[index] = False
        old_handle = conn.drop()
        with self._lock:
            # One that served since it was attached is tried again soon; one attached and failed
            # again without an answer (its control port answers, its data path not) backs off.
            delay = self.options.rejoin_min_s if self._answered[index] else self._retry_delay[index]
            self._retry_delay[index] = min(delay * 2, self.options.rejoin_max_s)
            self._retry_at[index] = time.monotonic() + delay
            if old_handle:
                self._stale_handles[index] = old_handle
        if was_live:
            self.counters.failovers += 1
            log.warning("expert server %d failed (%s); failing over to replicas", conn.ordinal, reason)
            self.events.append(FailoverEvent(time.time(), "failed", conn.ordinal, reason, layer))
            self._liveness_changed()

    def _retry_now(self) -> None:
        """Makes every dead server due for a rejoin attempt now."""
        now = time.monotonic()
        with self._lock:
            for index in range(len(self.connections)):
                if not bool(self.live[index]):
                    self._retry_at[index] = min(self._retry_at[index], now)

    def _await_rejoin(self, until: float) -> bool:
        """Waits until a dead server has rejoined (applied: True) or ``until`` (False)."""
        while time.monotonic() < until and not self._stop.is_set():
            with self._lock:
                pending = bool(self._rejoined)
            if pending:
                self._apply_rejoins()
                return True
            time.sleep(0.01)
        return False

    def refresh(self) -> None:
        """Applies pending rejoins now (otherwise at the next layer); call from the thread that generates."""
        self._apply_rejoins()

    def _apply_rejoins(self) -> None:
        with self._lock:
            rejoined, self._rejoined = self._rejoined, {}
        for index, (channel, handle) in rejoined.items():
            conn = self.connections[index]
            if self.live[index]:
                channel.close()
                conn.release_remote(handle)
                continue
            conn.install(channel, handle)
            self._answered[index] = False
            self.live[index] = True
            self.counters.rejoins += 1
            log.info("expert server %d rejoined (instance %s)", conn.ordinal, conn.instance)
            self.events.append(
                FailoverEvent(time.time(), "rejoined", conn.ordinal, f"instance {conn.instance}")
            )
            self._liveness_changed()

    def _rejoin_loop(self) -> None:
        """Every 50 ms: a rejoin attempt for each dead server that is due, each on a worker of its
        own (at most one in flight per server), so that a server that hangs in its handshake for
        the whole connect timeout does not hold back the others' rejoins."""
        attempts: dict[int, Future[None]] = {}
        workers = ThreadPoolExecutor(
            max_workers=max(1, min(8, len(self.connections))), thread_name_prefix="eaas-rejoin"
        )
        try:
            while not self._stop.wait(0.05):
                now = time.monotonic()
                for index in range(len(self.connections)):
                    if index in attempts and not attempts[index].done():
                        continue
                    attempts.pop(index, None)
                    with self._lock:
                        due = (
                            not bool(self.live[index])
                            and index not in self._rejoined
                            and now >= self._retry_at[index]
                        )
                        stale = self._stale_handles.pop(index, None) if due else None
                    if due:
                        attempts[index] = workers.submit(self._attempt_rejoin, index, stale)
        finally:
            workers.shutdown(wait=False)

    def _attempt_rejoin(self, index: int, stale: dict[str, Any] | None) -> None:
        """One handshake with dead server ``index`` (its old slot released first): the new channel
        is handed to the generating thread (:meth:`_apply_rejoins`), or the server backs off."""
        conn = self.connections[index]
        if stale:
            conn.release_remote(stale)
        try:
            channel, handle = conn.open()
        except Exception as exc:  # whatever one server answers, the others still rejoin
            with self._lock:
                delay = self._retry_delay[index]
                self._retry_delay[index] = min(delay * 2, self.options.rejoin_max_s)
                self._retry_at[index] = time.monotonic() + delay
            if isinstance(exc, HandshakeError | ChannelError | OSError):
                log.debug("server %d still down: %s", conn.ordinal, exc)
            else:
                log.warning("server %d: rejoin failed unexpectedly: %r", conn.ordinal, exc)
            return
        with self._lock:
            if not self._stop.is_set():
                self._rejoined[index] = (channel, handle)
                return
        channel.close()  # closed meanwhile: this channel is nobody's
        conn.release_remote(handle)
