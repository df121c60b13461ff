"""``nixl``, client side: one slot of an expert server reached by NIXL one-sided WRITEs.

See ``nixl_server`` for the exchange. Every channel of a process shares one NIXL agent
(``client_endpoint``). A channel owns two slot-sized areas, both registered with that agent: the
*send area*, where a request is laid out as in a slot before one WRITE carries header and payload
to the server's slot, and the *answer area*, which the server WRITEs into. Both are GPU memory when
the server has slots in GPU memory and this process has a GPU (``area_memory``): the server then gives a
slot in GPU memory and splits the frames (the WRITEs carry payloads, the notifications headers:
``nixl_endpoint``); else host memory, and a slot in host memory, where a frame of at most
``INLINE_BYTES`` travels in its notification instead of a WRITE, both ways, when the server agrees
(``inline_bytes`` in the offer and the handle). Before the handshake
the client makes an ``NixlOffer`` (the agent's metadata for the answer area only, and its
address); the handshake's answer carries the server agent's metadata for the granted slot only.

Waiting for an answer polls the agent (that is what makes NIXL progress; no progress thread runs):
without sleeping right after the send (longer for a channel whose answers come fast), then with
sleeps, but awake again shortly before the channel's answers usually come, and polling without
sleeping from then on for a while (``poll_interval_s``); past that, sleeps that grow with the wait.
Every ``LIVENESS_CHECK_S`` it also pings the server with a 4-byte WRITE: UCX reports a server whose
process died (its endpoint broke) at once, as a NIXL error, and the channel fails with
``ChannelClosed``. A server that hangs raises nothing: the client's round-trip probe covers it
(``RemoteExperts``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eaas.runtime.protocol import (
    FLAG_OFFSET,
    HEADER_OFFSET,
    HEADER_SIZE,
    PAYLOAD_OFFSET,
    FrameKind,
    ProtocolError,
    RequestWriter,
    SlotHeader,
    Status,
    check_response,
    dtype_code,
    is_staged,
    read_message,
    read_response,
    slot_stride,
    staged_x,
)
from eaas.runtime.transport.backoff import reduce_timer_slack_once
from eaas.runtime.transport.base import Channel, ChannelClosed, ChannelTimeout, Offer, RemoteError
from eaas.runtime.transport.nixl_endpoint import (
    CLAIM,
    HOST,
    INLINE_BYTES,
    PING_BYTES,
    Endpoint,
    Memory,
    Notice,
    TransferSet,
    TransportUnavailable,
    address,
    decode,
    encode,
    frame_length,
    host_memory,
    notice,
)
from eaas.runtime.transport.polling import pause

log = logging.getLogger("eaas.transport")

LIVENESS_CHECK_S = 0.02  # how often a waiting client pings the server
# How a waiter paces its looks at the notifications: without sleeping for a while after the send,
# then sleeping a quarter of the time waited so far, within [MIN_SLEEP_S, MAX_SLEEP_S]: an answer is
# seen at most ~25% late (and a wake-up late), and a long wait costs few looks. The while is SPIN_S
# (a small round trip's worth), or SPIN_FACTOR times the channel's usual round trip when that is
# short (at most MAX_SPIN_S): a fast server's answers are then caught without the wake-up of a
# sleep, which on a busy host costs as much as the round trip itself. A channel whose server takes
# longer (a decode step's compute, a large frame's WRITEs) spins only SPIN_S, then sleeps, but not
# past WAKE_S before its usual round trip: from then it spins again, until DUE_SPIN_FACTOR of the
# usual round trip (at least SPIN_S, at most MAX_SPIN_S) after it, so an answer that comes when it
# usually does is seen at once, not up to a quarter late; one that comes later is slept for again.
SPIN_S = 150e-6
SPIN_FACTOR = 1.5
MAX_SPIN_S = 1e-3
WAKE_S = 150e-6  # a sleep ends ~50-120 µs late on the 2-core VM (docs/benchmarks.md)
DUE_SPIN_FACTOR = 0.25
# The usual round trip follows a faster answer at once and a slower one by USUAL_RISE of the
# difference: answers that came late (a server that was asleep) do not talk it out of spinning,
# while a server that now computes for long does. An answer counts from the last look that did not
# see it (a waiter that slept past it does not learn that it came late).
USUAL_RISE = 0.1
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 500e-6


def spin_for(usual_s: float | None) -> float:
    """How long a waiter looks without sleeping, given the channel's usual round trip."""
    if usual_s is None or SPIN_FACTOR * usual_s > MAX_SPIN_S:
        return SPIN_S
    return max(SPIN_S, SPIN_FACTOR * usual_s)


