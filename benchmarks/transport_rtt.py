"""Round trip of one expert request through each transport, against the copy floor and a naive baseline.

For T tokens x H hidden (bf16, top-k 8), one round trip is: the client writes the request (x [T, H],
expert ids and router weights [T, K]) to an echo process, which answers with y = x [T, H]; the
client copies y out. Each transport is also timed *in place*, as the attention client drives it:
x gathered beforehand into the channel's staging area where the transport has one (``shm``,
``nixl``: ``Channel.staging``; ``tcp`` streams x from the caller's tensor), and the answer used
where it landed, not copied out (the client adds it into its output from there). Measured in the
same run:

- ``shm``, ``tcp``: the real transports (``eaas.runtime.transport``), the echo process waiting
  as the expert server does (blocked in the kernel on doorbells and sockets);
- ``nixl``: the real transport, served by an echo process of its own that waits as the expert
  server's loop does with ``nixl`` (it polls the NIXL agent: spins after a request, then sleeps
  with backoff); no NIXL progress thread on either side;
- ``copy floor``: the same bytes copied there and back in one process (two memcpys);
- ``socket floor``: x alone, length-prefixed, echoed over a plain blocking socket (what any TCP
  transport costs on this machine; no header, ids or weights, no framing, no non-blocking server);
- ``nixl raw``: NIXL's own round trip, the floor the library gives: two bare NIXL agents (UCX
  backend, no progress thread), x's bytes WRITTEN from registered memory (host memory as the
  transport allocates it, ``host_memory``: on huge pages) with a notification,
  and WRITTEN back with a notification, both sides busy-polling their agent; prepared transfers;
  no slot protocol, no header, no copies in or out of registered memory;
- ``raw notify`` (in place only, for x of at most 64 KiB): the same two bare agents exchanging
  x's bytes as a notification each way, with no WRITE (what ``nixl``'s small frames do: a frame of
  at most ``INLINE_BYTES`` travels in its notification, so at 1 x 7168 this is the floor it gives);
- ``raw 4K`` (in place only): NIXL's own round trip again, its areas on plain 4 KiB pages where
  ``nixl raw`` has the transport's host memory (``host_memory``: transparent huge pages where the
  kernel gives them); ``raw/4K`` is what the pages give the library, ``nixl/4K`` what the
  transport gives against the library on plain memory;
- ``nixl raw, UCX_TLS=tcp``: the same with UCX restricted to TCP in both agents (on one host the
  default puts go over ``cma``, a kernel copy between processes; across hosts there is no
  ``cma``, so this is the cross-host stand-in when no RDMA NIC is at hand; on a host with NVIDIA
  GPUs the agents add ``cuda_copy``, which NIXL requires there: ``ucx_transports_for_host``);
- ``naive``: the tensors pickled over a ``multiprocessing`` pipe and pickled back.

All methods are timed in turns (rounds of a few round trips of each), so load from other
processes falls on all of them alike. Every echo process is a process of its own, and each one
not being timed waits without spinning (the polling ones sleep once 1 ms passed without requests).

``nixl, fixed spin`` (in place only): a second ``nixl`` channel, to an echo process of its own,
whose waiting never learns its server's pace: it spins ``SPIN_S`` after each send and then sleeps,
as every channel did before the spin followed the usual round trip (the baseline of that change).

Then, at H = 7168, ``nixl`` against the same with NIXL's progress thread on in the echo process
(``EAAS_NIXL_PROGRESS_THREAD=1``), timed in turns, with the CPU seconds per second each echo
process used during its turns. That echo process is started only for this part and is stopped
(SIGSTOP) during the other's turns: its thread polls a core for as long as it runs. The client's
side runs without the thread in both: in the benchmark process it would spin beside every method.

Sizes: T in 1, 8, 16, 32, 128, 512 (the ``nixl`` targets' 1, 8, 32, 128, 512, and 16 as in
earlier runs), H in 2048 and 7168, every method at every size, 100 round trips each (the whole
run takes about a minute on the 2-core CPU machine); the ``nixl`` targets read H = 7168 only.

Targets: shm within 3x of the copy floor at 512 x 7168; tcp at least 5x faster than the
naive baseline at 512 x 7168 (both on the copying round trips). ``nixl`` (on the in-place
round trips, which like NIXL's raw one copy nothing in or out): within 1.3x of NIXL's raw round
trip at 128 and 512 x 7168; faster than ``tcp`` at 32, 128 and 512 x 7168 (value: the largest
nixl/tcp ratio of the three) and within 1.2x of ``tcp`` below 32 tokens (value: the largest of 1,
8 and 16).

Needs the NIXL library (``pip install 'eaas[nixl]'``): without it the script stops and says so.

Usage: python benchmarks/transport_rtt.py [--quick] [--json-out PATH]
"""

