"""What both ends of the ``nixl`` transport share: the NIXL agent, the notifications, the transfer sizes.

An ``Endpoint`` is one NIXL agent with the UCX backend. A server transport owns one; every
``nixl`` channel of a client process shares one (an agent costs ~0.5 s to create, a UCX context
and worker). Agent names are ``eaas-<role>-<pid>-<random>``: unique per process incarnation, so a
restarted server or client is never taken for its previous life (NIXL refuses to load a second
agent under a known name with other connection details).

Notifications are the slot flags. Each is 17 bytes, ``kind | slot (u32) | generation (u32) | seq
(u64)``, then a *tail* where the frames are split (below); the generation counts the slot's
attachments, so a late notice about a slot's previous holder is never taken for one about its
current holder:

| kind | sent by | meaning |
|---|---|---|
| ``R`` | client | the request is in the slot (``REQUEST_READY``) |
| ``A`` | server | the answer is in the client's answer area (``RESPONSE_READY``) |
| ``B`` | client | goodbye: release my slot (``OFFLINE``) |
| ``O`` | server | the slot was released (``OFFLINE``) |

NIXL sends a transfer's notification only after its data is visible at the target, so the flag is
never seen before the bytes it covers.

Frames: in host memory (``DRAM``) a request or answer is one WRITE of the slot's header and
payload, which are contiguous. A slot in GPU memory (``VRAM``: a client in GPU memory, a server
computing on a GPU) has them *split*: the WRITE carries the payload only, and the 48-byte header
rides in the notification's tail (an error answer's message after it, with no WRITE at all). The
server's CPU then reads every header without a copy from the GPU, and its GPU reads the payload
where UCX put it (on one host through CUDA IPC; across nodes through GPUDirect RDMA where the NIC
and driver allow it).

Small frames: where both ends say so in the handshake (``inline_bytes``: a slot in host memory
with whole frames), a request or answer of at most ``INLINE_BYTES`` (header and payload) travels
whole in its notification's tail, with no WRITE: the receiver copies it into the slot or answer
area and goes on as if a WRITE had put it there. NIXL's WRITE is a put, a flush that waits for
the put to complete, then the notification: three steps where one eager message does. Measured
between two bare agents on one host (``benchmarks/transport_rtt.py``'s raw notify), a notification
each way took 84–103 µs for 14 KiB against 116–148 µs for the WRITE and its notification, and
lost from 32 KiB up. Over RDMA the
flush waits for the remote NIC's acknowledgement, so small frames gain there too. A decode step's
request for one token of 7,168 bf16 values is a 14.5 KB frame.

Notifications of one agent arrive for every slot at once: ``collect`` sorts them into
per-(peer, slot) mailboxes.

Progress: by default nobody runs NIXL's progress thread (it polls a core with zero delay); the
server loop and a waiting client make progress themselves, each time they look for notifications
(``EAAS_NIXL_PROGRESS_THREAD=1`` turns the thread on, for comparison: docs/transports.md).

Letting go (``Endpoint.retire``): a channel's or slot's WRITEs are released, and its hold on the
peer dropped, only once nothing of it can still be in flight to that peer: its last WRITE settled
and a final 4-byte ping completed (the peer took everything before it) or failed (the peer is gone).
NIXL 1.5's UCX backend frees its endpoint object when the last peer is removed while UCX keeps the
connection closing in the background; a peer that hangs with a WRITE or notification in flight and
dies later then makes UCX call back into the freed object, and the process crashes. A hung peer's
connection is therefore kept until it answers or dies (bounded: one per channel or slot of a hung
peer). Verified over UCX's TCP transport (the pod network), where a ping completes only once the
peer's process has taken it; over RDMA or CMA the peer's NIC or kernel completes a WRITE without
the process, so there a completed ping does not prove that the peer took our last notification.

UCX chooses its transports and devices from the environment (``UCX_TLS``, ``UCX_NET_DEVICES``;
the operator sets them from the pool's ``spec.ucx``). One setting is ours: ``UCX_MEM_EVENTS=no``
(``UCX_DEFAULTS``; the environment still wins). Left on, UCX hooks the process's malloc and mmap
to keep a cache of registrations valid; every transfer here is from and into memory registered
once, so the cache is never used, while the hooks slowed the model's own CPU work around them:
a 1-server decode ran ~1.3x faster without them (docs/benchmarks.md).
And on a host with NVIDIA GPUs, a ``UCX_TLS`` naming no CUDA transport (``tcp``, the pools' default)
gets ``cuda_copy``: NIXL refuses to start its UCX backend there without one
(``ucx_transports_for_host``; seen on a lent H200).

Host memory (``host_memory``): the areas WRITEs read and land in (a server's slots, a client's send
and answer areas) are on transparent huge pages where the kernel gives them on request (its
``enabled`` setting ``madvise`` or ``always``). On one host UCX copies a WRITE with the kernel's
cross-memory attach, page by page; between two bare agents a 128-token round trip took ~0.6-0.8x
the time on 2 MiB pages that it took on 4 KiB ones (docs/benchmarks.md). numpy asks for huge pages
for its own arrays of 4 MiB and more, so the larger areas mostly had them already, but not at their
unaligned edges nor below 4 MiB. Over RDMA a region on huge pages also takes fewer of the NIC's
translation entries.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import importlib
import logging
import mmap
import os
import re
import secrets
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

import numpy as np

from eaas.runtime.protocol import HEADER_OFFSET, HEADER_SIZE, MAX_MESSAGE_BYTES, PAYLOAD_OFFSET
from eaas.runtime.transport.base import OfferRefused

# The wheel's module names, newest CUDA major first (the `nixl` meta package pulls in both).
LIBRARY_MODULES = ("nixl_cu13", "nixl_cu12")
PROGRESS_THREAD_ENV = "EAAS_NIXL_PROGRESS_THREAD"
MAX_METADATA_BYTES = 64 << 10  # an agent's metadata for a few regions is ~0.5 KB
AGENT_NAME = re.compile(r"^eaas-[a-z]+-[0-9]+-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Memory:
    """Where an area is, as NIXL names it: ``DRAM`` (device 0) or ``VRAM`` with its CUDA device."""

    kind: str
    device: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("DRAM", "VRAM") or type(self.device) is not int or self.device < 0:
            raise ValueError(f"memory: DRAM or VRAM on a device >= 0, got {self.kind!r} on {self.device!r}")

    @classmethod
    def read(cls, kind: object, device: object, field: str) -> Memory:
        """The memory a peer's handshake names; ``OfferRefused`` naming ``field`` otherwise."""
        if kind not in ("DRAM", "VRAM") or type(device) is not int or not 0 <= device < 1024:
            raise OfferRefused(
                f"{field}: DRAM or VRAM, with a device index from 0 to 1023, is required; "
                f"got {kind!r} on device {device!r}"
            )
        return cls(str(kind), device)


