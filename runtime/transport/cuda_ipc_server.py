"""``cuda_ipc``, server side: slot payloads in GPU memory, for clients on the same node.

Each slot is split in two:

- its **control part** — flag, header, error message — is a slot of an ``shm`` segment
  (``shm_segment``), page-locked and mapped for the GPU in the server and in every client
  (``cuda_driver.HostMapping``): CPUs read and write it directly, GPU streams write and wait on
  it with stream memory operations;
- its **payload** — x, expert ids and router weights in, y out — is ``payload_stride`` bytes of
  one ``DeviceArena`` on the server's GPU (CUDA virtual memory), whose file descriptor a client
  fetches from a Unix socket next to the segment (``ArenaFdServer``) and maps: the client then
  holds its own reference to the memory, so a server that dies mid-copy leaves nothing dangling.

One exchange (all client work on one client stream, so it can be captured in a CUDA graph):

1. the client's stream copies the request into the payload, then writes the header and sets
   the flag to ``REQUEST_READY`` (a stream write, ordered after the copies);
2. the server's CPU sees ``REQUEST_READY`` in host memory, sets ``SERVING`` (so the request is
   not taken twice while the GPU computes), validates the header and launches the experts on
   its stream, reading x from the payload and writing y back into it; a stream write then sets
   ``RESPONSE_READY`` once the GPU is done;
3. the client waits for ``RESPONSE_READY`` (its CPU polling, or its stream waiting), reads y
   and sets ``IDLE``.

Liveness is the shm segment's (``transport.liveness``): the server reaps slots of dead clients,
and a client sees a dead server at once. The GPU cannot ring a doorbell, so the server polls the
flags (``transport.polling``): it spins (releasing the GIL) for ``SPIN_S`` after the last request
and then checks every ``POLL_SLEEP_S``, watching other transports' descriptors meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

import torch

from eaas.runtime.protocol import FLAG_OFFSET, HEADER_OFFSET, MAX_MESSAGE_BYTES, SlotHeader, SlotState, Status
from eaas.runtime.transport.base import Request, TransportOptions
from eaas.runtime.transport.cuda_driver import DeviceArena, HostMapping, MemOps, use_device
from eaas.runtime.transport.polling import PollingWaiter
from eaas.runtime.transport.shm_segment import SHM_DIR, Segment, new_segment_name
from eaas.runtime.transport.shm_server import ShmServerTransport

SPIN_S = 2e-3  # keep spinning this long after a request (a decode step's next layer comes soon)
POLL_SLEEP_S = 50e-6  # then sleep this long between checks
PAYLOAD_ALIGN = 256
# A u32 in the padding after a control slot's flag: how many requests of the slot the server
# refused. A captured client cannot read each layer's status, so it compares this after a replay.
REFUSALS_OFFSET = 8


def payload_stride(capacity_bytes: int) -> int:
    return -(-capacity_bytes // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def arena_socket_name(segment: str) -> str:
    """The Unix socket (next to the segment) that hands out the arena's file descriptor."""
    return f"{segment}.arena"


