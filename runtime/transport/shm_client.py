"""``shm``, client side: one slot of a server's segment, its two doorbells and its liveness lock.

See ``shm_server`` for the protocol.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    FrameKind,
    ProtocolError,
    SlotHeader,
    SlotState,
    Status,
    check_response,
    dtype_code,
    read_message,
    read_response,
    write_request,
)
from eaas.runtime.transport import liveness
from eaas.runtime.transport.base import Channel, ChannelClosed, ChannelTimeout, RemoteError
from eaas.runtime.transport.doorbell import Doorbell
from eaas.runtime.transport.shm_segment import SHM_DIR, Segment, SegmentError, check_name

LIVENESS_CHECK_S = 0.02  # how often a waiting client checks that the server process lives


class ShmChannel(Channel):
    name = "shm"

    def __init__(self, segment: Segment, slot: int, request_bell: Doorbell, response_bell: Doorbell) -> None:
        self.segment = segment
        self.slot = slot
        self.request_bell = request_bell
        self.response_bell = response_bell
        self.buffer = segment.slot(slot)
        self.payload = self.buffer[PAYLOAD_OFFSET:]
        self.capacity_bytes = segment.capacity_bytes
        self._seq = 0
        self._expect: tuple[int, int, int, int] | None = None  # seq, tokens, hidden, dtype
        self._closed = False

    @classmethod
    def connect(cls, handle: dict[str, Any], host: str, timeout_s: float) -> ShmChannel:
        try:
            segment = Segment.attach(str(handle["segment"]))
        except SegmentError as exc:
            raise ChannelClosed(str(exc)) from exc
        slot = int(handle["slot"])
        bells: list[Doorbell] = []
        try:
            if not 0 <= slot < segment.num_slots:
                raise ChannelClosed(f"slot {slot} is outside the segment's {segment.num_slots} slots")
            for key in ("bell", "response_bell"):
                bells.append(Doorbell.open(SHM_DIR / check_name(str(handle[key]))))
            bells[1].drain()
            liveness.hold(segment.fd, segment.slot_offset(slot))
        except (OSError, SegmentError) as exc:
            for bell in bells:
                bell.close()
            segment.close()
            raise ChannelClosed(f"cannot open shm slot {slot} of {handle.get('segment')!r}: {exc}") from exc
        except BaseException:
            for bell in bells:
                bell.close()
            segment.close()
            raise
        return cls(segment, slot, bells[0], bells[1])

    def _flag(self) -> int:
        return int(self.segment.flags[self.slot])

    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        state = self._flag()
        if state == SlotState.OFFLINE:
            raise ChannelClosed("the server released this slot")
        if state != SlotState.IDLE:
            raise ChannelClosed(f"slot is {SlotState(state).name}, not IDLE: a request is still outstanding")
        self._seq += 1
        num_tokens, hidden = x.shape
        dtype = dtype_code(x.dtype)
        size = write_request(self.payload, x, ids, weights)
        header = SlotHeader(
            FrameKind.REQUEST, dtype, layer, num_tokens, ids.shape[1], hidden, self._seq, size
        )
        header.pack_into(self.buffer, HEADER_OFFSET)
        self._expect = (self._seq, num_tokens, hidden, dtype)
        self.segment.flags[self.slot] = SlotState.REQUEST_READY
        self.request_bell.ring()

    def receive(self, deadline: float) -> torch.Tensor:
        if self._expect is None:
            raise RuntimeError("receive() without a request in flight")
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while (state := self._flag()) != SlotState.RESPONSE_READY:
            if state == SlotState.OFFLINE:
                raise ChannelClosed("the server released this slot")
            now = time.monotonic()
            if now >= deadline:
                raise ChannelTimeout(
                    f"no response within the deadline (slot {self.slot} is {SlotState(state).name})"
                )
            if now >= next_check:
                next_check = now + LIVENESS_CHECK_S
                if not self.segment.server_alive():
                    raise ChannelClosed("the server process is gone")
            self.response_bell.wait(min(deadline, next_check) - now)
        seq, num_tokens, hidden, dtype = self._expect
        self._expect = None
        header = SlotHeader.unpack_from(self.buffer, HEADER_OFFSET)
        try:
            check_response(header, seq, num_tokens, hidden, dtype)
        except ProtocolError as exc:
            raise ChannelClosed(f"malformed response: {exc}") from exc
        if header.status != Status.OK:
            message = read_message(self.payload, header)
            self.segment.flags[self.slot] = SlotState.IDLE
            raise RemoteError(header.status, message)
        y = read_response(self.payload, header)
        self.segment.flags[self.slot] = SlotState.IDLE
        return y

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._flag() != SlotState.OFFLINE:
                self.segment.flags[self.slot] = SlotState.OFFLINE
            liveness.release(self.segment.fd, self.segment.slot_offset(self.slot))
        finally:
            del self.payload
            del self.buffer
            self.request_bell.close()
            self.response_bell.close()
            self.segment.close()
