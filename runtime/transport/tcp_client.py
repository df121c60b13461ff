"""``tcp``, client side: the slot protocol's frames over one socket per client–server pair.

A client attaches over HTTP, gets ``(port, slot, token)``, connects and sends a 16-byte hello
(``HELLO_MAGIC``, slot, token). After that each request is one frame ``header | payload`` and
each response one frame back, read straight into preallocated buffers with ``recv_into`` (no
pickling, no per-message allocation); large hidden states are sent scatter-gather from the tensor
itself, and large responses are read with a low-water mark (one wake-up per MiB).
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

import torch

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    FrameKind,
    ProtocolError,
    RequestWriter,
    SlotHeader,
    Status,
    check_response,
    dtype_code,
    read_message,
    read_response,
)
from eaas.runtime.transport.base import Channel, ChannelClosed, ChannelTimeout, Offer, RemoteError
from eaas.runtime.transport.tcp_socket import (
    HELLO,
    HELLO_MAGIC,
    LOW_WATER_MIN_BYTES,
    SCATTER_GATHER_MIN_BYTES,
    send_all,
    set_low_water,
    tune,
)


class TcpChannel(Channel):
    name = "tcp"

    def __init__(self, sock: socket.socket, capacity_bytes: int, timeout_s: float) -> None:
        self.sock = sock
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self._send_buffer = memoryview(bytearray(PAYLOAD_OFFSET + capacity_bytes))
        self._recv_buffer = memoryview(bytearray(PAYLOAD_OFFSET + capacity_bytes))
        self._writer = RequestWriter(self._send_buffer[PAYLOAD_OFFSET:])
        self._seq = 0
        self._expect: tuple[int, int, int, int] | None = None
        self._closed = False

    @classmethod
    def connect(
        cls, handle: dict[str, Any], host: str, timeout_s: float, offer: Offer | None = None
    ) -> TcpChannel:
        try:
            sock = socket.create_connection((host, int(handle["port"])), timeout=timeout_s)
        except OSError as exc:
            raise ChannelClosed(f"cannot connect to {host}:{handle['port']}: {exc}") from exc
        tune(sock)
        try:
            sock.sendall(HELLO.pack(HELLO_MAGIC, int(handle["slot"]), int(handle["token"])))
        except OSError as exc:
            sock.close()
            raise ChannelClosed(f"hello to {host}:{handle['port']} failed: {exc}") from exc
        return cls(sock, int(handle["capacity_bytes"]), timeout_s)

    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        self._seq += 1
        num_tokens, hidden = x.shape
        dtype = dtype_code(x.dtype)
        x_bytes = x.numel() * x.element_size()
        gather = x_bytes >= SCATTER_GATHER_MIN_BYTES
        x = x.contiguous()
        size = self._writer.write(x, ids, weights, include_x=not gather)
        header = SlotHeader(
            FrameKind.REQUEST, dtype, layer, num_tokens, ids.shape[1], hidden, self._seq, size
        )
        header.pack_into(self._send_buffer, HEADER_OFFSET)
        self._expect = (self._seq, num_tokens, hidden, dtype)
        frame = self._send_buffer[HEADER_OFFSET : PAYLOAD_OFFSET + size]
        try:
            self.sock.settimeout(self.timeout_s)
            if gather:  # header | x straight from the tensor | ids and weights from the buffer
                x_view = x.view(torch.uint8).reshape(-1).numpy().data
                tail = PAYLOAD_OFFSET - HEADER_OFFSET + x_bytes
                send_all(self.sock, [frame[: PAYLOAD_OFFSET - HEADER_OFFSET], x_view, frame[tail:]])
            else:
                self.sock.sendall(frame)
        except TimeoutError as exc:
            raise ChannelTimeout(f"sending {size} bytes timed out") from exc
        except OSError as exc:
            raise ChannelClosed(f"send failed: {exc}") from exc

    def _recv_exact(self, view: memoryview, deadline: float) -> None:
        low_water = len(view) >= LOW_WATER_MIN_BYTES
        try:
            self._recv_loop(view, deadline, low_water)
        finally:
            if low_water:
                set_low_water(self.sock, 1)

    def _recv_loop(self, view: memoryview, deadline: float, low_water: bool) -> None:
        while len(view):
            remaining = deadline - time.monotonic()
            if low_water and remaining > 0:
                set_low_water(self.sock, len(view))  # one wake-up per MiB instead of per segment
            try:
                # Past the deadline, bytes that are already here are still taken (non-blocking).
                self.sock.settimeout(max(remaining, 0.0))
                n = self.sock.recv_into(view)
            except (TimeoutError, BlockingIOError) as exc:
                raise ChannelTimeout("no response within the deadline") from exc
            except OSError as exc:
                raise ChannelClosed(f"receive failed: {exc}") from exc
            if n == 0:
                raise ChannelClosed("the server closed the connection")
            view = view[n:]

    def answered(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])  # data, or the server closed it

    def wakeup_fd(self) -> int:
        return self.sock.fileno()

    def receive(self, deadline: float) -> torch.Tensor:
        if self._expect is None:
            raise RuntimeError("receive() without a request in flight")
        seq, num_tokens, hidden, dtype = self._expect
        self._expect = None
        self._recv_exact(self._recv_buffer[HEADER_OFFSET:PAYLOAD_OFFSET], deadline)
        header = SlotHeader.unpack_from(self._recv_buffer, HEADER_OFFSET)
        try:
            check_response(header, seq, num_tokens, hidden, dtype)
            if header.payload_bytes > self.capacity_bytes:
                raise ProtocolError(Status.TOO_LARGE, f"response of {header.payload_bytes} bytes")
        except ProtocolError as exc:
            raise ChannelClosed(f"malformed response: {exc}") from exc
        payload = self._recv_buffer[PAYLOAD_OFFSET:]
        self._recv_exact(payload[: header.payload_bytes], deadline)
        if header.status != Status.OK:
            raise RemoteError(header.status, read_message(payload, header))
        return read_response(payload, header)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()