HOST = Memory("DRAM")

# UCX settings of our own, put into the environment (unless it has them) before each agent
# starts: UCX reads these when it is loaded, with the process's first agent.
UCX_DEFAULTS = {"UCX_MEM_EVENTS": "no"}
# NIXL's test for GPUs present (PCI vendor, class code's upper 16 bits), and the UCX transports that
# it takes as CUDA support (``ucx_transports_for_host``).
NVIDIA_PCI_VENDOR = 0x10DE
GPU_PCI_CLASSES = (0x0300, 0x0302)
CUDA_TRANSPORTS = frozenset({"cuda", "cuda_copy"})

NOTICE = struct.Struct("<cIIQ")
# The largest frame (header and payload) that travels in its notification instead of a WRITE
# (``Small frames`` above): below it one eager message beats a WRITE, its flush and a notification.
INLINE_BYTES = 16 << 10
MAX_NOTICE_BYTES = NOTICE.size + max(HEADER_SIZE + MAX_MESSAGE_BYTES, INLINE_BYTES)  # a split error
# answer's, or a small frame's
PING_BYTES = 4  # the flag word of a slot: unused by nixl, so a liveness write may land there
# What a client's first ping carries into its slot's flag word (``claim_ping`` in the offer): the
# handshake's answer reached it and it connected. A server releases a slot of such a client that
# shows no claim ``attach_grace_s`` after the attach (the answer may have been lost on the way).
CLAIM = b"mine"
RETIRE_CHECK_S = 0.01  # how often retiring WRITEs are looked at (from ``collect``)