from __future__ import annotations

import base64
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from _common import cpu_seconds, emit, parser, target

from eaas.runtime.protocol import FrameKind, SlotHeader, response_bytes, slot_capacity_bytes
from eaas.runtime.transport import ServerTransport, TransportOptions, get_transport
from eaas.runtime.transport.backoff import reduce_timer_slack
from eaas.runtime.transport.nixl_endpoint import (
    PROGRESS_THREAD_ENV,
    TransportUnavailable,
    apply_ucx_defaults,
    host_memory,
    load_library,
)

TOKENS = (1, 8, 16, 32, 128, 512)
HIDDEN = (2048, 7168)
TOP_K = 8
DTYPE = torch.bfloat16
LAYER = 0
NIXL_HIDDEN = 7168  # the nixl targets and the progress-thread comparison
# A raw NIXL echo busy-polls this long after a message, then sleeps between polls from the first
# to the second, doubling (the nixl transport's server waits the same way, by default): it must not
# spin while the other methods are timed.
RAW_SPIN_S = 1e-3
RAW_SLEEP_S = (20e-6, 1e-3)
RAW_NOTIFY_MAX_BYTES = 64 << 10  # "raw notify" is timed for x up to this size
NOTIFY_MARK = b"n"  # a raw notification that is echoed back as it came (not a WRITE's size)
START_TIMEOUT_S = 60.0


def repetitions(quick: bool) -> int:
    """100 round trips of every method at every size (25 with ``--quick``). The 128- and 512-token
    rows once had 30: their medians then moved by up to a third from run to run (NIXL's own round
    trip at 128 x 7168 read 527 to 1,157 µs in six runs of 2026-11-28), and the 1.3x targets there
    read that noise."""
    return 25 if quick else 100


