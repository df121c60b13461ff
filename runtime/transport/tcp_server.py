"""``tcp``, server side: non-blocking, driven by the expert server loop through a selector.

See ``tcp_client`` for the wire format. A slow or stuck client never holds up the others. A frame
whose header cannot be trusted (bad magic or version, payload larger than the slot) is answered
with an error status and the connection is closed; any other bad request is read in full and
answered with an error status, keeping the connection.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    FrameKind,
    ProtocolError,
    SlotHeader,
    SlotState,
    check_framing,
    write_message,
)
from eaas.runtime.transport.base import Request, ServerTransport, SlotsExhausted, TransportOptions
from eaas.runtime.transport.tcp_socket import (
    HELLO,
    HELLO_MAGIC,
    LOW_WATER_MIN_BYTES,
    drain,
    set_low_water,
    tune,
)


class _Phase(Enum):
    HELLO = "hello"
    HEADER = "header"
    PAYLOAD = "payload"
    READY = "ready"  # a complete request is with the server loop
    SENDING = "sending"


_STATE_OF_PHASE = {
    _Phase.HELLO: SlotState.IDLE,
    _Phase.HEADER: SlotState.IDLE,
    _Phase.PAYLOAD: SlotState.IDLE,
    _Phase.READY: SlotState.REQUEST_READY,
    _Phase.SENDING: SlotState.RESPONSE_READY,
}


@dataclass(eq=False)  # identity semantics: connections live in sets
class _Conn:
    sock: socket.socket
    opened_at: float
    phase: _Phase = _Phase.HELLO
    received: int = 0
    hello: bytearray = field(default_factory=lambda: bytearray(HELLO.size))
    slot: int = -1
    generation: int = 0
    client_id: str = ""
    requests: int = 0
    buffer: memoryview | None = None
    header: SlotHeader | None = None
    outgoing: memoryview | None = None
    close_after_send: bool = False
    events: int = 0  # selector interest currently registered (0 = not registered)


@dataclass
class _Pending:
    client_id: str
    token: int
    generation: int
    attached_at: float


_WAKE = object()  # selector data of watched wake-up descriptors


class TcpServerTransport(ServerTransport):
    name = "tcp"

    def __init__(self, options: TransportOptions) -> None:
        self.options = options
        self.capacity_bytes = options.capacity_bytes
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((options.host, options.tcp_port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._bound: dict[int, _Conn] = {}
        self._unbound: set[_Conn] = set()  # connected, hello not complete
        self._released: dict[int, str] = {}  # slot -> last client, shown as OFFLINE until re-attached
        self._lost: list[int] = []  # slots whose connection broke or was closed by its client, unreported
        self._generations = [0] * options.max_clients
        self._buffers: list[memoryview | None] = [None] * options.max_clients
        self._ready: list[Request] = []

    # --- control plane (any thread) -------------------------------------------------------------
    def attach(self, client_id: str, offer: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            used = self._pending.keys() | self._bound.keys()
            free = [s for s in range(self.options.max_clients) if s not in used]
            if not free:
                raise SlotsExhausted(f"all {self.options.max_clients} tcp slots are attached")
            slot = free[0]
            self._generations[slot] += 1
            token = secrets.randbits(63)
            self._pending[slot] = _Pending(client_id, token, self._generations[slot], time.monotonic())
            self._released.pop(slot, None)
        return {
            "transport": self.name,
            "slot": slot,
            "port": self.port,
            "token": token,
            "capacity_bytes": self.capacity_bytes,
        }

    def detach(self, slot: int) -> bool:
        with self._lock:
            pending = self._pending.pop(slot, None)
            if pending is not None:
                self._released[slot] = pending.client_id
                return True
            conn = self._bound.get(slot)
            if conn is None:
                return False
            self._close(conn)
            return True

    def slots(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = [
                {"slot": s, "client_id": p.client_id, "state": SlotState.IDLE.name, "requests": 0}
                for s, p in self._pending.items()
            ]
            rows += [
                {
                    "slot": s,
                    "client_id": c.client_id,
                    "state": _STATE_OF_PHASE[c.phase].name,
                    "requests": c.requests,
                }
                for s, c in self._bound.items()
            ]
            rows += [
                {"slot": s, "client_id": cid, "state": SlotState.OFFLINE.name, "requests": 0}
                for s, cid in self._released.items()
            ]
        return sorted(rows, key=lambda row: row["slot"])

    # --- server loop ----------------------------------------------------------------------------
    def poll(self) -> list[Request]:
        self._pump(0.0)
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def wait(self, timeout_s: float) -> None:
        # epoll rounds timeouts up to whole milliseconds: shorter waits poll, then sleep.
        if timeout_s >= 1e-3:
            self._pump(timeout_s)
        elif not self._pump(0.0) and timeout_s > 0:
            time.sleep(timeout_s)

    def _pump(self, timeout_s: float) -> int:
        """Handles ready sockets (waiting up to ``timeout_s``); returns the number of events."""
        events = self._selector.select(timeout_s)
        if not events:
            return 0
        with self._lock:
            for key, mask in events:
                conn = key.data
                if conn is None:
                    self._accept()
                    continue
                if conn is _WAKE:
                    drain(key.fd)
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._flush(conn)
                elif mask & selectors.EVENT_READ:
                    self._read(conn)
        return len(events)

    def watch(self, fd: int) -> bool:
        self._selector.register(fd, selectors.EVENT_READ, _WAKE)
        return True

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. too many open files: the client will time out and retry
            sock.setblocking(False)
            tune(sock)
            conn = _Conn(sock, time.monotonic())
            self._unbound.add(conn)
            self._interest(conn, selectors.EVENT_READ)

    def _interest(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events, conn)
        elif events == 0:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _target(self, conn: _Conn) -> memoryview:
        """The bytes still to read in the current phase."""
        if conn.phase is _Phase.HELLO:
            return memoryview(conn.hello)[conn.received :]
        assert conn.buffer is not None
        if conn.phase is _Phase.HEADER:
            return conn.buffer[HEADER_OFFSET + conn.received : PAYLOAD_OFFSET]
        assert conn.header is not None
        return conn.buffer[PAYLOAD_OFFSET + conn.received : PAYLOAD_OFFSET + conn.header.payload_bytes]

    def _read(self, conn: _Conn) -> None:
        while conn.phase in (_Phase.HELLO, _Phase.HEADER, _Phase.PAYLOAD):
            target = self._target(conn)
            if len(target):
                try:
                    n = conn.sock.recv_into(target)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    self._close(conn, lost=True)
                    return
                if n == 0:
                    self._close(conn, lost=True)
                    return
                conn.received += n
                if n < len(target):
                    if conn.phase is _Phase.PAYLOAD and len(target) >= LOW_WATER_MIN_BYTES:
                        self._low_water(conn, len(target) - n)  # never above what is still to come
                    continue
            if not self._advance(conn):
                return

    def _advance(self, conn: _Conn) -> bool:
        """The current phase's bytes are complete: move on. False when the connection is closed or parked."""
        conn.received = 0
        if conn.phase is _Phase.HELLO:
            return self._bind(conn)
        assert conn.buffer is not None
        if conn.phase is _Phase.HEADER:
            conn.header = SlotHeader.unpack_from(conn.buffer, HEADER_OFFSET)
            try:
                check_framing(conn.header, self.capacity_bytes)
            except ProtocolError as exc:
                self._answer_error(conn, exc, close=True)
                return False
            conn.phase = _Phase.PAYLOAD
            if conn.header.payload_bytes >= LOW_WATER_MIN_BYTES:
                self._low_water(conn, conn.header.payload_bytes)
            return True
        assert conn.header is not None
        if conn.header.payload_bytes >= LOW_WATER_MIN_BYTES:
            self._low_water(conn, 1)
        conn.phase = _Phase.READY
        conn.requests += 1
        self._interest(conn, 0)  # one request at a time per slot: read nothing more until answered
        self._ready.append(Request(self.name, conn.slot, conn.generation, conn.header, conn.buffer))
        return False

    @staticmethod
    def _low_water(conn: _Conn, num_bytes: int) -> None:
        """Wake for this socket only once ``num_bytes`` are buffered (one wake-up per large frame)."""
        set_low_water(conn.sock, num_bytes)

    def _bind(self, conn: _Conn) -> bool:
        magic, slot, token = HELLO.unpack(conn.hello)
        pending = self._pending.get(slot)
        if magic != HELLO_MAGIC or pending is None or pending.token != token:
            self._close(conn)
            return False
        del self._pending[slot]
        self._unbound.discard(conn)
        conn.slot, conn.generation, conn.client_id = slot, pending.generation, pending.client_id
        conn.buffer = self._slot_buffer(slot)
        conn.phase = _Phase.HEADER
        self._bound[slot] = conn
        return True

    def _slot_buffer(self, slot: int) -> memoryview:
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = memoryview(bytearray(PAYLOAD_OFFSET + self.capacity_bytes))
            self._buffers[slot] = buffer
        return buffer

    def respond(self, request: Request, answer: Callable[[], SlotHeader]) -> None:
        with self._lock:
            conn = self._bound.get(request.slot)
            if conn is None or conn.generation != request.generation or conn.phase is not _Phase.READY:
                return  # the slot's buffer may already hold its next holder's request
            self._send(conn, answer())

    def _send(self, conn: _Conn, header: SlotHeader) -> None:
        assert conn.buffer is not None
        header.pack_into(conn.buffer, HEADER_OFFSET)
        conn.outgoing = conn.buffer[HEADER_OFFSET : PAYLOAD_OFFSET + header.payload_bytes]
        conn.phase = _Phase.SENDING
        self._flush(conn)

    def _answer_error(self, conn: _Conn, error: ProtocolError, close: bool) -> None:
        assert conn.buffer is not None and conn.header is not None
        size = write_message(conn.buffer[PAYLOAD_OFFSET:], error.message)
        h = conn.header
        header = SlotHeader(
            FrameKind.RESPONSE, h.dtype & 0xFF, h.layer, 0, 0, h.hidden, h.seq, size, status=error.status
        )
        conn.close_after_send = close
        self._send(conn, header)

    def _flush(self, conn: _Conn) -> None:
        while conn.outgoing is not None and len(conn.outgoing):
            try:
                n = conn.sock.send(conn.outgoing)
            except (BlockingIOError, InterruptedError):
                self._interest(conn, selectors.EVENT_WRITE)
                return
            except OSError:
                self._close(conn, lost=True)
                return
            conn.outgoing = conn.outgoing[n:]
        conn.outgoing = None
        if conn.close_after_send:
            self._close(conn)
            return
        conn.phase, conn.received, conn.header = _Phase.HEADER, 0, None
        self._interest(conn, selectors.EVENT_READ)
        self._read(conn)  # the next request may already be waiting in the socket

    def _close(self, conn: _Conn, lost: bool = False) -> None:  # caller holds the lock
        """Closes ``conn``; ``lost``: its client closed it or it broke (reported by the next ``reap``)."""
        self._interest(conn, 0)
        conn.sock.close()
        self._unbound.discard(conn)
        if conn.slot >= 0 and self._bound.get(conn.slot) is conn:
            del self._bound[conn.slot]
            self._released[conn.slot] = conn.client_id
            if lost:
                self._lost.append(conn.slot)
        conn.outgoing = None
        conn.phase = _Phase.HELLO

    def reap(self) -> list[int]:
        """Drops attachments never claimed by a connection and connections that never said hello;
        returns those slots and the slots whose connection was lost since the last call."""
        now = time.monotonic()
        grace = self.options.attach_grace_s
        with self._lock:
            reaped, self._lost = self._lost, []
            for slot, pending in list(self._pending.items()):
                if now - pending.attached_at > grace:
                    del self._pending[slot]
                    self._released[slot] = pending.client_id
                    reaped.append(slot)
            for conn in list(self._unbound):
                if now - conn.opened_at > grace:
                    self._close(conn)
        return reaped

    def close(self) -> None:
        with self._lock:
            for conn in [*self._bound.values(), *self._unbound]:
                self._close(conn)
            self._selector.close()
            self._listener.close()