# Transfer sizes: a request or answer goes out as one prepared descriptor whose length is the
# frame's rounded up to a multiple of SIZE_STEP_BYTES below FINE_LIMIT_BYTES, and to 1/64 of its
# power of two above (at most 1.6% more bytes than needed, 64 sizes per doubling). Preparing every
# length of a 512-token slot (513) took 0.6 ms here, against 0.2 ms at 1/16, whose rounding put 57 KB
# on a 128-token frame of 1.84 MB: one WRITE in 32 was bytes nobody reads.
SIZE_STEP_BYTES = 4096
FINE_LIMIT_BYTES = 64 << 10
STEPS_PER_DOUBLING = 64


HUGE_PAGE_BYTES = 2 << 20


class TransportUnavailable(RuntimeError):
    """The NIXL library is not installed or cannot start (the message says how to get it)."""


class Notice(Enum):
    REQUEST = b"R"
    ANSWER = b"A"
    BYE = b"B"
    OFFLINE = b"O"


def notice(kind: Notice, slot: int, generation: int, seq: int = 0, tail: bytes = b"") -> bytes:
    return NOTICE.pack(kind.value, slot, generation & 0xFFFFFFFF, seq) + tail


_NOTICES = {kind.value: kind for kind in Notice}  # (a dict lookup: ``Notice(value)`` costs ~1 µs)


def parse_notice(message: bytes) -> tuple[Notice, int, int, int, bytes] | None:
    """(kind, slot, generation, seq, tail), or None for a message that is not one of ours."""
    if not NOTICE.size <= len(message) <= MAX_NOTICE_BYTES:
        return None
    kind, slot, generation, seq = NOTICE.unpack_from(message)
    known = _NOTICES.get(kind)
    return None if known is None else (known, slot, generation, seq, message[NOTICE.size :])


_library: ModuleType | None = None


def load_library() -> ModuleType:
    """The installed NIXL Python module; ``TransportUnavailable`` when there is none."""
    global _library
    if _library is None:
        errors = []
        for name in LIBRARY_MODULES:
            try:
                _library = importlib.import_module(name)
                break
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise TransportUnavailable(
                "transport nixl: the NIXL library is not installed "
                f"(pip install 'eaas[nixl]'; tried {'; '.join(errors)})"
            )
        _quiet_python_logger()
    return _library


def _quiet_python_logger() -> None:
    """NIXL's Python logger writes INFO lines to standard output, where a process's output (a ready
    line, a CLI's answer) belongs: send them to standard error, warnings and up unless
    ``NIXL_LOG_LEVEL`` asks for more."""
    logger = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def is_available() -> bool:
    try:
        load_library()
    except TransportUnavailable:
        return False
    return True


