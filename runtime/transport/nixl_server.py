"""``nixl``, server side: slots in NIXL-registered memory, written one-sidedly by clients on any host.

The server's arena is ``max_clients`` slots of the usual layout (``[flag | header | payload]``),
each registered with NIXL as a region of its own. A client's handshake carries an offer: its NIXL
agent's metadata and the address of its *answer area* (one slot's bytes, registered on its side).
The server loads that metadata, prepares the WRITEs from the slot onto the answer area and
answers with its own metadata for that one slot only, so a client can address its own slot and
nothing else (with RDMA the NIC enforces this: a region's key opens that region alone).

One exchange: the client WRITEs header and payload into its slot with the notification
``R|slot|generation|seq``; the server loop sees it (``poll``), computes, writes the answer into the
slot and WRITEs it into the client's answer area with ``A|slot|generation|seq``. The notification
arrives only once the bytes are there. A small frame (at most the ``inline_bytes`` both agreed in
the handshake: host-memory slots only) travels whole in its notification instead, with no WRITE:
the server copies a request's frame into the slot, the client an answer's into its answer area
(``nixl_endpoint``, "Small frames"). A request's frame in a notice that is larger than agreed,
or whose payload is not the size its header says, is dropped and counted like a stolen slot's.
Over RDMA the NIC places a WRITE's bytes and the server's CPU only reads the notification; over
UCX's TCP transport (a plain pod network) UCX receives them inside the server's own progress
calls, without a thread of its own.

Notifications carry the sender's agent name: one about a slot that agent does not hold (a stolen
slot), or about a generation of the slot that has ended, is dropped. A client that leaves says
``B`` (and its HTTP ``DELETE``); one that dies is found by ``reap``, which pings every attached
client (a 4-byte WRITE into its answer area's flag word): UCX reports the broken endpoint, and the
slot is released. A slot the server releases is announced with ``O``, so a waiting client fails
over at once.

Memory: a slot's payload is where the client's areas are, as far as this server can. A client in
host memory gets a slot in host memory, with whole frames (a GPU server copies the request to
its device, as with ``tcp``). A client in GPU memory gets, from a server computing on a GPU, a slot
whose payload is GPU memory, registered as ``VRAM``, with split frames (``nixl_endpoint``): each
request's header arrives in its notification and is kept in a small host-memory *control* slot
(flag, header, an error message), while x, ids and weights stay on the GPU where the client's
WRITE put them (UCX ``cuda_ipc`` between processes of one node, GPUDirect RDMA across nodes).
Before such an answer's WRITE the server waits for its compute stream: a NIXL transfer is posted by
the CPU and is not ordered after GPU work. A client puts its areas in GPU memory when the server
computes on a GPU and it has one itself (``nixl_client.area_memory``); a server on a CPU refuses
an offer of GPU memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eaas.runtime.protocol import (
    FLAG_OFFSET,
    HEADER_OFFSET,
    HEADER_SIZE,
    MAX_MESSAGE_BYTES,
    PAYLOAD_OFFSET,
    SlotHeader,
    SlotState,
    Status,
    slot_stride,
)
from eaas.runtime.transport.base import (
    OfferRefused,
    Request,
    ServerTransport,
    SlotsExhausted,
    TransportOptions,
)
from eaas.runtime.transport.nixl_endpoint import (
    AGENT_NAME,
    CLAIM,
    HOST,
    INLINE_BYTES,
    PING_BYTES,
    Endpoint,
    Memory,
    Notice,
    TransferSet,
    address,
    decode,
    encode,
    frame_length,
    host_memory,
    notice,
)
from eaas.runtime.transport.polling import PollingWaiter

log = logging.getLogger("eaas.transport")

SPIN_S = 1e-3  # keep polling without sleeping this long after a request or an answer
MIN_SLEEP_S = 20e-6  # then sleep between polls, from this...
MAX_SLEEP_S = 1e-3  # ...doubling up to this (an idle server wakes ~1,000 times a second)
CLOSE_NOTICE_S = 0.05  # on close, how long the OFFLINE notices get to leave
CONTROL_STRIDE = PAYLOAD_OFFSET + MAX_MESSAGE_BYTES  # split frames: a slot's host-memory part


@dataclass
class _Slot:
    client_id: str
    peer: str  # the client's NIXL agent
    generation: int
    writes: TransferSet  # slot -> the client's answer area
    memory: Memory  # where the slot's payload is: host memory, or GPU memory for a client in GPU memory
    buffer: memoryview  # the slot's host-memory part (``_slot_buffer``)
    payload: memoryview | torch.Tensor | None  # ``Request.payload`` (``_payload``)
    inline_bytes: int = 0  # frames up to this size travel in the notices, both ways (nixl_endpoint)
    claimed: bool = True  # False until a client that claims its slot (``claim_ping``) did
    attached_at: float = 0.0
    requests: int = 0
    state: SlotState = SlotState.IDLE

    @property
    def split(self) -> bool:
        return self.writes.split


class NixlServerTransport(ServerTransport):
    name = "nixl"

    # True: slots in host memory split their frames too (tests: a GPU slot's framing, checked on a
    # machine without a GPU). Slots in GPU memory always split them.
    split_host_frames = False
    # The largest frame a slot takes and sends in a notification (0: every frame by WRITE; tests).
    inline_bytes = INLINE_BYTES

    def __init__(self, options: TransportOptions) -> None:
        self.options = options
        self.capacity_bytes = options.capacity_bytes
        self.stride = slot_stride(options.capacity_bytes)
        # On a GPU every slot exists twice: in GPU memory for a client whose areas are GPU memory,
        # in host memory for one whose areas are host memory (UCX between the host memory of one
        # process and the GPU memory of another stages the bytes: on one H200 node ~190x slower
        # than GPU to GPU at 512 tokens, docs/benchmarks.md). Host memory is cheap; the GPU's is
        # not doubled.
        self.host_arena = host_memory(options.max_clients * self.stride)  # (on huge pages)
        self.gpu: Memory | None = None
        self.gpu_arena: torch.Tensor | None = None
        device = torch.device(options.device)
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            self.gpu = Memory("VRAM", index)
            self.gpu_arena = torch.zeros(
                options.max_clients * self.stride, dtype=torch.uint8, device=torch.device("cuda", index)
            )
        # Split frames: a host-memory control slot each (flag, header, an error message).
        self.control = np.zeros(options.max_clients * CONTROL_STRIDE, dtype=np.uint8)
        self.endpoint = Endpoint("server")
        self._registrations: dict[tuple[str, int], Any] = {}  # (memory kind, slot) -> registration
        try:
            for slot in range(options.max_clients):
                for memory in (HOST, self.gpu):
                    if memory is not None:
                        self._registrations[(memory.kind, slot)] = self.endpoint.register(
                            self._address(slot, memory), self.stride, memory
                        )
        except BaseException:
            self._deregister()
            raise
        self._lock = threading.RLock()
        self._slots: dict[int, _Slot] = {}
        self._reserved: set[int] = set()  # slots being attached (their offer is being checked)
        self._generations = [0] * options.max_clients
        self._released: dict[int, str] = {}  # slot -> last client, shown as OFFLINE until re-attached
        self._released_at = [0.0] * options.max_clients  # (a free slot released longest ago goes first)
        self._ready: list[int] = []  # slots whose request notification arrived
        self._lost: list[int] = []  # slots released since the last reap (client gone or said goodbye)
        self.refused_notices = 0  # notifications about a slot the sender does not hold, or malformed
        self._waiter = PollingWaiter(SPIN_S, MIN_SLEEP_S, MAX_SLEEP_S)

    def describe(self) -> dict[str, Any]:
        """The memories its slots can be in (``/v1/info``): a client offers GPU memory only where
        ``VRAM`` is listed (a server of an earlier version lists nothing: host memory only)."""
        return {"memory": [m.kind for m in (HOST, self.gpu) if m is not None]}

    def _address(self, slot: int, memory: Memory) -> int:
        if memory.kind == "VRAM":
            assert self.gpu_arena is not None
            return int(self.gpu_arena.data_ptr()) + slot * self.stride
        return int(self.host_arena.ctypes.data) + slot * self.stride

    def _slot_buffer(self, slot: int, split: bool) -> memoryview:
        """The slot's host-memory part: the whole slot (whole frames) or its control slot (split)."""
        if split:
            return self.control.data[slot * CONTROL_STRIDE : (slot + 1) * CONTROL_STRIDE]
        return self.host_arena.data[slot * self.stride : (slot + 1) * self.stride]

    def _payload(self, slot: int, split: bool, memory: Memory) -> memoryview | torch.Tensor | None:
        """Where a split slot's request is read and its answer written (``Request.payload``); None
        for whole frames (the slot buffer's payload, the default)."""
        start = slot * self.stride + PAYLOAD_OFFSET
        if memory.kind == "VRAM":
            assert self.gpu_arena is not None
            return self.gpu_arena[start : start + self.capacity_bytes]
        if split:
            return self.host_arena.data[start : start + self.capacity_bytes]
        return None

    def _clear(self, slot: int, memory: Memory) -> None:
        """Zeroes a slot for its next holder (on the GPU: done, with whatever the loop's stream still
        had queued, before a client may write)."""
        self.host_arena[slot * self.stride : (slot + 1) * self.stride] = 0
        self.control[slot * CONTROL_STRIDE : (slot + 1) * CONTROL_STRIDE] = 0
        if memory.kind == "VRAM" and self.gpu_arena is not None:
            self.gpu_arena[slot * self.stride : (slot + 1) * self.stride].zero_()
            torch.cuda.synchronize(self.gpu_arena.device)

    # --- handshake (control thread) --------------------------------------------------------------
    def attach(self, client_id: str, offer: dict[str, Any] | None = None) -> dict[str, Any]:
        metadata, answer_address, answer_bytes, answer_memory, offered_inline, claims = self._read_offer(
            offer
        )
        memory = HOST  # the slot's payload: with the client's areas, where this server has them
        if answer_memory.kind == "VRAM":
            if self.gpu is None:
                raise OfferRefused(
                    "offer.answer_memory: VRAM, but this server computes on the CPU and has no slots "
                    "in GPU memory (its /v1/info lists transports.nixl.memory); offer DRAM"
                )
            memory = self.gpu
        split = memory.kind == "VRAM" or self.split_host_frames
        inline = 0 if split else min(offered_inline, self.inline_bytes, frame_length(self.capacity_bytes))
        with self._lock:
            taken = self._slots.keys() | self._reserved
            free = [s for s in range(self.options.max_clients) if s not in taken]
            if not free:
                raise SlotsExhausted(f"all {self.options.max_clients} nixl slots are attached")
            # Its former holder's key still opens a slot (nixl_endpoint: registered once); a holder
            # that has not seen its release yet (hung, cut off) may still write into it.
            slot = min(free, key=self._released_at.__getitem__)
            self._reserved.add(slot)
        peer = None
        writes: TransferSet | None = None
        try:
            peer = self._load_peer(metadata)
            try:
                writes = TransferSet(
                    self.endpoint,
                    peer,
                    self._address(slot, memory),
                    answer_address,
                    self.capacity_bytes,
                    split=split,
                    local_memory=memory,
                    remote_memory=answer_memory,
                )
            except Exception as exc:
                raise OfferRefused(
                    f"offer.answer_address: [{answer_address:#x}, +{answer_bytes}) is not memory the "
                    f"client's agent registered (as {answer_memory.kind}; {type(exc).__name__}: {exc})"
                ) from exc
            try:
                self.endpoint.connect(peer)
            except Exception as exc:
                raise OfferRefused(
                    f"offer.agent_metadata: its agent cannot be reached at the connection details it "
                    f"gives ({type(exc).__name__}: {exc})"
                ) from exc
        except BaseException:
            with self._lock:
                self._reserved.discard(slot)
                if writes is not None:  # nothing written yet: released here, under the lock
                    writes.release()
                if peer is not None:
                    self.endpoint.release_peer(peer)
            raise
        with self._lock:
            self._reserved.discard(slot)
            self._generations[slot] += 1
            self._clear(slot, memory)
            buffer = self._slot_buffer(slot, split)
            payload = self._payload(slot, split, memory)
            self._slots[slot] = _Slot(
                client_id,
                peer,
                self._generations[slot],
                writes,
                memory,
                buffer,
                payload,
                inline,
                claimed=not claims or memory.kind == "VRAM",  # (a claim is read in host memory)
                attached_at=time.monotonic(),
            )
            self._released.pop(slot, None)
            self._ready = [s for s in self._ready if s != slot]
        registration = self._registrations[(memory.kind, slot)]
        return {
            "transport": self.name,
            "slot": slot,
            "agent": self.endpoint.name,
            "agent_metadata": encode(self.endpoint.metadata(registration)),
            "generation": self._generations[slot],
            "slot_address": self._address(slot, memory),
            "capacity_bytes": self.capacity_bytes,
            "memory": memory.kind,
            "device_id": memory.device,
            "split_frames": split,
            "inline_bytes": inline,
        }

    def _read_offer(self, offer: dict[str, Any] | None) -> tuple[bytes, int, int, Memory, int, bool]:
        if not isinstance(offer, dict):
            raise OfferRefused(
                "offer: transport nixl needs the client's NIXL agent metadata and answer area "
                "(agent_metadata, answer_address, answer_bytes)"
            )
        metadata = decode(offer.get("agent_metadata"), "offer.agent_metadata")
        answer_address = address(offer.get("answer_address"), "offer.answer_address")
        answer_bytes = offer.get("answer_bytes")
        if type(answer_bytes) is not int or answer_bytes < self.stride:
            raise OfferRefused(
                f"offer.answer_bytes: this server's answers need {self.stride} bytes "
                f"(slots of {self.capacity_bytes} payload bytes), got {answer_bytes!r}"
            )
        memory = HOST  # (a client that names none offers host memory)
        if "answer_memory" in offer:
            kind, device = offer.get("answer_memory"), offer.get("answer_device")
            memory = Memory.read(kind, device, "offer.answer_memory")
        inline = offer.get("inline_bytes", 0)  # (a client of an earlier version offers none)
        if type(inline) is not int or inline < 0:
            raise OfferRefused(f"offer.inline_bytes: a non-negative integer is required, got {inline!r}")
        claims = offer.get("claim_ping", False)  # (a client of an earlier version does not claim)
        if type(claims) is not bool:
            raise OfferRefused(f"offer.claim_ping: true or false, got {claims!r}")
        return metadata, answer_address, answer_bytes, memory, inline, claims

    def _load_peer(self, metadata: bytes) -> str:
        try:
            peer = self.endpoint.add_peer(metadata)
        except Exception as exc:
            raise OfferRefused(
                f"offer.agent_metadata: NIXL refused it ({type(exc).__name__}: {exc}); a client "
                "agent's metadata with its connection details, as the EaaS client sends, is required"
            ) from exc
        if not AGENT_NAME.match(peer) or peer == self.endpoint.name:
            self.endpoint.release_peer(peer)
            raise OfferRefused(f"offer.agent_metadata: names agent {peer!r}, not an EaaS client's agent")
        return peer

    def detach(self, slot: int) -> bool:
        with self._lock:
            return self._release(slot, announce=True)

    def _release(self, slot: int, announce: bool) -> bool:  # caller holds the lock
        info = self._slots.pop(slot, None)
        if info is None:
            return False
        self._released[slot] = info.client_id
        self._released_at[slot] = time.monotonic()
        if announce:  # a client waiting on this slot fails over at once
            try:
                self.endpoint.notify(info.peer, notice(Notice.OFFLINE, slot, info.generation))
            except Exception as exc:
                log.debug("nixl slot %d: telling %s it is offline failed: %s", slot, info.peer, exc)
        # The slot's answer WRITEs and its hold on the client's agent go once nothing of them is in
        # flight (a hung client: once it answers or dies; nixl_endpoint's "Letting go").
        self.endpoint.retire(info.writes)
        return True

    def _lose(self, slot: int, reason: str, announce: bool = False) -> None:  # caller holds the lock
        if self._release(slot, announce=announce):
            log.info("nixl slot %d released: %s", slot, reason)
            self._lost.append(slot)

    # --- server loop -----------------------------------------------------------------------------
    def _pump(self) -> bool:
        """Takes new notifications and progresses answers in flight; True if a request is ready."""
        notices = self.endpoint.collect()
        with self._lock:
            for peer, kind, slot, generation, _seq, tail in notices:
                info = self._slots.get(slot)
                if info is None or info.peer != peer or info.generation & 0xFFFFFFFF != generation:
                    self.refused_notices += 1  # not this sender's slot (or released): never served
                    continue
                info.claimed = True
                if kind is Notice.REQUEST and info.state is not SlotState.REQUEST_READY:
                    if len(tail) > HEADER_SIZE and not info.split:  # the whole frame in the notice
                        if not self._inline_fits(info, tail):
                            self.refused_notices += 1
                            continue
                        info.buffer[HEADER_OFFSET : HEADER_OFFSET + len(tail)] = tail
                    elif len(tail) != (HEADER_SIZE if info.split else 0):
                        self.refused_notices += 1  # a request without its header (or with one too many)
                        continue
                    elif info.split:
                        info.buffer[HEADER_OFFSET : HEADER_OFFSET + HEADER_SIZE] = tail
                    info.state = SlotState.REQUEST_READY
                    self._ready.append(slot)
                elif kind is Notice.BYE:
                    self._lose(slot, f"client {info.client_id} said goodbye")
            for slot, info in list(self._slots.items()):
                try:
                    info.writes.settle()
                except Exception as exc:
                    self._lose(slot, f"answer to {info.client_id} failed ({type(exc).__name__}: {exc})")
            if self._ready:
                self._waiter.activity()
            return bool(self._ready)

    @staticmethod
    def _inline_fits(info: _Slot, tail: bytes) -> bool:
        """A frame in a request's notice: no larger than the slot agreed to, and exactly the header's
        payload after the header (the request's checks then read it in the slot as usual)."""
        if len(tail) > info.inline_bytes:
            return False
        return SlotHeader.unpack_from(tail, 0).payload_bytes == len(tail) - HEADER_SIZE

    def poll(self) -> list[Request]:
        if not self._ready:  # (``wait`` just pumped the ones it returned for)
            self._pump()
        with self._lock:
            ready, self._ready = self._ready, []
            requests = []
            for slot in ready:
                info = self._slots.get(slot)
                if info is None:
                    continue
                info.requests += 1
                header = SlotHeader.unpack_from(info.buffer, HEADER_OFFSET)
                requests.append(Request(self.name, slot, info.generation, header, info.buffer, info.payload))
        return requests

    def wait(self, timeout_s: float) -> None:
        self._waiter.wait(self._pump, timeout_s)

    def watch(self, fd: int) -> bool:
        self._waiter.watch(fd)
        return True

    def respond(self, request: Request, answer: Callable[[], SlotHeader]) -> None:
        with self._lock:  # (``attach`` gives a slot to its next holder under it)
            info = self._slots.get(request.slot)
            if info is None or info.generation != request.generation:
                return  # the client left while we computed: its answer is not written at all
            header = answer()
            payload = request.payload
            if header.status == Status.OK and isinstance(payload, torch.Tensor) and payload.is_cuda:
                torch.cuda.current_stream(payload.device).synchronize()  # y written: NIXL may read it
            header.pack_into(request.slot_buffer, HEADER_OFFSET)
            try:
                tail, payload_bytes = b"", header.payload_bytes
                if info.split:  # the header in the notice; an error's message too, with no WRITE
                    tail = header.pack()
                    if header.status != Status.OK:
                        message = request.slot_buffer[PAYLOAD_OFFSET : PAYLOAD_OFFSET + payload_bytes]
                        tail, payload_bytes = tail + bytes(message), 0
                elif payload_bytes > 0 and HEADER_SIZE + payload_bytes <= info.inline_bytes:
                    tail = bytes(request.slot_buffer[HEADER_OFFSET : PAYLOAD_OFFSET + payload_bytes])
                answered = notice(Notice.ANSWER, request.slot, info.generation, header.seq, tail)
                if tail and not info.split:  # the whole frame is in the notice
                    self.endpoint.notify(info.peer, answered)
                else:
                    info.writes.write_frame(payload_bytes, answered)
            except Exception as exc:  # (a client still there fails over at once, not at its deadline)
                reason = f"answer to {info.client_id} failed ({type(exc).__name__}: {exc})"
                self._lose(request.slot, reason, announce=True)
                return
            info.state = SlotState.IDLE  # the client's next request may come as soon as it reads this
            self._waiter.activity()  # spin from the answer too: its flush needs our progress

    def reap(self) -> list[int]:
        """Pings every attached client (UCX reports one whose process is gone) and releases the slots
        of clients that did not claim theirs within ``attach_grace_s``; returns the slots released
        since the last call."""
        now = time.monotonic()
        with self._lock:
            for slot, info in list(self._slots.items()):
                if not info.claimed:
                    start = slot * self.stride + FLAG_OFFSET
                    info.claimed = bytes(self.host_arena[start : start + PING_BYTES]) == CLAIM
                    if not info.claimed and now - info.attached_at > self.options.attach_grace_s:
                        self._lose(
                            slot,
                            f"client {info.client_id} never claimed it within "
                            f"{self.options.attach_grace_s:g} s of the handshake (its answer lost?)",
                        )
                        continue
                try:
                    info.writes.ping()
                except Exception as exc:
                    self._lose(slot, f"client {info.client_id} is gone ({type(exc).__name__}: {exc})")
            reaped, self._lost = self._lost, []
        return reaped

    def slots(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = [
                {"slot": s, "client_id": i.client_id, "state": i.state.name, "requests": i.requests}
                for s, i in self._slots.items()
            ]
            rows += [
                {"slot": s, "client_id": cid, "state": SlotState.OFFLINE.name, "requests": 0}
                for s, cid in self._released.items()
            ]
        return sorted(rows, key=lambda row: row["slot"])

    def close(self) -> None:
        with self._lock:
            announced = [self._release(slot, announce=True) for slot in list(self._slots)]
        deadline = time.monotonic() + (CLOSE_NOTICE_S if announced else 0.0)
        while time.monotonic() < deadline and self.endpoint.retiring():  # the OFFLINE notices leave
            self.endpoint.collect()
            time.sleep(1e-3)
        held = self.endpoint.held_back()  # peers that may still have our WRITEs in flight
        for peer in self.endpoint.peers():
            while peer in self.endpoint.peers() and peer not in held:
                self.endpoint.release_peer(peer)
        if held:  # kept registered (and the arena alive with the agent) rather than freed under a WRITE
            log.info(
                "nixl: %d client(s) did not take the last notices; their connections stay open", len(held)
            )
            self.endpoint.keep_alive(self.host_arena)
            if self.gpu_arena is not None:
                self.endpoint.keep_alive(self.gpu_arena)
            return
        self._deregister()

    def _deregister(self) -> None:
        for registration in self._registrations.values():
            try:
                self.endpoint.deregister(registration)
            except Exception as exc:
                log.debug("deregistering a nixl slot: %s", exc)
        self._registrations = {}