class ArenaFdServer:
    """Hands the arena's file descriptor (SCM_RIGHTS) to whoever connects to its Unix socket.

    The socket is a file in ``SHM_DIR`` with mode 0600, like the segment: the same processes that
    may open the segment may map the arena.
    """

    def __init__(self, segment: str, arena: DeviceArena) -> None:
        self.name = arena_socket_name(segment)
        self.path = SHM_DIR / self.name
        self._fd = arena.export_fd()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            self._listener.listen(64)
        except BaseException:
            self._listener.close()
            os.close(self._fd)
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="eaas-cuda-ipc-fd", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(2.0)
                socket.send_fds(conn, [b"arena"], [self._fd])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=2)
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def receive_arena_fd(name: str, timeout_s: float) -> int:
    """Connects to an ``ArenaFdServer`` and returns the descriptor it sends (the caller closes it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(SHM_DIR / name))
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    if not fds:
        raise OSError(f"{name}: the server sent no file descriptor")
    return fds[0]


class CudaIpcServerTransport(ShmServerTransport):
    name = "cuda_ipc"

    def __init__(self, options: TransportOptions) -> None:
        device = torch.device(options.device)
        if device.type != "cuda":
            raise ValueError(
                f"transport cuda_ipc: slots live in GPU memory, so the server must compute on a GPU "
                f"(device cuda or cuda:N), got device {options.device!r}"
            )
        self.options = options
        self.device_index = use_device(device)
        self.stride = payload_stride(options.capacity_bytes)
        # The shm segment holds the control parts only: flag, header and an error message.
        self.segment = Segment.create(
            new_segment_name(f"{options.tag}-gpu"), options.max_clients, MAX_MESSAGE_BYTES
        )
        self._bells = []
        self.response_bells = []
        opened: list[HostMapping | DeviceArena] = []
        try:
            self.mapping = HostMapping(self.segment.buffer, self.device_index)
            opened.append(self.mapping)
            self.arena = DeviceArena(options.max_clients * self.stride, self.device_index)
            opened.append(self.arena)
            self._fd_server = ArenaFdServer(self.segment.name, self.arena)
        except BaseException:
            for resource in reversed(opened):
                resource.close()
            self.segment.close()
            raise
        self._payloads = [
            self.arena.tensor[slot * self.stride : slot * self.stride + options.capacity_bytes]
            for slot in range(options.max_clients)
        ]
        self._init_slots()
        self._respond_ops = [  # built once: the answer's flag write, enqueued as is every time
            MemOps().write(
                self.mapping.device_pointer(self.segment.slot_offset(slot) + FLAG_OFFSET),
                SlotState.RESPONSE_READY,
            )
            for slot in range(options.max_clients)
        ]
        self._waiter = PollingWaiter(SPIN_S, POLL_SLEEP_S, POLL_SLEEP_S)

    # --- handshake -------------------------------------------------------------------------------
    def _handle(self, slot: int) -> dict[str, Any]:
        return {
            "transport": self.name,
            "slot": slot,
            "segment": self.segment.name,
            "capacity_bytes": self.options.capacity_bytes,
            "arena_socket": self._fd_server.name,
            "arena_bytes": self.arena.num_bytes,
            "payload_offset": slot * self.stride,
            "server_pid": os.getpid(),
            "device": torch.cuda.get_device_name(self.device_index),
        }

    def _wake_client(self, slot: int) -> None:
        pass  # clients poll their flag (or their stream waits on it): nothing to ring

    # --- waiting ---------------------------------------------------------------------------------
    @property
    def wakeup_fd(self) -> None:
        return None  # requests arrive as GPU writes to host memory: nothing to select on

    def watch(self, fd: int) -> bool:
        self._waiter.watch(fd)
        return True

    def _any_ready(self) -> bool:
        return bool((self.segment.flags == SlotState.REQUEST_READY).any())

    def wait(self, timeout_s: float) -> None:
        self._waiter.wait(self._any_ready, timeout_s)

    # --- requests --------------------------------------------------------------------------------
    def poll(self) -> list[Request]:
        requests = super().poll()
        if requests:
            self._waiter.activity()
        return requests

    def _take(self, slot: int, generation: int) -> Request:
        self.segment.flags[slot] = SlotState.SERVING  # not taken again while the GPU computes
        buffer = self.segment.slot(slot)
        header = SlotHeader.unpack_from(buffer, HEADER_OFFSET)
        return Request(self.name, slot, generation, header, buffer, payload=self._payloads[slot])

    def _publish(self, slot: int, header: SlotHeader) -> None:
        if header.status != Status.OK:  # a refusal: nothing on the GPU to wait for
            offset = self.segment.slot_offset(slot) + REFUSALS_OFFSET
            count = int.from_bytes(self.segment.view[offset : offset + 4], "little")
            self.segment.view[offset : offset + 4] = ((count + 1) & 0xFFFFFFFF).to_bytes(4, "little")
            self.segment.flags[slot] = SlotState.RESPONSE_READY
            return
        # After the compute that wrote y, on the stream it ran on.
        self._respond_ops[slot].enqueue(keep=True)

    def _close_files(self) -> None:
        self._fd_server.close()
        with contextlib.suppress(Exception):
            torch.cuda.current_stream(self.device_index).synchronize()
        self._payloads = []
        self.arena.close()
        self.mapping.close()
        self.segment.close()