def apply_ucx_defaults() -> None:
    """Puts ``UCX_DEFAULTS`` into the environment where it has no value of its own, and makes
    ``UCX_TLS`` one NIXL accepts on this host (``ucx_transports_for_host``), before the process's
    first agent starts: UCX reads its settings once, when it is loaded."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    given = os.environ.get("UCX_TLS")
    wanted = ucx_transports_for_host(given, nvidia_gpus(), cuda_driver_loadable())
    if wanted != given and wanted is not None:
        os.environ["UCX_TLS"] = wanted
        logging.getLogger("eaas.transport").info(
            "UCX_TLS=%s names no CUDA transport and this host has NVIDIA GPUs, where NIXL refuses to "
            "start without one: using UCX_TLS=%s",
            given,
            wanted,
        )


def ucx_transports_for_host(tls: str | None, gpus: int, cuda_driver: bool) -> str | None:
    """``UCX_TLS`` as an agent starts with it. NIXL's UCX backend refuses to start where NVIDIA GPUs
    are on the PCI bus, UCX can reach CUDA memory (the driver loads), and ``UCX_TLS`` is a list of
    transports naming neither ``cuda`` nor ``cuda_copy`` (``tcp``, the pools' default ``ucx.
    transports``: every GPU expert server would fail to start). There ``cuda_copy`` is added (the
    transport that copies between host and GPU memory; ``cuda_ipc`` and RDMA stay as the list
    says). Any other value is kept as given: unset (UCX's own choice, which includes CUDA), a list
    naming one, and an exclusion list (``^...``), which NIXL accepts unless it excludes one."""
    if tls is None or gpus == 0 or not cuda_driver or tls.strip().startswith("^"):
        return tls
    if CUDA_TRANSPORTS & {token.strip() for token in tls.split(",")}:
        return tls
    return f"{tls.strip().rstrip(',')},cuda_copy"


def nvidia_gpus(devices: str = "/sys/bus/pci/devices") -> int:
    """NVIDIA display and 3D controllers on the PCI bus: what NIXL counts as GPUs present (a pod
    sees the whole node's bus, whether or not it was given a GPU)."""
    count = 0
    with contextlib.suppress(OSError):
        for device in os.scandir(devices):
            try:
                with (
                    open(os.path.join(device.path, "vendor")) as v,
                    open(os.path.join(device.path, "class")) as c,
                ):
                    vendor, pci_class = int(v.read(), 16), int(c.read(), 16) >> 8
            except (OSError, ValueError):
                continue
            count += vendor == NVIDIA_PCI_VENDOR and pci_class in GPU_PCI_CLASSES
    return count


def cuda_driver_loadable() -> bool:
    """Whether the CUDA driver library loads here: without it UCX has no CUDA transports (a pod
    on a GPU node that was given no GPU usually has none)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def progress_thread_enabled() -> bool:
    return os.environ.get(PROGRESS_THREAD_ENV, "0") not in ("", "0", "false", "no")


def frame_length(payload_bytes: int) -> int:
    """Bytes of a frame on the wire: header and payload, which are contiguous in a slot."""
    return PAYLOAD_OFFSET - HEADER_OFFSET + payload_bytes


def transfer_length(num_bytes: int, limit: int) -> int:
    """The prepared length that carries ``num_bytes`` (never above ``limit``, the slot's frame)."""
    if num_bytes <= FINE_LIMIT_BYTES:
        step = SIZE_STEP_BYTES
    else:
        step = (1 << (num_bytes.bit_length() - 1)) // STEPS_PER_DOUBLING
    return min(limit, -(-num_bytes // step) * step)


def transfer_lengths(limit: int) -> list[int]:
    """Every length ``transfer_length`` can return for frames of at most ``limit`` bytes, ascending."""
    lengths: list[int] = []
    size = 1
    while True:
        length = transfer_length(size, limit)
        if not lengths or length != lengths[-1]:
            lengths.append(length)
        if length >= limit:
            return lengths
        size = length + 1


def host_memory(num_bytes: int) -> np.ndarray:
    """``num_bytes`` of zeroed host memory for registered areas, starting on a huge-page boundary
    and asked to be backed by transparent huge pages (module docstring). Where the kernel has none,
    or below a huge page, plain pages, as ``np.zeros`` gives. The memory lives as long as the array
    (or a view of it) does."""
    if num_bytes < HUGE_PAGE_BYTES:
        return np.zeros(num_bytes, dtype=np.uint8)
    # Private anonymous memory: huge pages for shared memory follow another setting (shmem_enabled).
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # a kernel without huge pages: plain ones
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -int(whole.ctypes.data) % HUGE_PAGE_BYTES
    return whole[start : start + num_bytes]


def encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(text: object, field: str) -> bytes:
    """Base64 ``text`` of at most ``MAX_METADATA_BYTES``; ``OfferRefused`` naming ``field`` otherwise."""
    if not isinstance(text, str) or len(text) > 4 * -(-MAX_METADATA_BYTES // 3):  # (base64: 4 per 3)
        raise OfferRefused(f"{field}: base64 text of at most {MAX_METADATA_BYTES} bytes is required")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise OfferRefused(f"{field}: not valid base64") from None


def address(value: object, field: str) -> int:
    if type(value) is not int or not 0 < value < 2**64:
        raise OfferRefused(f"{field}: a memory address (a positive integer below 2**64) is required")
    return value


class Endpoint:
    """One NIXL agent (UCX backend) and the notifications it received, by (peer, slot).

    Safe from several threads: every call into the agent, handle releases included, holds
    ``lock``, and so do the mailboxes. NIXL's strict thread-sync mode alone is not enough: its
    transfer status and release paths take its lock shared and progress the UCX worker, so two
    threads could drive one worker at once, and its release runs holding the GIL.
    """

    def __init__(self, role: str) -> None:
        lib = load_library()
        apply_ucx_defaults()
        self.library = lib
        self.name = f"eaas-{role}-{os.getpid()}-{secrets.token_hex(6)}"
        config = lib.nixl_agent_config(
            enable_prog_thread=progress_thread_enabled(),
            backends=["UCX"],
            sync_mode=lib.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self.agent = lib.nixl_agent(self.name, config)
        except Exception as exc:
            raise TransportUnavailable(f"transport nixl: cannot start a NIXL agent: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise TransportUnavailable(
                "transport nixl: NIXL has no UCX backend here (plugins: "
                f"{', '.join(self.agent.plugin_list) or 'none'})"
            )
        self.lock = threading.RLock()
        # Mailboxes of the open channels, by (peer, slot, generation): notices for no open channel
        # (a late answer to a channel closed on its deadline, a slot released after its goodbye)
        # are dropped, not kept for nobody.
        self._mail: dict[tuple[str, int, int], deque[tuple[Notice, int, bytes]]] = {}
        self._peer_holds: dict[str, int] = {}
        self._retiring: list[_Retiring] = []  # WRITEs let go of, until nothing of theirs is in flight
        self._kept: list[Any] = []  # memory that must outlive WRITEs still in flight (``keep_alive``)
        self._check_at = 0.0

    # --- memory --------------------------------------------------------------------------------
    def register(self, address: int, num_bytes: int, memory: Memory = HOST) -> Any:
        """Registers ``[address, +num_bytes)`` of ``memory``; returns its registration list."""
        with self.lock:
            return self.agent.register_memory([(address, num_bytes, memory.device, "")], memory.kind)

    def deregister(self, registration: Any) -> None:
        with self.lock:
            self.agent.deregister_memory(registration)

    def metadata(self, registration: Any) -> bytes:
        """This agent's connection details and ``registration`` only (what a peer may write to)."""
        with self.lock:
            return bytes(self.agent.get_partial_agent_metadata(registration, inc_conn_info=True))

    # --- peers ---------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata (again, for a known peer: its further regions); returns its name.
        Each call holds the peer once; ``release_peer`` lets go, and the last one disconnects."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            peer = name.decode() if isinstance(name, bytes) else str(name)
            self._peer_holds[peer] = self._peer_holds.get(peer, 0) + 1
        return peer

    def connect(self, peer: str) -> None:
        """Opens the connection now, so the first transfer does not pay for it (~35 ms)."""
        with self.lock:
            self.agent.make_connection(peer)

    def release_peer(self, peer: str) -> None:
        """Lets go of one hold on ``peer``; the last removes it (NIXL disconnects from it)."""
        with self.lock:
            holds = self._peer_holds.get(peer, 0) - 1
            if holds > 0:
                self._peer_holds[peer] = holds
                return
            self._peer_holds.pop(peer, None)
            for key in [k for k in self._mail if k[0] == peer]:
                del self._mail[key]
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)

    def peers(self) -> list[str]:
        with self.lock:
            return list(self._peer_holds)

    def prepare(
        self, peer: str | None, base: int, offset: int, lengths: list[int], memory: Memory = HOST
    ) -> Any:
        """A prepared descriptor list: ``[base, +PING_BYTES)`` then ``[base + offset, +length)`` for
        each of ``lengths``, in this agent's ``memory`` (``peer`` None) or in ``peer``'s."""
        dev = memory.device
        descriptors = [(base, PING_BYTES, dev)] + [(base + offset, n, dev) for n in lengths]
        with self.lock:
            return self.agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", descriptors, memory.kind)

    def writer(self, local: Any, remote: Any, index: int) -> Any:
        """A prepared WRITE of descriptor ``index`` of ``local`` onto the same of ``remote``."""
        with self.lock:
            return self.agent.make_prepped_xfer("WRITE", local, [index], remote, [index])

    def post(self, handle: Any, message: bytes = b"") -> bool:
        """Starts a prepared WRITE (with notification ``message``); True when already done.
        Raises the library's error when the peer is gone."""
        with self.lock:
            return bool(self.agent.transfer(handle, message) == "DONE")

    def done(self, handle: Any) -> bool:
        """Makes progress; True when the WRITE completed. Raises the library's error on failure."""
        with self.lock:
            state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise ConnectionError("NIXL transfer failed")
        return bool(state == "DONE")

    def notify(self, peer: str, message: bytes) -> None:
        with self.lock:
            self.agent.send_notif(peer, message)

    # --- notifications -------------------------------------------------------------------------
    def collect(self) -> list[tuple[str, Notice, int, int, int, bytes]]:
        """Makes progress and returns the new notifications as (peer, kind, slot, generation, seq, tail)
        (and finishes retiring WRITEs that settled: ``retire``)."""
        with self.lock:
            received = self.agent.get_new_notifs()
            if self._retiring and time.monotonic() >= self._check_at:
                self._check_at = time.monotonic() + RETIRE_CHECK_S
                for retiring in list(self._retiring):
                    if self._retired(retiring):
                        self._retiring.remove(retiring)
        notices = []
        for peer, messages in received.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            for message in messages:
                parsed = parse_notice(bytes(message))
                if parsed is None:  # not one of ours: dropped
                    continue
                notices.append((name, *parsed))
        return notices

    def deliver(self) -> None:
        """``collect`` into the open mailboxes (clients: each channel then ``take``s its own)."""
        with self.lock:
            for peer, kind, slot, generation, seq, tail in self.collect():
                box = self._mail.get((peer, slot, generation))
                if box is not None:
                    box.append((kind, seq, tail))

    # --- letting go ----------------------------------------------------------------------------
    def retire(self, writes: TransferSet, then: Callable[[], None] | None = None) -> None:
        """Lets go of ``writes`` and of the hold on its peer that came with it, and runs ``then``
        (e.g. deregistering the memory the WRITEs read from), once nothing of it can be in flight:
        at once for a peer that answers, when it answers or dies for one that hangs (``collect``
        looks again every ``RETIRE_CHECK_S``)."""
        with self.lock:
            retiring = _Retiring(writes, then)
            if not self._retired(retiring):
                self._retiring.append(retiring)

    def keep_alive(self, memory: Any) -> None:
        """Keeps ``memory`` (registered, possibly read by WRITEs in flight) as long as this agent."""
        with self.lock:
            self._kept.append(memory)

    def retiring(self) -> int:
        """How many channels' or slots' WRITEs wait for their peer before they are let go of."""
        with self.lock:
            return len(self._retiring)

    def held_back(self) -> set[str]:
        """The peers whose retiring WRITEs may still be in flight (a closing server keeps their
        connections and its memory registered rather than crash later: see the module docstring)."""
        with self.lock:
            return {retiring.writes.peer for retiring in self._retiring}

    def _retired(self, retiring: _Retiring) -> bool:  # caller holds the lock
        """Moves ``retiring`` on; True once it was let go of."""
        writes = retiring.writes
        try:
            if not writes.quiet():
                return False
            if not retiring.pinged:  # the peer took everything before this ping once it completes
                retiring.pinged = True
                writes.ping()
                if not writes.quiet():
                    return False
        except Exception:  # the peer is gone: UCX failed its endpoint, nothing is in flight now
            pass
        self._finish(retiring)
        return True

    def _finish(self, retiring: _Retiring) -> None:  # caller holds the lock
        if retiring.done:  # (a finish interrupted half-way is never repeated)
            return
        retiring.done = True
        retiring.writes.release()
        self.release_peer(retiring.writes.peer)
        if retiring.then is not None:
            try:
                retiring.then()
            except Exception as exc:
                logging.getLogger("eaas.transport").debug("after releasing nixl writes: %s", exc)

    def release(self, handles: list[Any], lists: list[Any]) -> None:
        """Releases transfer handles (none of them in flight), then the prepared descriptor lists
        they were made from."""
        with self.lock:
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.release()
            for prepped in lists:
                with contextlib.suppress(Exception):
                    prepped.release()

    def take(self, peer: str, slot: int, generation: int) -> tuple[Notice, int, bytes] | None:
        """The oldest notification from ``peer`` about ``slot`` in its ``generation``, if any
        (after ``deliver``)."""
        with self.lock:
            box = self._mail.get((peer, slot, generation & 0xFFFFFFFF))
            return box.popleft() if box else None

    def open(self, peer: str, slot: int, generation: int) -> None:
        """Opens the (empty) mailbox of ``peer``'s ``slot`` in its ``generation``."""
        with self.lock:
            self._mail[(peer, slot, generation & 0xFFFFFFFF)] = deque()

    def forget(self, peer: str, slot: int, generation: int) -> None:
        """Closes that mailbox: its notices, and later ones, are dropped."""
        with self.lock:
            self._mail.pop((peer, slot, generation & 0xFFFFFFFF), None)


class TransferSet:
    """The prepared WRITEs from one local area onto one peer area of the same layout (a slot):
    the ping (4 bytes of the flag word) and one frame per transfer length, each made on first use.

    ``capacity_bytes`` is the slot's payload; ``split`` frames carry the payload only (the header
    goes in the notification: see the module docstring), whole ones header and payload."""

    def __init__(
        self,
        endpoint: Endpoint,
        peer: str,
        local_base: int,
        remote_base: int,
        capacity_bytes: int,
        *,
        split: bool = False,
        local_memory: Memory = HOST,
        remote_memory: Memory = HOST,
    ) -> None:
        self.endpoint = endpoint
        self.peer = peer
        self.split = split
        self.limit = capacity_bytes if split else frame_length(capacity_bytes)
        self.lengths = transfer_lengths(self.limit)
        self._index = {length: 1 + i for i, length in enumerate(self.lengths)}  # 0 is the ping
        offset = PAYLOAD_OFFSET if split else HEADER_OFFSET
        self.local = endpoint.prepare(None, local_base, offset, self.lengths, local_memory)
        try:
            self.remote = endpoint.prepare(peer, remote_base, offset, self.lengths, remote_memory)
        except BaseException:
            self._release_lists(remote=False)
            raise
        self._handles: dict[int, Any] = {}
        self._frame: Any = None  # the frame WRITE in flight, until seen complete
        self._ping: Any = None  # the ping in flight, until seen complete

    def handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            handle = self.endpoint.writer(self.local, self.remote, index)
            self._handles[index] = handle
        return handle

    def settle(self) -> bool:
        """Makes progress on the writes in flight; True once no frame is (raises if one failed)."""
        if self._ping is not None and self.endpoint.done(self._ping):
            self._ping = None
        if self._frame is not None and self.endpoint.done(self._frame):
            self._frame = None
        return self._frame is None

    def quiet(self) -> bool:
        """``settle``; True once neither a frame nor a ping is in flight."""
        return self.settle() and self._ping is None

    def write_frame(self, payload_bytes: int, message: bytes) -> None:
        """WRITEs header and ``payload_bytes`` of payload (split: the payload only, the header being
        in ``message``), then notifies ``message``; a split frame without payload is the notice alone.

        The previous frame is complete by then: the peer answered it, and NIXL notifies only after
        a WRITE completed. ``RuntimeError`` if it is not."""
        if not self.settle():
            raise RuntimeError("the previous NIXL write of this slot has not completed")
        if self.split and payload_bytes == 0:
            self.endpoint.notify(self.peer, message)
            return
        length = transfer_length(payload_bytes if self.split else frame_length(payload_bytes), self.limit)
        handle = self.handle(self._index[length])
        if not self.endpoint.post(handle, message):
            self._frame = handle

    def ping(self) -> None:
        """A 4-byte WRITE into the peer's flag word: raises at once when the peer is known gone.
        (Settles the writes in flight too, which also raises for a failed one.)"""
        self.settle()
        if self._ping is None and not self.endpoint.post(self.handle(0)):
            self._ping = self.handle(0)

    def release(self) -> None:
        """Frees the handles and lists; only once nothing is in flight (``Endpoint.retire`` waits
        for that), or when the peer was never written to."""
        handles = list(self._handles.values())
        self._handles.clear()
        self._frame = self._ping = None
        self.endpoint.release(handles, [self.local, self.remote])

    def _release_lists(self, remote: bool) -> None:
        self.endpoint.release([], [self.local, self.remote] if remote else [self.local])


@dataclass
class _Retiring:
    writes: TransferSet
    then: Callable[[], None] | None
    pinged: bool = False
    done: bool = False
