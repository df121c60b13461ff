"""``shm``, server side: one shared-memory segment per server, one slot per client (same host).

The client writes header and payload, then sets the flag to ``REQUEST_READY`` and rings the
server's doorbell; the server reads all flags at once (one strided numpy read), computes, writes
the response, sets the flag to ``RESPONSE_READY`` and rings the slot's doorbell; the client reads
the response and sets ``IDLE``. Both sides block on doorbells (``transport.doorbell``) instead of
sleeping in polling loops. Either side learns that the other died from the liveness locks
(``transport.liveness``): the server reaps dead clients' slots, a client waiting on a dead server
fails at once instead of waiting for its timeout.

Memory ordering: flag and data are written by separate CPython calls, which x86-64 (TSO) keeps in
program order; weakly ordered CPUs would need a fence between payload and flag.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from eaas.runtime.protocol import HEADER_OFFSET, PAYLOAD_OFFSET, SlotHeader, SlotState
from eaas.runtime.transport import liveness
from eaas.runtime.transport.base import Request, ServerTransport, SlotsExhausted, TransportOptions
from eaas.runtime.transport.doorbell import Doorbell
from eaas.runtime.transport.shm_segment import (
    SHM_DIR,
    Segment,
    new_segment_name,
    request_bell_name,
    response_bell_name,
)


@dataclass
class _Attached:
    client_id: str
    generation: int
    attached_at: float
    requests: int = 0
    claimed: bool = False  # the client has been seen holding its liveness lock (or sending)


class ShmServerTransport(ServerTransport):
    name = "shm"

    def __init__(self, options: TransportOptions) -> None:
        self.options = options
        self.segment = Segment.create(
            new_segment_name(options.tag), options.max_clients, options.capacity_bytes
        )
        self._bells: list[Doorbell] = []
        try:
            self.request_bell = Doorbell.create(SHM_DIR / request_bell_name(self.segment.name))
            self._bells.append(self.request_bell)
            for slot in range(options.max_clients):
                self._bells.append(Doorbell.create(SHM_DIR / response_bell_name(self.segment.name, slot)))
        except BaseException:
            self._close_files()
            raise
        self.response_bells = self._bells[1:]
        self._init_slots()

    def _init_slots(self) -> None:
        self._lock = threading.Lock()
        self._attached: dict[int, _Attached] = {}
        self._generations = [0] * self.options.max_clients
        self._in_flight: set[int] = set()
        self._released: dict[int, str] = {}  # slot -> last client, shown as OFFLINE until re-attached

    def attach(self, client_id: str, offer: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            free = [s for s in range(self.segment.num_slots) if s not in self._attached]
            if not free:
                raise SlotsExhausted(f"all {self.segment.num_slots} shm slots are attached")
            slot = free[0]
            self._generations[slot] += 1
            self.segment.slot(slot)[HEADER_OFFSET:PAYLOAD_OFFSET] = bytes(PAYLOAD_OFFSET - HEADER_OFFSET)
            self.segment.flags[slot] = SlotState.IDLE
            self._attached[slot] = _Attached(client_id, self._generations[slot], time.monotonic())
            self._released.pop(slot, None)
        return self._handle(slot)

    def _handle(self, slot: int) -> dict[str, Any]:
        """What a client needs to open ``slot`` (sent back by the handshake)."""
        return {
            "transport": self.name,
            "slot": slot,
            "segment": self.segment.name,
            "bell": request_bell_name(self.segment.name),
            "response_bell": response_bell_name(self.segment.name, slot),
            "capacity_bytes": self.segment.capacity_bytes,
        }

    def detach(self, slot: int) -> bool:
        with self._lock:
            return self._release(slot)

    def _release(self, slot: int) -> bool:  # caller holds the lock
        info = self._attached.pop(slot, None)
        if info is None:
            return False
        self._released[slot] = info.client_id
        self._in_flight.discard(slot)
        self.segment.flags[slot] = SlotState.OFFLINE
        self._wake_client(slot)  # a client still waiting sees OFFLINE at once
        return True

    def _wake_client(self, slot: int) -> None:
        self.response_bells[slot].ring()

    @property
    def wakeup_fd(self) -> int | None:
        return self.request_bell.fileno()

    def wait(self, timeout_s: float) -> None:
        self.request_bell.wait(timeout_s)

    def poll(self) -> list[Request]:
        ready = np.flatnonzero(self.segment.flags == SlotState.REQUEST_READY)
        if ready.size == 0:
            return []
        requests = []
        with self._lock:
            for slot in ready.tolist():
                info = self._attached.get(slot)
                if info is None or slot in self._in_flight:
                    continue
                self._in_flight.add(slot)
                info.requests += 1
                info.claimed = True
                requests.append(self._take(slot, info.generation))
        return requests

    def _take(self, slot: int, generation: int) -> Request:
        """The request in ``slot`` (called with the lock held, once per request)."""
        buffer = self.segment.slot(slot)
        return Request(self.name, slot, generation, SlotHeader.unpack_from(buffer, HEADER_OFFSET), buffer)

    def respond(self, request: Request, answer: Callable[[], SlotHeader]) -> None:
        with self._lock:  # (``attach`` gives a slot to its next holder under it)
            info = self._attached.get(request.slot)
            if info is None or info.generation != request.generation:
                return  # the client left while we computed: its answer is not written at all
            header = answer()
            header.pack_into(request.slot_buffer, HEADER_OFFSET)
            self._in_flight.discard(request.slot)
            self._publish(request.slot, header)

    def _publish(self, slot: int, header: SlotHeader) -> None:
        """Makes the answer in ``slot`` visible to its client (called with the lock held)."""
        self.segment.flags[slot] = SlotState.RESPONSE_READY
        self.response_bells[slot].ring()

    def reap(self) -> list[int]:
        now = time.monotonic()
        reaped = []
        with self._lock:
            for slot, info in list(self._attached.items()):
                said_goodbye = self.segment.flags[slot] == SlotState.OFFLINE
                alive = liveness.is_held(self.segment.fd, self.segment.slot_offset(slot))
                info.claimed |= alive
                # A client that never took its lock gets a grace period to do so after attaching.
                unclaimed_too_long = not info.claimed and now - info.attached_at > self.options.attach_grace_s
                if said_goodbye or (not alive and (info.claimed or unclaimed_too_long)):
                    self._release(slot)
                    reaped.append(slot)
        return reaped

    def slots(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = [
                {
                    "slot": slot,
                    "client_id": info.client_id,
                    "state": SlotState(int(self.segment.flags[slot])).name,
                    "requests": info.requests,
                }
                for slot, info in self._attached.items()
            ]
            rows += [
                {"slot": slot, "client_id": client_id, "state": SlotState.OFFLINE.name, "requests": 0}
                for slot, client_id in self._released.items()
            ]
        return sorted(rows, key=lambda row: row["slot"])

    def slot_state(self, slot: int) -> SlotState:
        return SlotState(int(self.segment.flags[slot]))

    def close(self) -> None:
        with self._lock:
            for slot in list(self._attached):
                self._release(slot)
        self._close_files()

    def _close_files(self) -> None:
        for bell in self._bells:
            bell.close()
        self.segment.close()