# --- exchanging handles through files ------------------------------------------------------------
def write_json(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").replace(path)  # atomic: the reader never sees half a file


def read_json(path: Path, process: subprocess.Popen[bytes] | None = None) -> Any:
    """Waits for ``path`` (written by ``write_json``); fails when ``process`` exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if process is not None and process.poll() is not None:
            raise SystemExit(f"transport_rtt: an echo process exited ({process.args})")
        if time.monotonic() > deadline:
            raise SystemExit(f"transport_rtt: no {path.name} within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def parent_gone(parent: int) -> bool:
    return os.getppid() != parent


# --- echo processes ------------------------------------------------------------------------------
def answer(transport: ServerTransport, request: Any) -> None:
    """Answers a request with its own hidden states (y = x: already in place in the slot)."""
    h = request.header
    size = response_bytes(h.num_tokens, h.hidden, h.dtype)
    response = SlotHeader(FrameKind.RESPONSE, h.dtype, h.layer, h.num_tokens, h.top_k, h.hidden, h.seq, size)
    transport.respond(request, lambda: response)  # (y = x: nothing to write)


def echo_server(ready_path: Path, max_tokens: int, hidden: int) -> None:
    """Serves shm and tcp slots: answers each request with its own hidden states (y = x)."""
    reduce_timer_slack()
    capacity = slot_capacity_bytes(max_tokens, TOP_K, hidden)
    transports = [
        get_transport(name).server(TransportOptions(max_clients=2, capacity_bytes=capacity, tag="bench"))
        for name in ("shm", "tcp")
    ]
    handles: dict[str, Any] = {t.name: t.attach("bench") for t in transports}
    handles["tcp"]["port"] = transports[1].port  # type: ignore[attr-defined]
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_echo, args=(listener,), daemon=True).start()
    handles["raw_port"] = listener.getsockname()[1]
    write_json(ready_path, handles)
    transports[1].watch(transports[0].wakeup_fd or -1)  # as the expert server waits: in the kernel
    parent = os.getppid()
    try:
        while True:
            ready = transports[0].poll() + transports[1].poll()
            if not ready:
                transports[1].wait(0.05)
                if parent_gone(parent):
                    return
                continue
            for request in ready:
                answer(transports[0] if request.transport == "shm" else transports[1], request)
    finally:
        for t in transports:
            t.close()


def nixl_echo_server(
    offer_path: Path, handle_path: Path, max_tokens: int, hidden: int, device: str = "cpu"
) -> None:
    """Serves one ``nixl`` slot as the expert server's loop does: ``poll``, else ``wait``.

    The client's offer comes first (``offer_path``); the handle goes back through ``handle_path``.
    ``device`` cuda: the slot's payload is GPU memory (``benchmarks/nixl_gpu_rtt.py``)."""
    reduce_timer_slack()
    capacity = slot_capacity_bytes(max_tokens, TOP_K, hidden)
    transport = get_transport("nixl").server(
        TransportOptions(max_clients=1, capacity_bytes=capacity, tag="bench", device=device)
    )
    parent = os.getppid()
    try:
        write_json(handle_path, transport.attach("bench", read_json(offer_path)))
        while True:
            ready = transport.poll()
            if not ready:
                transport.wait(0.05)
                if parent_gone(parent):
                    return
                continue
            for request in ready:
                answer(transport, request)
    finally:
        transport.close()


def bare_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread (UCX reads ``UCX_*`` now), under
    the UCX settings the transport's own agents get (``UCX_DEFAULTS``)."""
    lib = load_library()
    apply_ucx_defaults()
    config = lib.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return lib.nixl_agent(f"bench-raw-{role}-{os.getpid()}-{time.monotonic_ns()}", config)


def raw_area(memory: str, num_bytes: int, pages: str = "huge") -> torch.Tensor:
    """Zeroed bytes where a raw NIXL agent registers them: host memory (``DRAM``) or the GPU's
    (``VRAM``: ``benchmarks/nixl_gpu_rtt.py``). Host memory is the transport's own
    (``host_memory``: on huge pages where the kernel gives them), or ``pages`` "4k": ``torch.zeros``,
    4 KiB pages where the kernel gives huge pages only on request (``madvise``, as here; with
    ``always`` these may be huge pages too)."""
    if memory == "VRAM":
        return torch.zeros(num_bytes, dtype=torch.uint8, device="cuda")
    if pages == "4k":
        return torch.zeros(num_bytes, dtype=torch.uint8)
    return torch.from_numpy(host_memory(num_bytes))


def nixl_raw_echo(
    offer_path: Path, handle_path: Path, max_bytes: int, memory: str = "DRAM", pages: str = "huge"
) -> None:
    """NIXL's own round trip, far side: a bare agent that WRITEs back what it was written.

    A notification ``<n>`` says n bytes arrived at the start of this agent's buffer (in
    ``memory``); they are WRITTEN back to the client's answer area with the notification ``a``.
    One that starts with ``NOTIFY_MARK`` is sent back as it came, as a notification.
    Busy-polls for ``RAW_SPIN_S`` after each message, then sleeps between polls (``RAW_SLEEP_S``)."""
    agent = bare_agent("echo")
    buffer = raw_area(memory, max_bytes, pages)
    base = buffer.data_ptr()
    agent.register_memory([(base, max_bytes, 0, "")], memory)
    offer = read_json(offer_path)
    peer = agent.add_remote_agent(base64.b64decode(offer["agent_metadata"]))
    agent.make_connection(peer)
    write_json(
        handle_path,
        {"agent_metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "address": base},
    )
    writes: dict[int, Any] = {}
    in_flight = None
    last = time.monotonic()
    sleep_s = RAW_SLEEP_S[0]
    parent = os.getppid()
    while True:
        if in_flight is not None and settled(agent, in_flight):
            in_flight = None
        notes = agent.get_new_notifs()
        for messages in notes.values():
            for message in messages:
                if bytes(message[:1]) == NOTIFY_MARK:
                    agent.send_notif(peer, bytes(message))
                    continue
                size = int(message)
                write = writes.get(size)
                if write is None:
                    here = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, size, 0)], memory)
                    there = agent.prep_xfer_dlist(peer, [(offer["address"], size, 0)], memory)
                    write = writes[size] = agent.make_prepped_xfer("WRITE", here, [0], there, [0])
                while in_flight is not None and not settled(agent, in_flight):
                    pass
                in_flight = None if agent.transfer(write, b"a") == "DONE" else write
        now = time.monotonic()
        if notes:
            last, sleep_s = now, RAW_SLEEP_S[0]
        elif in_flight is None and now - last > RAW_SPIN_S:
            if parent_gone(parent):
                return
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, RAW_SLEEP_S[1])


def settled(agent: Any, write: Any) -> bool:
    """Makes progress; True once ``write`` completed (raises if it failed)."""
    state = agent.check_xfer_state(write)
    if state == "ERR":
        raise ConnectionError("NIXL WRITE failed")
    return bool(state == "DONE")


