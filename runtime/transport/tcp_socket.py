"""What both ends of the ``tcp`` transport share: the hello, socket settings, and helpers."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

HELLO = struct.Struct("<IIQ")  # magic, slot, token: the first bytes a client sends
HELLO_MAGIC = 0x4F4C4548  # b"HELO"
SOCKET_BUFFER_BYTES = 4 << 20
LOW_WATER_CAP_BYTES = 1 << 20  # well below the receive buffer, so a waiting reader always wakes
LOW_WATER_MIN_BYTES = 64 << 10  # smaller payloads arrive in a few segments anyway
SCATTER_GATHER_MIN_BYTES = 64 << 10  # larger hidden states are sent from the tensor, not copied first


def tune(sock: socket.socket) -> None:
    """``TCP_NODELAY`` and large buffers (one frame is often a whole MiB-sized batch)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def set_low_water(sock: socket.socket, num_bytes: int) -> None:
    """``SO_RCVLOWAT``: readiness (epoll, poll) waits for this many bytes; capped below the buffer size."""
    level = max(1, min(num_bytes, LOW_WATER_CAP_BYTES))
    with contextlib.suppress(OSError):  # an optimisation only
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, level)


def drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while len(os.read(fd, 4096)) == 4096:
            pass


def send_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """``sendall`` for several buffers (``sendmsg`` may send part of them)."""
    parts = [p for p in parts if len(p)]
    while parts:
        sent = sock.sendmsg(parts)
        while sent and parts:
            if sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            else:
                parts[0] = parts[0][sent:]
                sent = 0
