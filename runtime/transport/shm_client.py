"""``shm``, client side: one slot of a server's segment, its two doorbells and its liveness lock.

See ``shm_server`` for the protocol.
"""

from __future__ import annotations

from typing import Any

import torch

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    FrameKind,
    RequestWriter,
    SlotHeader,
    SlotState,
    dtype_code,
    is_staged,
    staged_x,
)
from eaas.runtime.transport import liveness
from eaas.runtime.transport.base import ChannelClosed, Offer
from eaas.runtime.transport.doorbell import Doorbell
from eaas.runtime.transport.segment_channel import SegmentChannel
from eaas.runtime.transport.shm_segment import SHM_DIR, Segment, SegmentError, check_name


class ShmChannel(SegmentChannel):
    name = "shm"

    def __init__(self, segment: Segment, slot: int, request_bell: Doorbell, response_bell: Doorbell) -> None:
        super().__init__(segment, slot, segment.slot(slot)[PAYLOAD_OFFSET:])
        self.request_bell = request_bell
        self.response_bell = response_bell
        self.capacity_bytes = segment.capacity_bytes
        # The payload as bytes: x is built there in place (``staging``).
        self.payload_bytes = torch.frombuffer(self.payload, dtype=torch.uint8, count=self.capacity_bytes)
        self._writer = RequestWriter(self.payload_bytes)

    @classmethod
    def connect(
        cls, handle: dict[str, Any], host: str, timeout_s: float, offer: Offer | None = None
    ) -> ShmChannel:
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

    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._check_idle()
        self._seq += 1
        num_tokens, hidden = x.shape
        dtype = dtype_code(x.dtype)
        staged = is_staged(x, self.payload_bytes)  # built in place: nothing to copy
        size = self._writer.write(x, ids, weights, include_x=not staged)
        header = SlotHeader(
            FrameKind.REQUEST, dtype, layer, num_tokens, ids.shape[1], hidden, self._seq, size
        )
        header.pack_into(self.buffer, HEADER_OFFSET)
        self._expect = (self._seq, num_tokens, hidden, dtype)
        self.segment.flags[self.slot] = SlotState.REQUEST_READY
        self.request_bell.ring()

    def staging(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if self._closed or self._expect is not None:
            return None
        return staged_x(self.payload_bytes, num_tokens, hidden, dtype, device)

    def _pause(self, timeout_s: float) -> None:
        self.response_bell.wait(timeout_s)

    def wakeup_fd(self) -> int:
        return self.response_bell.fileno()

    def clear_wakeup(self) -> None:
        self.response_bell.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._say_goodbye()
        finally:
            del self.payload, self.payload_bytes, self._writer  # (views of the segment)
            del self.buffer
            self.request_bell.close()
            self.response_bell.close()
            self.segment.close()
