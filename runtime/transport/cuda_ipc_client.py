"""``cuda_ipc``, client side: one slot of a GPU expert server on this node.

See ``cuda_ipc_server`` for the layout and the exchange. Two ways to use a channel:

- **eager** (``send``/``receive``, the ``Channel`` interface): payload copies and the
  ``REQUEST_READY`` write go on the current stream; the CPU polls the flag in host memory with
  a deadline and the server's liveness, so a dead server is seen at once (failover as on CPU).
- **captured** (``send_async``/``wait_async``): every step is stream work — copies, header and
  flag writes, a wait for ``RESPONSE_READY`` and the reset to ``IDLE`` (values fixed at capture:
  set, wait-equal, reset) — so a whole MoE layer fits in one CUDA graph with no CPU on the path.
  After a replay the CPU compares the slot's refusal count (``refusals``/``last_refusal``), and
  ``abandon_wait`` releases a stream left waiting on a server that died.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from eaas.runtime.protocol import (
    FLAG_OFFSET,
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    FrameKind,
    SlotHeader,
    SlotState,
    Status,
    dtype_code,
    read_message,
    read_response,
    request_layout,
    write_request,
)
from eaas.runtime.transport import liveness
from eaas.runtime.transport.base import ChannelClosed, Offer, RemoteError
from eaas.runtime.transport.cuda_driver import CudaError, HostMapping, ImportedArena, MemOps
from eaas.runtime.transport.cuda_ipc_server import REFUSALS_OFFSET, receive_arena_fd
from eaas.runtime.transport.segment_channel import SegmentChannel
from eaas.runtime.transport.shm_segment import Segment, SegmentError, check_name

log = logging.getLogger("eaas.transport")

CLOSE_WAIT_S = 5.0  # how long close() waits for queued GPU work on the slot before leaking it


class CudaIpcChannel(SegmentChannel):
    name = "cuda_ipc"

    def __init__(
        self, segment: Segment, slot: int, mapping: HostMapping, arena: ImportedArena, handle: dict[str, Any]
    ) -> None:
        self.capacity_bytes = int(handle["capacity_bytes"])
        offset = int(handle["payload_offset"])
        # The payload is device memory (uint8); flag, header and error messages stay in the segment.
        super().__init__(segment, slot, arena.tensor[offset : offset + self.capacity_bytes])
        self.mapping = mapping
        self.arena = arena
        self.device = arena.device
        base = segment.slot_offset(slot)
        self.flag_address = mapping.device_pointer(base + FLAG_OFFSET)
        self.header_address = mapping.device_pointer(base + HEADER_OFFSET)

    @classmethod
    def connect(
        cls, handle: dict[str, Any], host: str, timeout_s: float, offer: Offer | None = None
    ) -> CudaIpcChannel:
        if not torch.cuda.is_available():
            raise ChannelClosed("transport cuda_ipc: this client sees no CUDA device")
        device = torch.cuda.current_device()
        try:
            segment = Segment.attach(str(handle["segment"]))
        except SegmentError as exc:
            raise ChannelClosed(f"{exc} (cuda_ipc needs the server on this node)") from exc
        slot = int(handle["slot"])
        mapping: HostMapping | None = None
        try:
            if not 0 <= slot < segment.num_slots:
                raise ChannelClosed(f"slot {slot} is outside the segment's {segment.num_slots} slots")
            offset, capacity = int(handle["payload_offset"]), int(handle["capacity_bytes"])
            if offset < 0 or capacity < 0 or offset + capacity > int(handle["arena_bytes"]):
                raise ChannelClosed(f"slot {slot}: payload [{offset}, +{capacity}) is outside the arena")
            mapping = HostMapping(segment.buffer, device)
            fd = receive_arena_fd(check_name(str(handle["arena_socket"])), timeout_s)
            try:
                arena = ImportedArena(fd, int(handle["arena_bytes"]), device)
            finally:
                os.close(fd)
            liveness.hold(segment.fd, segment.slot_offset(slot))
        except (OSError, CudaError, KeyError, ValueError) as exc:
            if mapping is not None:
                mapping.close()
            segment.close()
            raise ChannelClosed(
                f"cannot open cuda_ipc slot {slot} of {handle.get('segment')!r}: {exc}"
            ) from exc
        except BaseException:
            if mapping is not None:
                mapping.close()
            segment.close()
            raise
        return cls(segment, slot, mapping, arena, handle)

    def _header(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> SlotHeader:
        num_tokens, hidden = x.shape
        dtype = dtype_code(x.dtype)
        size = request_layout(num_tokens, ids.shape[1], hidden, dtype).total
        return SlotHeader(FrameKind.REQUEST, dtype, layer, num_tokens, ids.shape[1], hidden, self._seq, size)

    # --- eager -----------------------------------------------------------------------------------
    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._check_idle()
        self._seq += 1
        header = self._header(layer, x, ids)
        write_request(self.payload, x, ids, weights)  # copies on the current stream
        header.pack_into(self.buffer, HEADER_OFFSET)  # read by the server only after the flag
        MemOps().write(self.flag_address, SlotState.REQUEST_READY).enqueue()
        self._expect = (self._seq, header.num_tokens, header.hidden, header.dtype)

    def _pause(self, timeout_s: float) -> None:
        time.sleep(0)  # the answer is a GPU write to host memory: nothing to block on; let others run

    # --- captured --------------------------------------------------------------------------------
    def send_async(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Stream work only: payload copies, then header and ``REQUEST_READY`` as stream writes."""
        self._check_idle()
        self._seq += 1
        header = self._header(layer, x, ids)
        write_request(self.payload, x, ids, weights)
        MemOps().write_bytes(self.header_address, header.pack()).write(
            self.flag_address, SlotState.REQUEST_READY
        ).enqueue()
        self._expect = (self._seq, header.num_tokens, header.hidden, header.dtype)

    def wait_async(self) -> torch.Tensor:
        """Stream work only: wait for ``RESPONSE_READY``, reset to ``IDLE``; returns the y [T, H] view."""
        if self._expect is None:
            raise RuntimeError("wait_async() without a request in flight")
        MemOps().wait_equal(self.flag_address, SlotState.RESPONSE_READY).write(
            self.flag_address, SlotState.IDLE
        ).enqueue()
        _, num_tokens, hidden, dtype = self._expect
        return read_response(
            self.payload, SlotHeader(FrameKind.RESPONSE, dtype, 0, num_tokens, 0, hidden, 0, 0)
        )

    def finish_async(self) -> None:
        """Forget the captured request (call after the graph is dropped, before eager use)."""
        self._expect = None

    def abandon_wait(self) -> None:
        """Releases a stream waiting on this slot's answer (the server died): the answer is garbage."""
        if self._flag() in (SlotState.REQUEST_READY, SlotState.SERVING):
            self.segment.flags[self.slot] = SlotState.RESPONSE_READY

    def refusals(self) -> int:
        """Requests of this slot the server refused so far (see ``REFUSALS_OFFSET``): a captured
        client cannot read each answer's status, so it compares this count after a replay."""
        return int.from_bytes(self.buffer[REFUSALS_OFFSET : REFUSALS_OFFSET + 4], "little")

    def last_refusal(self) -> RemoteError:
        """The last refused request's status and message, as the error to raise."""
        header = SlotHeader.unpack_from(self.buffer, HEADER_OFFSET)
        if header.status != Status.OK:
            return RemoteError(header.status, read_message(self.buffer[PAYLOAD_OFFSET:], header))
        text = bytes(self.buffer[PAYLOAD_OFFSET : PAYLOAD_OFFSET + 1024]).split(b"\0", 1)[0]
        return RemoteError(Status.INTERNAL, text.decode("utf-8", errors="replace"))

    def server_alive(self) -> bool:
        return not self._closed and self.segment.server_alive()

    # --- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._say_goodbye()
        finally:
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + CLOSE_WAIT_S
            while not done.query() and time.monotonic() < deadline:
                time.sleep(1e-4)
            if done.query():  # nothing queued touches the slot any more
                del self.payload
                self.arena.close()
                self.mapping.close()
                del self.buffer
                self.segment.close()
            else:  # never unmap memory that queued work may still touch
                log.warning("cuda_ipc slot %d: GPU work still queued at close; mappings kept", self.slot)