class RawNixl:
    """NIXL's own round trip, near side: a bare agent with a send area and an answer area, both
    in ``memory`` (``DRAM`` or ``VRAM``)."""

    def __init__(self, max_bytes: int, memory: str = "DRAM", pages: str = "huge") -> None:
        self.agent = bare_agent("client")
        self.kind = memory
        self.area = raw_area(memory, 2 * max_bytes, pages)  # [send area | answer area]
        self.send_address = self.area.data_ptr()
        self.answer_address = self.send_address + max_bytes
        self.max_bytes = max_bytes
        self.agent.register_memory([(self.send_address, 2 * max_bytes, 0, "")], memory)
        self.offer = {
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "address": self.answer_address,
        }
        self.peer = ""
        self.remote_address = 0
        self._writes: dict[int, Any] = {}

    def connect(self, handle: dict[str, Any]) -> None:
        self.peer = self.agent.add_remote_agent(base64.b64decode(handle["agent_metadata"]))
        self.agent.make_connection(self.peer)
        self.remote_address = int(handle["address"])

    def prepare(self, x: torch.Tensor) -> Callable[[], None]:
        """Puts x's bytes in the send area (synchronised: NIXL reads them); returns one timed round
        trip of them."""
        data = x.view(torch.uint8).reshape(-1)
        size = data.numel()
        self.area[:size].copy_(data)
        if self.area.is_cuda:
            torch.cuda.synchronize(self.area.device)
        write = self._writes.get(size)
        if write is None:
            here = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.send_address, size, 0)], self.kind)
            there = self.agent.prep_xfer_dlist(self.peer, [(self.remote_address, size, 0)], self.kind)
            write = self._writes[size] = self.agent.make_prepped_xfer("WRITE", here, [0], there, [0])
        return partial(self.round_trip, write, str(size).encode())

    def round_trip(self, write: Any, message: bytes) -> None:
        agent = self.agent
        state = agent.transfer(write, message)
        answered = False
        while True:
            if state == "PROC":
                state = agent.check_xfer_state(write)  # our notification may leave only from here
            if not answered:
                answered = bool(agent.get_new_notifs())
            if answered and state != "PROC":
                break
        if state != "DONE":
            raise ConnectionError(f"NIXL WRITE ended in state {state}")

    def answer(self, num_bytes: int) -> torch.Tensor:
        return self.area[self.max_bytes : self.max_bytes + num_bytes]

    def notify_round_trip(self, message: bytes) -> bytes:
        """``message`` to the echo as a notification, and back the same way (no WRITE)."""
        agent = self.agent
        agent.send_notif(self.peer, message)
        while not (received := agent.get_new_notifs()):
            pass
        return bytes(next(iter(received.values()))[0])


def raw_echo(listener: socket.socket) -> None:
    """The socket floor: a blocking socket echoing length-prefixed frames, no protocol at all."""
    conn, _ = listener.accept()
    tune(conn)
    buffer = memoryview(bytearray(8 + 64 * 7168 * 2 * 8))
    while True:
        if not recv_exact(conn, buffer[:8]):
            return
        size = struct.unpack_from("<Q", buffer)[0]
        if not recv_exact(conn, buffer[8 : 8 + size]):
            return
        conn.sendall(buffer[: 8 + size])


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def pipe_echo(conn: Connection) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        x, _ids, _weights = pickle.loads(data)
        conn.send_bytes(pickle.dumps(x))


# --- measurements ----------------------------------------------------------------------------------
def interleaved_medians_us(
    methods: dict[str, Callable[[], None]], reps: int, block: int = 4
) -> dict[str, float]:
    """Median µs of each method over ``reps`` calls, timed in turns: each round runs every method
    once untimed (warm: the echo side is polling again) and then ``block`` timed calls, so load
    from other processes falls on every method alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(-(-reps // block)):
        for name, fn in methods.items():
            fn()
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def inputs(num_tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DTYPE)
    ids = torch.randint(0, 256, (num_tokens, TOP_K), generator=generator)
    weights = torch.rand(num_tokens, TOP_K, generator=generator)
    return x, ids, weights


class Echoes:
    """The echo processes (each its own ``--mode`` of this script); all are stopped on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, mode: str, *args: object, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        command = [sys.executable, __file__, mode, *(str(a) for a in args)]
        process = subprocess.Popen(command, env={**os.environ, **(env or {})})
        self.processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        for process in self.processes:
            self.stop(process)


@contextlib.contextmanager
def echoes(tmp: Path) -> Iterator[Echoes]:
    started = Echoes(tmp)
    try:
        yield started
    finally:
        started.close()