_shared: Endpoint | None = None
_shared_pid = 0
_shared_lock = threading.Lock()


def client_endpoint() -> Endpoint:
    """The process's client agent, made on first use (and anew in a forked child)."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared = Endpoint("client")
            _shared_pid = os.getpid()
            _spare.clear()  # (a forked child's areas are registered with its parent's agent)
        return _shared


@dataclass
class _Areas:
    """A channel's send and answer areas, ``[send | answer]``, registered with the client agent."""

    memory: Memory
    stride: int
    buffer: np.ndarray | torch.Tensor
    registrations: list[Any]
    metadata: bytes  # the agent's metadata for the answer area

    @property
    def send_address(self) -> int:
        if isinstance(self.buffer, torch.Tensor):
            return int(self.buffer.data_ptr())
        return int(self.buffer.ctypes.data)


# Areas of closed channels, still registered, by (memory, stride): the next channel's offer takes
# them. A server keeps a client agent's regions as long as it holds that agent (another slot of
# the same client, a slot still retiring), and NIXL refuses metadata that describes a region it
# knows at the same address with another key (NIXL_ERR_NOT_ALLOWED). New areas at a freed area's
# address (the CUDA caching allocator hands a freed block out again at once) would carry a new key;
# the same areas carry the same metadata, and save a registration.
_spare: dict[tuple[Memory, int], list[_Areas]] = {}


def _take_areas(endpoint: Endpoint, memory: Memory, stride: int) -> _Areas:
    with _shared_lock:
        spare = _spare.get((memory, stride))
        if spare:
            return spare.pop()
    buffer: np.ndarray | torch.Tensor
    if memory.kind == "VRAM":
        buffer = torch.zeros(2 * stride, dtype=torch.uint8, device=f"cuda:{memory.device}")
        base = int(buffer.data_ptr())
    else:
        buffer = host_memory(2 * stride)  # (on huge pages)
        base = int(buffer.ctypes.data)
    registrations = [endpoint.register(base, stride, memory)]
    try:
        registrations.append(endpoint.register(base + stride, stride, memory))
        metadata = endpoint.metadata(registrations[1])
    except BaseException:
        for registration in registrations:
            with contextlib.suppress(Exception):
                endpoint.deregister(registration)
        raise
    return _Areas(memory, stride, buffer, registrations, metadata)


def _give_back(endpoint: Endpoint, areas: _Areas) -> None:
    """Keeps ``areas`` for the next offer (nothing of theirs is in flight any more)."""
    with _shared_lock:
        if endpoint is _shared:  # (not areas of an agent a fork replaced)
            _spare.setdefault((areas.memory, areas.stride), []).append(areas)


def area_memory(server: dict[str, Any]) -> Memory:
    """Where a channel's areas go: GPU memory when the server has slots there (its ``/v1/info``
    lists ``VRAM`` under ``transports.nixl.memory``: it computes on a GPU) and this process has a
    GPU too, else host memory. The server gives the channel a slot in the same memory."""
    memories = server.get("memory")
    if isinstance(memories, list) and "VRAM" in memories and torch.cuda.is_available():
        return Memory("VRAM", torch.cuda.current_device())
    return HOST


