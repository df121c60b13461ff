"""``SegmentChannel``: what the ``shm`` and ``cuda_ipc`` clients share — a slot of an shm segment.

The slot's flag, header and error message are in the segment (host memory); the payload is the
slot's own bytes (``shm``) or device memory (``cuda_ipc``). This class checks that a request may
be written, waits for the answer with a deadline while watching the server's liveness lock, reads
the answer, and says goodbye; subclasses say how to wait a moment and how to write a request.
"""

from __future__ import annotations

import time
from abc import abstractmethod

import torch

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    ProtocolError,
    SlotHeader,
    SlotState,
    Status,
    check_response,
    read_message,
    read_response,
)
from eaas.runtime.protocol.payload import Payload
from eaas.runtime.transport import liveness
from eaas.runtime.transport.base import Channel, ChannelClosed, ChannelTimeout, RemoteError
from eaas.runtime.transport.shm_segment import Segment

LIVENESS_CHECK_S = 0.02  # how often a waiting client checks that the server process lives


class SegmentChannel(Channel):
    def __init__(self, segment: Segment, slot: int, payload: Payload) -> None:
        self.segment = segment
        self.slot = slot
        self.buffer = segment.slot(slot)  # [flag | header | payload or error message]
        self.payload = payload
        self._seq = 0
        self._expect: tuple[int, int, int, int] | None = None  # seq, tokens, hidden, dtype
        self._closed = False
        self._next_liveness_check = 0.0

    def _flag(self) -> int:
        return int(self.segment.flags[self.slot])

    def _check_idle(self) -> None:
        """Raises ``ChannelClosed`` unless a new request may be written now."""
        if self._closed:
            raise ChannelClosed("channel is closed")
        state = self._flag()
        if state == SlotState.OFFLINE:
            raise ChannelClosed("the server released this slot")
        if state != SlotState.IDLE:
            raise ChannelClosed(f"slot is {SlotState(state).name}, not IDLE: a request is still outstanding")

    @abstractmethod
    def _pause(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the flag to change (or less: the flag is checked again)."""

    def answered(self) -> bool:
        if self._flag() in (SlotState.RESPONSE_READY, SlotState.OFFLINE):
            return True
        now = time.monotonic()
        if now < self._next_liveness_check:
            return False
        self._next_liveness_check = now + LIVENESS_CHECK_S
        return not self.segment.server_alive()

    def receive(self, deadline: float) -> torch.Tensor:
        if self._expect is None:
            raise RuntimeError("receive() without a request in flight")
        next_check = time.monotonic()  # liveness first: a dead server fails at once
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
            self._pause(min(deadline, next_check) - now)
        return self._take_response()

    def _take_response(self) -> torch.Tensor:
        """The answer y [T, H] (a view of the payload), or ``RemoteError``; the slot goes ``IDLE``."""
        assert self._expect is not None
        seq, num_tokens, hidden, dtype = self._expect
        self._expect = None
        header = SlotHeader.unpack_from(self.buffer, HEADER_OFFSET)
        try:
            check_response(header, seq, num_tokens, hidden, dtype)
        except ProtocolError as exc:
            raise ChannelClosed(f"malformed response: {exc}") from exc
        if header.status != Status.OK:
            message = read_message(self.buffer[PAYLOAD_OFFSET:], header)
            self.segment.flags[self.slot] = SlotState.IDLE
            raise RemoteError(header.status, message)
        y = read_response(self.payload, header)
        self.segment.flags[self.slot] = SlotState.IDLE
        return y

    def _say_goodbye(self) -> None:
        """Sets the slot ``OFFLINE`` (unless the server did) and drops our liveness lock."""
        if self._flag() != SlotState.OFFLINE:
            self.segment.flags[self.slot] = SlotState.OFFLINE
        liveness.release(self.segment.fd, self.segment.slot_offset(self.slot))