class Pending:
    """An echo process started, before our offer and its handle crossed (through two files)."""

    def __init__(
        self, started: Echoes, tag: str, mode: str, args: tuple[object, ...], env: dict[str, str]
    ) -> None:
        self.offer_path = started.tmp / f"{tag}.offer.json"
        self.handle_path = started.tmp / f"{tag}.handle.json"
        self.env = env
        self.process = started.start(mode, self.offer_path, self.handle_path, *args, env=env)

    def exchange(self, offer: dict[str, Any]) -> dict[str, Any]:
        write_json(self.offer_path, offer)
        handle: dict[str, Any] = read_json(self.handle_path, self.process)
        return handle


def start_nixl_echo(
    started: Echoes, tag: str, max_tokens: int, hidden: int, progress_thread: bool, device: str = "cpu"
) -> Pending:
    env = {PROGRESS_THREAD_ENV: "1" if progress_thread else "0"}
    return Pending(started, tag, "--nixl-echo", (max_tokens, hidden, device), env)


def connect_nixl(pending: Pending, capacity: int, server_device: str = "cpu") -> Any:
    """Connects a ``nixl`` channel to an echo process: our offer goes first, its handle comes back.
    (``server_device`` cuda: the channel's areas go to GPU memory, where this process has a GPU.)"""
    channel_type = get_transport("nixl").channel
    memory = ["DRAM", "VRAM"] if server_device.startswith("cuda") else ["DRAM"]  # its /v1/info says so
    offer = channel_type.offer(capacity, {"memory": memory})
    return channel_type.connect(pending.exchange(offer.body), "127.0.0.1", 10.0, offer)


def start_raw_echo(
    started: Echoes, tag: str, max_bytes: int, ucx_tls: str | None, memory: str = "DRAM", pages: str = "huge"
) -> Pending:
    env = {} if ucx_tls is None else {"UCX_TLS": ucx_tls}
    return Pending(started, tag, "--nixl-raw-echo", (max_bytes, memory, pages), env)


def connect_raw(pending: Pending, max_bytes: int, memory: str = "DRAM", pages: str = "huge") -> RawNixl:
    """A bare client agent here, made with the echo's ``UCX_*`` settings, connected to it."""
    saved = {key: os.environ.get(key) for key in pending.env}
    os.environ.update(pending.env)  # UCX reads its settings when the agent's context is made
    try:
        raw = RawNixl(max_bytes, memory, pages)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    raw.connect(pending.exchange(raw.offer))
    return raw


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    try:
        load_library()
    except TransportUnavailable as exc:
        raise SystemExit(f"transport_rtt: the nixl rows need the NIXL library ({exc})") from None
    reduce_timer_slack()
    torch.set_num_threads(1)
    max_tokens, max_hidden = max(TOKENS), max(HIDDEN)
    capacity = slot_capacity_bytes(max_tokens, TOP_K, max_hidden)
    max_bytes = max_tokens * max_hidden * 2
    channels: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, echoes(Path(tmp)) as started:
        ready_path = Path(tmp) / "ready.json"
        echo = started.start("--echo-server", ready_path, max_tokens, max_hidden)
        context = mp.get_context("spawn")
        parent_end, child_end = context.Pipe()
        pipe_process = context.Process(target=pipe_echo, args=(child_end,), daemon=True)
        pipe_process.start()
        try:
            # Every echo process makes its agent at once; the exchanges follow.
            pending_nixl = start_nixl_echo(started, "nixl", max_tokens, max_hidden, progress_thread=False)
            pending_fixed = start_nixl_echo(
                started, "nixl-fixed", max_tokens, max_hidden, progress_thread=False
            )
            pending_raws = {
                "nixl_raw": start_raw_echo(started, "raw", max_bytes, None),
                "nixl_raw_ucx_tcp": start_raw_echo(started, "raw-tcp", max_bytes, "tcp"),
                "nixl_raw_4k": start_raw_echo(started, "raw-4k", max_bytes, None, pages="4k"),
            }
            handles = read_json(ready_path, echo)
            for name in ("shm", "tcp"):
                channels[name] = get_transport(name).channel.connect(handles[name], "127.0.0.1", 10.0)
            channels["nixl"] = connect_nixl(pending_nixl, capacity)
            fixed_spin = connect_nixl(pending_fixed, capacity)
            fixed_spin._learn = lambda took_s: None  # never learns its server's pace: spins SPIN_S
            raws = {
                name: connect_raw(pending, max_bytes, pages="4k" if name.endswith("_4k") else "huge")
                for name, pending in pending_raws.items()
            }
            raw = socket.create_connection(("127.0.0.1", handles["raw_port"]), timeout=30)
            tune(raw)
            results = run(channels, fixed_spin, raws, raw, parent_end, args.quick)
            fixed_spin.close()
            raw.close()
            # The progress thread: its echo process is started only now (its thread polls a core).
            pending_threaded = start_nixl_echo(
                started, "nixl-thread", max_tokens, max_hidden, progress_thread=True
            )
            channels["nixl_progress_thread"] = connect_nixl(pending_threaded, capacity)
            pids = (pending_nixl.process.pid, pending_threaded.process.pid)
            compare_progress_thread(
                channels["nixl"], channels["nixl_progress_thread"], pids, results, args.quick
            )
        finally:
            for channel in channels.values():
                with contextlib.suppress(Exception):
                    channel.close()
            parent_end.send_bytes(b"")
            pipe_process.join(timeout=5)
    report(results, args)