class NixlOffer(Offer):
    """A channel's send and answer areas, registered; ``body`` describes the answer area."""

    def __init__(self, capacity_bytes: int, memory: Memory = HOST) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: must be >= 1, got {capacity_bytes}")
        self.endpoint = client_endpoint()
        self.capacity_bytes = capacity_bytes
        self.stride = slot_stride(capacity_bytes)
        self.memory = memory
        self._areas: _Areas | None = _take_areas(self.endpoint, memory, self.stride)
        self.areas = self._areas.buffer  # [send area | answer area]
        self.send_address = self._areas.send_address
        self.answer_address = self.send_address + self.stride
        # Small frames in the notifications, both ways (host memory only: nixl_endpoint).
        self.inline_bytes = 0 if memory.kind == "VRAM" else INLINE_BYTES
        # The first ping claims the slot (``NixlChannel.connect``; host memory only: the server
        # reads the claim with its CPU).
        self.claims = memory.kind != "VRAM"
        self.body = {
            "agent_metadata": encode(self._areas.metadata),
            "answer_address": self.answer_address,
            "answer_bytes": self.stride,
            "answer_memory": memory.kind,
            "answer_device": memory.device,
            "inline_bytes": self.inline_bytes,
            "claim_ping": self.claims,
        }

    def area(self, which: int) -> memoryview | None:
        """Area ``which`` (0 send, 1 answer) as host bytes; None in GPU memory."""
        if isinstance(self.areas, torch.Tensor):
            return None
        return self.areas.data[which * self.stride : (which + 1) * self.stride]

    def payload(self, which: int) -> torch.Tensor:
        """The payload bytes of area ``which`` (0 send, 1 answer), where they are."""
        start = which * self.stride + PAYLOAD_OFFSET
        if isinstance(self.areas, torch.Tensor):
            return self.areas[start : start + self.capacity_bytes]
        return torch.frombuffer(self.areas.data, dtype=torch.uint8, offset=start, count=self.capacity_bytes)

    def close(self) -> None:
        """Gives the areas back for the next offer (called once nothing of them is in flight)."""
        areas, self._areas = self._areas, None
        if areas is not None:
            _give_back(self.endpoint, areas)


class NixlChannel(Channel):
    name = "nixl"
    needs_offer = True

    def __init__(
        self,
        offer: NixlOffer,
        slot: int,
        generation: int,
        peer: str,
        writes: TransferSet,
        inline_bytes: int = 0,
    ) -> None:
        self.offer_made = offer
        self.endpoint = offer.endpoint
        self.capacity_bytes = offer.capacity_bytes
        self.slot = slot
        self.generation = generation  # the slot's attachment count: notices of another are not ours
        self.peer = peer
        self.writes = writes
        self.split = writes.split  # the server's choice: headers in the notices (nixl_endpoint)
        self.inline_bytes = inline_bytes  # frames up to this size travel in the notices, both ways
        self.on_gpu = offer.memory.kind == "VRAM"
        # Host bytes of the areas (whole frames: the headers are there); None in GPU memory.
        self.send_buffer = offer.area(0)
        self.answer_buffer = offer.area(1)
        # The payloads as bytes, where they are: x is built in the send area in place (``staging``).
        self.send_payload = offer.payload(0)
        self.answer_payload = offer.payload(1)
        self._writer = RequestWriter(self.send_payload)
        self._answer_tail = b""  # split frames: the answer's header (and an error's message)
        self._seq = 0
        self._expect: tuple[int, int, int, int] | None = None  # seq, tokens, hidden, dtype
        self._answer: bool = False  # the answer notification for ``_expect`` arrived
        self._gone: str | None = None  # why the server is known gone (released the slot, died)
        self._closed = False
        self._next_ping = 0.0
        self._sent_at = 0.0
        self._usual_s: float | None = None  # the usual round trip (``_learn``)
        self._spin_s = SPIN_S
        self._missed_s = 0.0  # since the send, when the last look saw no answer
        self._last_view: tuple[tuple[int, int, int], torch.Tensor] | None = None  # (_answer_view)

    @classmethod
    def offer(cls, capacity_bytes: int, server: dict[str, Any] | None = None) -> NixlOffer:
        return NixlOffer(capacity_bytes, area_memory(server or {}))

    @classmethod
    def connect(
        cls, handle: dict[str, Any], host: str, timeout_s: float, offer: Offer | None = None
    ) -> NixlChannel:
        if not isinstance(offer, NixlOffer):
            raise ChannelClosed("transport nixl: the client's offer must be made before the handshake")
        peer = None
        writes: TransferSet | None = None
        try:
            slot, generation = handle["slot"], handle["generation"]
            if type(slot) is not int or slot < 0 or type(generation) is not int or generation < 0:
                raise ValueError(f"slot and generation: non-negative integers, got {slot!r}, {generation!r}")
            if handle.get("capacity_bytes") != offer.capacity_bytes:
                raise ValueError(
                    f"capacity_bytes: the offer was made for {offer.capacity_bytes}, "
                    f"the server answered {handle.get('capacity_bytes')!r}"
                )
            slot_address = address(handle.get("slot_address"), "slot_address")
            peer = offer.endpoint.add_peer(decode(handle.get("agent_metadata"), "agent_metadata"))
            if peer != handle.get("agent"):
                raise ValueError(f"agent: the metadata names {peer!r}, the handle {handle.get('agent')!r}")
            split = handle.get("split_frames", False)
            if type(split) is not bool:
                raise ValueError(f"split_frames: true or false, got {split!r}")
            if not split and offer.memory.kind == "VRAM":
                raise ValueError("the server sends whole frames, which a channel in GPU memory cannot read")
            inline = handle.get("inline_bytes", 0)  # (a server of an earlier version sends none)
            if type(inline) is not int or not 0 <= inline <= offer.inline_bytes or (inline and split):
                raise ValueError(
                    f"inline_bytes: at most the {offer.inline_bytes} offered, and none with split frames, "
                    f"got {inline!r}"
                )
            memory = HOST
            if "memory" in handle:
                memory = Memory(handle["memory"], handle.get("device_id", 0))
            writes = TransferSet(
                offer.endpoint,
                peer,
                offer.send_address,
                slot_address,
                offer.capacity_bytes,
                split=split,
                local_memory=offer.memory,
                remote_memory=memory,
            )
            offer.endpoint.connect(peer)
        except (KeyError, ValueError, TransportUnavailable) as exc:
            cls._undo(offer, peer, writes)
            raise ChannelClosed(f"cannot open nixl slot {handle.get('slot')}: {exc}") from exc
        except Exception as exc:
            cls._undo(offer, peer, writes)
            raise ChannelClosed(
                f"cannot open nixl slot {handle.get('slot')} on {host}: {type(exc).__name__}: {exc}"
            ) from exc
        offer.endpoint.open(peer, slot, generation)
        channel = cls(offer, slot, generation, peer, writes, inline)
        if offer.claims:
            try:
                channel._claim(timeout_s)
            except Exception as exc:
                channel.close()  # (a ping may be in flight: let go of once it is not)
                raise ChannelClosed(f"cannot open nixl slot {slot} on {host}: {exc}") from exc
        return channel

    def _claim(self, timeout_s: float) -> None:
        """Tells the server that the handshake's answer reached us: a ping that carries ``CLAIM``
        into the slot's flag word, waited for (it completes once the server took it). A server
        releases a slot whose client never claims it, so a slot whose answer was lost on the way
        is not held for as long as this process lives."""
        assert self.send_buffer is not None
        self.send_buffer[FLAG_OFFSET : FLAG_OFFSET + PING_BYTES] = CLAIM
        self.writes.ping()
        deadline = time.monotonic() + timeout_s
        while not self.writes.quiet():
            if time.monotonic() >= deadline:
                raise ChannelTimeout(f"the server did not take the claim of its slot within {timeout_s:g} s")
            time.sleep(50e-6)

    @staticmethod
    def _undo(offer: NixlOffer, peer: str | None, writes: TransferSet | None) -> None:
        """Nothing was written yet: everything is let go of at once (here, on this thread: a
        dropped NIXL handle would be released by the garbage collector, outside the endpoint's lock)."""
        if writes is not None:
            writes.release()
        if peer is not None:
            offer.endpoint.release_peer(peer)
        offer.close()

    # --- requests --------------------------------------------------------------------------------
    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        if self._gone is not None:
            raise ChannelClosed(self._gone)
        if self._expect is not None:
            raise ChannelClosed("a request is still outstanding on this slot")
        reduce_timer_slack_once()  # the sending thread waits: sleeps of µs, not 50 µs of slack on top
        self._seq += 1
        num_tokens, hidden = x.shape
        dtype = dtype_code(x.dtype)
        staged = is_staged(x, self.send_payload)  # built in place: nothing to copy
        size = self._writer.write(x, ids, weights, include_x=not staged)
        top_k = ids.shape[1]
        header = SlotHeader(FrameKind.REQUEST, dtype, layer, num_tokens, top_k, hidden, self._seq, size)
        if self.split:
            tail = header.pack()
        else:
            assert self.send_buffer is not None
            header.pack_into(self.send_buffer, HEADER_OFFSET)
            tail = b""
        if self.on_gpu:  # the copies into the send area are queued on the stream: NIXL reads after them
            torch.cuda.current_stream(self.send_payload.device).synchronize()
        self._expect = (self._seq, num_tokens, hidden, dtype)
        self._answer = False
        try:
            inline = size > 0 and frame_length(size) <= self.inline_bytes  # the whole frame in the notice
            if inline:
                assert self.send_buffer is not None
                tail = bytes(self.send_buffer[HEADER_OFFSET : PAYLOAD_OFFSET + size])
            request = notice(Notice.REQUEST, self.slot, self.generation, self._seq, tail)
            if inline:
                self.endpoint.notify(self.peer, request)
            else:
                self.writes.write_frame(size, request)
        except Exception as exc:
            self._gone = f"the server is gone ({type(exc).__name__}: {exc})"
            raise ChannelClosed(self._gone) from exc
        self._sent_at = time.monotonic()
        self._missed_s = 0.0
        self._next_ping = self._sent_at + LIVENESS_CHECK_S

    def staging(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if self._closed or self._expect is not None:
            return None
        return staged_x(self.send_payload, num_tokens, hidden, dtype, device)

    def _look(self) -> None:
        """Makes progress; notes our answer, a released slot or a dead server."""
        if self._gone is not None or self._answer:
            return
        endpoint = self.endpoint
        try:
            self.writes.settle()  # our request's notification may leave only from here
            endpoint.deliver()
            while (item := endpoint.take(self.peer, self.slot, self.generation)) is not None:
                kind, seq, tail = item
                if kind is Notice.OFFLINE:
                    self._gone = "the server released this slot"
                elif kind is Notice.ANSWER and self._expect is not None and seq == self._expect[0]:
                    self._answer = True
                    self._answer_tail = tail
                    if self._missed_s > 0:  # it came after the last look that missed it
                        self._learn(self._missed_s)  # (seen at the first look: nothing to learn)
            now = time.monotonic()
            if not self._answer:
                self._missed_s = now - self._sent_at
            if self._gone is None and not self._answer and now >= self._next_ping:
                self._next_ping = now + LIVENESS_CHECK_S
                self.writes.ping()
        except Exception as exc:
            self._gone = f"the server is gone ({type(exc).__name__}: {exc})"

    def answered(self) -> bool:
        if self._closed:
            return True
        self._look()
        return self._answer or self._gone is not None

    def _learn(self, took_s: float) -> None:
        usual = self._usual_s
        self._usual_s = took_s if usual is None or took_s < usual else usual + USUAL_RISE * (took_s - usual)
        self._spin_s = spin_for(self._usual_s)

    def poll_interval_s(self) -> float:
        return self._interval_after(time.monotonic() - self._sent_at)

    def _interval_after(self, waited: float) -> float:
        """How long to sleep before the next look, ``waited`` seconds after the send (0: look now)."""
        if waited < self._spin_s:
            return 0.0
        sleep = min(MAX_SLEEP_S, max(MIN_SLEEP_S, waited / 4))
        usual = self._usual_s
        if usual is None:
            return sleep
        wake = usual - WAKE_S
        if waited < wake:  # not past the time to be awake for the answer
            return min(sleep, max(MIN_SLEEP_S, wake - waited))
        if waited < usual + min(MAX_SPIN_S, max(SPIN_S, DUE_SPIN_FACTOR * usual)):
            return 0.0  # the answer is due
        return sleep

    def receive(self, deadline: float) -> torch.Tensor:
        if self._expect is None:
            raise RuntimeError("receive() without a request in flight")
        if self._closed:
            raise ChannelClosed("channel is closed")
        while True:
            self._look()
            if self._answer:
                return self._take_response()
            if self._gone is not None:
                self._expect = None
                raise ChannelClosed(self._gone)
            now = time.monotonic()
            if now >= deadline:
                raise ChannelTimeout(f"no response within the deadline (nixl slot {self.slot})")
            pause(min(self.poll_interval_s(), deadline - now))

    def _take_response(self) -> torch.Tensor:
        assert self._expect is not None
        seq, num_tokens, hidden, dtype = self._expect
        self._expect = None
        self._answer = False
        tail, self._answer_tail = self._answer_tail, b""
        inline = bool(tail) and not self.split  # the whole answer in its notice
        if (self.split or inline) and len(tail) < HEADER_SIZE:
            raise ChannelClosed(f"malformed response: a notice of {len(tail)} bytes where a header belongs")
        if inline and len(tail) > self.inline_bytes:
            raise ChannelClosed(
                f"malformed response: a frame of {len(tail)} bytes in a notice, where this channel "
                f"takes at most {self.inline_bytes}"
            )
        if self.split or inline:
            header = SlotHeader.unpack_from(tail, 0)
            message = memoryview(tail)[HEADER_SIZE:]
        else:
            assert self.answer_buffer is not None
            header = SlotHeader.unpack_from(self.answer_buffer, HEADER_OFFSET)
            message = self.answer_buffer[PAYLOAD_OFFSET:]
        try:
            check_response(header, seq, num_tokens, hidden, dtype)
            if header.payload_bytes > self.capacity_bytes:
                raise ProtocolError(Status.TOO_LARGE, f"response of {header.payload_bytes} bytes")
        except ProtocolError as exc:
            raise ChannelClosed(f"malformed response: {exc}") from exc
        if header.status != Status.OK:
            raise RemoteError(header.status, read_message(message, header))
        if self.split and len(message):
            raise ChannelClosed(
                f"malformed response: {len(message)} bytes after the header in a split frame's notice "
                "(its payload comes by WRITE)"
            )
        if inline:  # into the answer area, where a WRITE would have put it
            if len(message) != header.payload_bytes:
                raise ChannelClosed(
                    f"malformed response: {len(message)} payload bytes in the notice, the header says "
                    f"{header.payload_bytes}"
                )
            assert self.answer_buffer is not None
            self.answer_buffer[PAYLOAD_OFFSET : PAYLOAD_OFFSET + len(message)] = message
        return self._answer_view(header)

    def _answer_view(self, header: SlotHeader) -> torch.Tensor:
        """y [T, H] where the answer landed: the last shape's view again when the shape repeats (a
        decode step's layers), as making a view costs a round trip ~30 µs on the 2-core VM."""
        shape = (header.num_tokens, header.hidden, header.dtype)
        if self._last_view is None or self._last_view[0] != shape:
            self._last_view = (shape, read_response(self.answer_payload, header))
        return self._last_view[1]

    # --- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        endpoint = self.endpoint
        if self._gone is None:
            try:
                endpoint.notify(self.peer, notice(Notice.BYE, self.slot, self.generation))
                endpoint.deliver()  # a chance for the goodbye to leave
            except Exception:
                pass
        endpoint.forget(self.peer, self.slot, self.generation)
        del self.send_buffer, self.answer_buffer, self.send_payload, self.answer_payload, self._writer
        self._last_view = None
        # The areas stay registered, and the peer connected, until nothing of ours is in flight to
        # it (a hung server: until it answers or dies; nixl_endpoint's "Letting go").
        endpoint.retire(self.writes, then=self.offer_made.close)