def round_trip(
    channel: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
) -> None:
    channel.send(LAYER, x, ids, weights)
    out.copy_(channel.receive(time.monotonic() + 10))


def staged_input(channel: Any, x: torch.Tensor) -> torch.Tensor:
    """x as the client hands it to ``channel``: gathered into the channel's staging area when it
    offers one (shm, nixl), else x itself (tcp streams it from wherever it is)."""
    area = channel.staging(x.shape[0], x.shape[1], x.dtype, x.device)
    if area is None:
        return x
    area.copy_(x)
    return area  # type: ignore[no-any-return]


def in_place_round_trip(channel: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """A round trip as the attention client drives a channel: x already in place (``staged_input``:
    the client's gather writes it there), the answer used where it landed (the client adds it into
    its output from there). The staging area keeps holding x between calls: the echo answers y = x
    in place, and the copying round trips write the same bytes into it."""
    channel.send(LAYER, x, ids, weights)
    channel.receive(time.monotonic() + 10)


def copy_there_and_back(x: torch.Tensor, there: torch.Tensor, out: torch.Tensor) -> None:
    there.copy_(x)
    out.copy_(there)


def raw_round_trip(sock: socket.socket, x: torch.Tensor, out: torch.Tensor) -> None:
    """Only x, length-prefixed, over a plain blocking socket (no ids, weights or header)."""
    data = memoryview(x.view(torch.uint8).reshape(-1).numpy())
    sock.sendall(struct.pack("<Q", len(data)))
    sock.sendall(data)
    prefix = memoryview(bytearray(8))
    recv_exact(sock, prefix)
    recv_exact(sock, memoryview(out.view(torch.uint8).reshape(-1).numpy()))


def pickled_round_trip(
    pipe: Connection, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
) -> None:
    pipe.send_bytes(pickle.dumps((x, ids, weights)))
    out.copy_(pickle.loads(pipe.recv_bytes()))


def run(
    channels: dict[str, Any],
    fixed_spin: Any,
    raws: dict[str, RawNixl],
    raw: socket.socket,
    pipe: Connection,
    quick: bool,
) -> list[dict[str, Any]]:
    results = []
    for hidden in HIDDEN:
        for num_tokens in TOKENS:
            x, ids, weights = inputs(num_tokens, hidden)
            out = torch.empty_like(x)
            reps = repetitions(quick)
            row: dict[str, Any] = {
                "tokens": num_tokens,
                "hidden": hidden,
                "bytes": x.numel() * 2,
                "reps": reps,
            }
            staged = {}
            for name, channel in channels.items():
                round_trip(channel, x, ids, weights, out)
                assert torch.equal(out, x), f"{name} echo returned different bytes"
                staged[name] = staged_input(channel, x)
                channel.send(LAYER, staged[name], ids, weights)
                answer = channel.receive(time.monotonic() + 10)
                assert torch.equal(answer, x), f"{name} echo returned different bytes (x in place)"
            expected = x.view(torch.uint8).reshape(-1)
            raw_methods = {}
            for name, pair in raws.items():
                raw_methods[f"{name}_us"] = pair.prepare(x)
                pair.answer(expected.numel()).zero_()
                raw_methods[f"{name}_us"]()
                echoed = pair.answer(expected.numel())
                assert torch.equal(echoed, expected), f"{name} echo returned different bytes"
            if expected.numel() <= RAW_NOTIFY_MAX_BYTES:
                message = NOTIFY_MARK + expected.numpy().tobytes()
                assert raws["nixl_raw"].notify_round_trip(message) == message, "raw notify echo differs"
                raw_methods["nixl_raw_notify_us"] = partial(raws["nixl_raw"].notify_round_trip, message)
            methods = {
                f"{name}_us": partial(round_trip, channel, x, ids, weights, out)
                for name, channel in channels.items()
            }
            methods.update(
                (f"{name}_in_place_us", partial(in_place_round_trip, channel, staged[name], ids, weights))
                for name, channel in channels.items()
            )
            fixed_x = staged_input(fixed_spin, x)
            methods["nixl_fixed_spin_in_place_us"] = partial(
                in_place_round_trip, fixed_spin, fixed_x, ids, weights
            )
            methods["copy_floor_us"] = partial(copy_there_and_back, x, torch.empty_like(x), out)
            methods["socket_floor_us"] = partial(raw_round_trip, raw, x, out)
            methods.update(raw_methods)
            methods["naive_us"] = partial(pickled_round_trip, pipe, x, ids, weights, out)
            row.update(interleaved_medians_us(methods, reps))
            row["shm_over_copy_floor"] = row["shm_us"] / row["copy_floor_us"]
            row["naive_over_tcp"] = row["naive_us"] / row["tcp_us"]
            row["nixl_over_raw"] = row["nixl_us"] / row["nixl_raw_us"]
            row["nixl_over_tcp"] = row["nixl_us"] / row["tcp_us"]
            row["nixl_in_place_over_raw"] = row["nixl_in_place_us"] / row["nixl_raw_us"]
            row["raw_over_raw_4k"] = row["nixl_raw_us"] / row["nixl_raw_4k_us"]
            row["nixl_in_place_over_raw_4k"] = row["nixl_in_place_us"] / row["nixl_raw_4k_us"]
            row["nixl_in_place_over_tcp_in_place"] = row["nixl_in_place_us"] / row["tcp_in_place_us"]
            row["nixl_fixed_spin_over_tcp_in_place"] = (
                row["nixl_fixed_spin_in_place_us"] / row["tcp_in_place_us"]
            )
            results.append(row)
    return results


def compare_progress_thread(
    plain: Any, threaded: Any, pids: tuple[int, int], results: list[dict[str, Any]], quick: bool
) -> None:
    """``nixl`` with and without NIXL's progress thread in the echo process, timed in turns at
    ``NIXL_HIDDEN``; adds to those rows both medians and the CPU seconds per second each echo
    process used during its own turns. The threaded echo process is stopped (SIGSTOP) during the
    other's turns, so that its thread's spinning does not slow the round trips without it."""
    plain_pid, thread_pid = pids
    try:
        for row in results:
            if row["hidden"] != NIXL_HIDDEN:
                continue
            x, ids, weights = inputs(row["tokens"], row["hidden"])
            out = torch.empty_like(x)
            os.kill(thread_pid, signal.SIGCONT)
            round_trip(threaded, x, ids, weights, out)
            assert torch.equal(out, x), "nixl (progress thread) echo returned different bytes"
            turns = {
                "pt_nixl": (plain, plain_pid, signal.SIGSTOP),
                "pt_nixl_progress_thread": (threaded, thread_pid, signal.SIGCONT),
            }
            times: dict[str, list[float]] = {name: [] for name in turns}
            busy = dict.fromkeys(turns, 0.0)
            spent = dict.fromkeys(turns, 0.0)
            block = 4
            for _ in range(-(-repetitions(quick) // block)):
                for name, (channel, echo_pid, sig) in turns.items():
                    os.kill(thread_pid, sig)
                    cpu, begin = cpu_seconds(echo_pid), time.perf_counter()
                    round_trip(channel, x, ids, weights, out)  # untimed: the echo is polling again
                    for _ in range(block):
                        start = time.perf_counter()
                        round_trip(channel, x, ids, weights, out)
                        times[name].append(time.perf_counter() - start)
                    spent[name] += time.perf_counter() - begin
                    busy[name] += cpu_seconds(echo_pid) - cpu
            for name in turns:
                row[f"{name}_us"] = statistics.median(times[name]) * 1e6
                row[f"{name}_echo_cpu"] = busy[name] / spent[name]
            row["progress_thread_over_none"] = row["pt_nixl_progress_thread_us"] / row["pt_nixl_us"]
    finally:
        os.kill(thread_pid, signal.SIGCONT)


def report(results: list[dict[str, Any]], args: Any) -> None:
    print("median µs per round trip; floors measured in the same run, interleaved with the transports")
    print(f"{'T':>5} {'H':>5} {'MiB':>6} | {'copy floor':>10} {'shm':>9} | {'socket floor':>12} {'tcp':>9} "
          f"{'naive':>9} | {'nixl raw':>9} {'raw tcp':>9} {'nixl':>9} | {'shm/floor':>9} {'tcp/socket':>10} "
          f"{'naive/tcp':>9} {'nixl/raw':>8} {'nixl/tcp':>8}")  # fmt: skip
    for r in results:
        print(
            f"{r['tokens']:>5} {r['hidden']:>5} {r['bytes'] / 2**20:>6.2f} | {r['copy_floor_us']:>10.1f} "
            f"{r['shm_us']:>9.1f} | {r['socket_floor_us']:>12.1f} {r['tcp_us']:>9.1f} "
            f"{r['naive_us']:>9.1f} | {r['nixl_raw_us']:>9.1f} {r['nixl_raw_ucx_tcp_us']:>9.1f} "
            f"{r['nixl_us']:>9.1f} | {r['shm_over_copy_floor']:>9.2f} "
            f"{r['tcp_us'] / r['socket_floor_us']:>10.2f} {r['naive_over_tcp']:>9.2f} "
            f"{r['nixl_over_raw']:>8.2f} {r['nixl_over_tcp']:>8.2f}"
        )
    print()
    print("the same round trips as the attention client drives them: x gathered into the channel's "
          "staging area (shm, nixl), the answer used where it landed (no copy out)")  # fmt: skip
    print(f"{'T':>5} {'H':>5} | {'shm':>9} {'tcp':>9} {'nixl':>9} {'fixed spin':>10} | {'nixl raw':>9} "
          f"{'raw notify':>10} {'raw 4K':>9} | {'nixl/raw':>8} {'nixl/tcp':>8} {'fixed/tcp':>9} "
          f"{'raw/4K':>6} {'nixl/4K':>7}")  # fmt: skip
    for r in results:
        notify = f"{r['nixl_raw_notify_us']:>10.1f}" if "nixl_raw_notify_us" in r else f"{'-':>10}"
        print(
            f"{r['tokens']:>5} {r['hidden']:>5} | {r['shm_in_place_us']:>9.1f} {r['tcp_in_place_us']:>9.1f} "
            f"{r['nixl_in_place_us']:>9.1f} {r['nixl_fixed_spin_in_place_us']:>10.1f} | "
            f"{r['nixl_raw_us']:>9.1f} {notify} {r['nixl_raw_4k_us']:>9.1f} | "
            f"{r['nixl_in_place_over_raw']:>8.2f} {r['nixl_in_place_over_tcp_in_place']:>8.2f} "
            f"{r['nixl_fixed_spin_over_tcp_in_place']:>9.2f} {r['raw_over_raw_4k']:>6.2f} "
            f"{r['nixl_in_place_over_raw_4k']:>7.2f}"
        )
    print()
    print(f"nixl at H={NIXL_HIDDEN}, with and without NIXL's progress thread in the echo process "
          "(timed in turns; echo CPU: its CPU seconds per second of its turns)")  # fmt: skip
    print(f"{'T':>5} | {'no thread':>10} {'thread':>10} {'thread/none':>11} | "
          f"{'CPU none':>8} {'CPU thread':>10}")  # fmt: skip
    for r in results:
        if "pt_nixl_us" in r:
            print(
                f"{r['tokens']:>5} | {r['pt_nixl_us']:>10.1f} {r['pt_nixl_progress_thread_us']:>10.1f} "
                f"{r['progress_thread_over_none']:>11.2f} | {r['pt_nixl_echo_cpu']:>8.2f} "
                f"{r['pt_nixl_progress_thread_echo_cpu']:>10.2f}"
            )
    at = {(r["tokens"], r["hidden"]): r for r in results}
    largest = at[(512, 7168)]
    nixl_rows = [r for r in results if r["hidden"] == NIXL_HIDDEN]
    targets = {
        "shm_within_3x_copy_floor_512x7168": target(
            largest["shm_over_copy_floor"], 3.0, higher_is_better=False
        ),
        "tcp_5x_faster_than_naive_512x7168": target(largest["naive_over_tcp"], 5.0),
        "nixl_within_1.3x_raw_128x7168": target(
            at[(128, 7168)]["nixl_in_place_over_raw"], 1.3, higher_is_better=False
        ),
        "nixl_within_1.3x_raw_512x7168": target(
            largest["nixl_in_place_over_raw"], 1.3, higher_is_better=False
        ),
        "nixl_faster_than_tcp_from_32": target(
            max(r["nixl_in_place_over_tcp_in_place"] for r in nixl_rows if r["tokens"] >= 32),
            1.0,
            higher_is_better=False,
        ),
        "nixl_within_1.2x_tcp_below_32": target(
            max(r["nixl_in_place_over_tcp_in_place"] for r in nixl_rows if r["tokens"] < 32),
            1.2,
            higher_is_better=False,
        ),
    }
    emit("transport_rtt", results, targets, args.json_out)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "--echo-server":
        torch.set_num_threads(1)
        echo_server(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "--nixl-echo":
        torch.set_num_threads(1)
        nixl_echo_server(
            Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
        )
    elif mode == "--nixl-raw-echo":
        nixl_raw_echo(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        main()
