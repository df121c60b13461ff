"""The ``nixl`` transport's own guarantees (real NIXL agents over UCX, servers in this process or in
child processes): the exchange and its sizes, a handshake that refuses no token, a wrong token and
forged or foreign metadata and allocates nothing, a stolen slot that is never served, a corrupt
header answered with an error, a client that goes away freeing its slot, a server that dies
failing its clients at once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from datapath_helpers import in_process_servers

from eaas.runtime.auth import Tokens
from eaas.runtime.client.connection import ServerConnection, http_json
from eaas.runtime.client.errors import HandshakeError
from eaas.runtime.model import CheckpointReader
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.protocol import HEADER_OFFSET, FrameKind, SlotHeader, Status, dtype_code
from eaas.runtime.server import ExpertServer
from eaas.runtime.transport import ChannelClosed, RemoteError, nixl_client
from eaas.runtime.transport.base import OfferRefused, Request, TransportOptions
from eaas.runtime.transport.nixl_client import (
    MAX_SLEEP_S,
    MAX_SPIN_S,
    MIN_SLEEP_S,
    SPIN_FACTOR,
    SPIN_S,
    USUAL_RISE,
    WAKE_S,
    NixlChannel,
    NixlOffer,
    area_memory,
    client_endpoint,
    spin_for,
)
from eaas.runtime.transport.nixl_endpoint import (
    HUGE_PAGE_BYTES,
    INLINE_BYTES,
    MAX_METADATA_BYTES,
    UCX_DEFAULTS,
    Memory,
    Notice,
    decode,
    encode,
    frame_length,
    host_memory,
    notice,
    nvidia_gpus,
    transfer_length,
    transfer_lengths,
    ucx_transports_for_host,
)
from eaas.runtime.transport.nixl_server import NixlServerTransport

TOKEN = "tok-" + "n" * 40


@pytest.fixture(scope="module", params=["inline", "whole", "split"])
def served(
    request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Path]
) -> Iterator[tuple[Placement, ExpertServer]]:
    """One mixtral server offering nixl (and tcp), with a data token. Every test runs against the
    three framings: ``inline`` (host memory, as served: frames of at most ``INLINE_BYTES`` in the
    notifications, larger ones by WRITE), ``whole`` (host memory, every frame by WRITE) and
    ``split`` (a GPU-memory arena's: headers in the notifications, payloads alone in the WRITEs;
    in host memory here)."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NixlServerTransport, "split_host_frames", request.param == "split")
        if request.param == "whole":
            patch.setattr(NixlServerTransport, "inline_bytes", 0)
        with in_process_servers(
            checkpoint, placement, transports=("nixl", "tcp"), data_tokens=Tokens((TOKEN,)), max_tokens=64
        ) as servers:
            assert nixl_of(servers[0]).split_host_frames is (request.param == "split")
            yield placement, servers[0]


def connection(server: ExpertServer, client_id: str = "c", token: str | None = TOKEN) -> ServerConnection:
    tokens = Tokens((token,)) if token else Tokens()
    return ServerConnection(0, server.url, "nixl", client_id, 5.0, 2.0, tokens=tokens)


def nixl_of(server: ExpertServer) -> NixlServerTransport:
    transport = server.transports["nixl"]
    assert isinstance(transport, NixlServerTransport)
    return transport


def attached(server: ExpertServer) -> list[dict]:  # type: ignore[type-arg]
    return [row for row in server.slots() if row["transport"] == "nixl" and row["state"] != "OFFLINE"]


def request_for(placement: Placement, num_tokens: int, hidden: int = 64) -> tuple:  # type: ignore[type-arg]
    layer, expert = placement.experts_of(0)[0]
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=generator)
    ids = torch.tensor([[expert, -1]] * num_tokens)
    return layer, x, ids, torch.ones(num_tokens, 2)


@contextlib.contextmanager
def after_one_request(
    server: ExpertServer, placement: Placement, client_id: str
) -> Iterator[tuple[NixlChannel, tuple, torch.Tensor]]:  # type: ignore[type-arg]
    """A channel of ``client_id`` that has served one 2-token request: the channel, that request
    (layer, x, ids, weights) and its answer; closed on exit."""
    conn = connection(server, client_id)
    conn.connect()
    try:
        channel = conn.channel
        assert isinstance(channel, NixlChannel)
        request = request_for(placement, 2)
        channel.send(*request)
        yield channel, request, channel.receive(time.monotonic() + 10).clone()
    finally:
        conn.close()


def counted_writes(channel: NixlChannel) -> list[int]:
    """The payload sizes of the frames ``channel`` sends by WRITE from now on (a frame that travels
    in its notice is not among them)."""
    sizes: list[int] = []
    write_frame = channel.writes.write_frame

    def counting(size: int, message: bytes) -> None:
        sizes.append(size)
        write_frame(size, message)

    channel.writes.write_frame = counting  # type: ignore[method-assign]
    return sizes


def wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def vma_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping of this process that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(part, 16) for part in head.split("-"))
            if start <= address < end:
                flags = next(rest for rest in lines[i + 1 :] if rest.startswith("VmFlags:"))
                return flags.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_memory_is_zeroed_and_starts_on_a_huge_page_that_the_kernel_is_asked_for() -> None:
    size = 3 * HUGE_PAGE_BYTES + 4096
    area = host_memory(size)
    assert area.dtype == np.uint8 and area.size == size and area.flags.writeable and not area.any()
    assert area.ctypes.data % HUGE_PAGE_BYTES == 0
    area[-1] = 7  # all of it is ours
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():  # a kernel with huge pages
        assert "hg" in vma_flags(area.ctypes.data)  # MADV_HUGEPAGE
    small = host_memory(4096)  # below a huge page: plain memory
    assert small.size == 4096 and not small.any()


def test_transfer_lengths_cover_every_frame_with_little_waste() -> None:
    limit = 64 + 512 * 7168 * 2 + 512 * 8 * 12
    lengths = transfer_lengths(limit)
    assert lengths == sorted(set(lengths)) and lengths[-1] == limit
    assert len(lengths) < 600  # one prepared WRITE per length, made on first use
    for size in [1, 48, 4096, 4097, 65536, 65537, 1 << 20, (1 << 20) + 1, limit - 1, limit]:
        length = transfer_length(size, limit)
        assert length in lengths and size <= length <= limit
        assert length <= max(size * (1 + 1 / 64), size + 4096), (size, length)


@pytest.mark.parametrize("given", [None, "yes"])
def test_an_agent_starts_with_ucx_memory_events_off_unless_the_environment_says(given: str | None) -> None:
    """UCX reads ``UCX_MEM_EVENTS`` when it is loaded, with the process's first agent: the agent
    puts our default into the environment before that, and leaves a value given there alone."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_MEM_EVENTS"}
    if given is not None:
        env["UCX_MEM_EVENTS"] = given
    script = (
        "import os\n"
        "from eaas.runtime.transport.nixl_endpoint import Endpoint\n"
        "Endpoint('client')\n"
        "print(os.environ.get('UCX_MEM_EVENTS'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [UCX_DEFAULTS["UCX_MEM_EVENTS"] if given is None else given]


@pytest.mark.parametrize(
    ("given", "gpus", "driver", "started_with"),
    [
        ("tcp", 1, True, "tcp,cuda_copy"),  # the pools' default on a GPU node: NIXL refuses plain tcp
        (" rc_x , tcp ", 8, True, "rc_x , tcp,cuda_copy"),
        ("tcp,", 1, True, "tcp,cuda_copy"),
        ("tcp,cuda_copy", 1, True, "tcp,cuda_copy"),  # names one already
        ("rc,cuda", 1, True, "rc,cuda"),
        ("^cma", 1, True, "^cma"),  # an exclusion list keeps cuda
        (None, 1, True, None),  # UCX's own choice
        ("tcp", 0, True, "tcp"),  # no GPU: nothing to add
        ("tcp", 2, False, "tcp"),  # GPUs on the bus but no driver here: UCX has no CUDA transport
    ],
)
def test_ucx_transports_gain_cuda_copy_only_where_nixl_requires_it(
    given: str | None, gpus: int, driver: bool, started_with: str | None
) -> None:
    assert ucx_transports_for_host(given, gpus, driver) == started_with


def test_nvidia_gpus_are_counted_from_the_pci_bus_as_nixl_counts_them(tmp_path: Path) -> None:
    devices = {
        "0000:00:01.0": ("0x10de", "0x030200"),  # an H100/H200: a 3D controller
        "0000:00:02.0": ("0x10de", "0x030000"),  # a display controller
        "0000:00:03.0": ("0x10de", "0x068000"),  # an NVIDIA bridge (NVSwitch): not a GPU
        "0000:00:04.0": ("0x15b3", "0x020700"),  # a ConnectX NIC
        "0000:00:05.0": ("0x1af4", "0x010000"),
    }
    for name, (vendor, pci_class) in devices.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "class").write_text(pci_class + "\n")
    (tmp_path / "0000:00:06.0").mkdir()  # unreadable entries are skipped
    (tmp_path / "0000:00:06.0" / "vendor").write_text("garbage\n")
    assert nvidia_gpus(str(tmp_path)) == 2
    assert nvidia_gpus(str(tmp_path / "missing")) == 0


def test_a_waiting_client_spins_longer_only_for_a_server_that_answers_fast() -> None:
    assert spin_for(None) == SPIN_S  # nothing learned yet
    assert spin_for(50e-6) == SPIN_S  # 1.5 x 50 µs is within the least spin
    assert spin_for(400e-6) == pytest.approx(SPIN_FACTOR * 400e-6)
    assert spin_for(MAX_SPIN_S / SPIN_FACTOR) == pytest.approx(MAX_SPIN_S)
    assert spin_for(2e-3) == SPIN_S  # a computing server: the wait leaves the cores to it


def test_the_usual_round_trip_follows_a_faster_answer_at_once_and_a_slower_one_slowly(
    served: tuple[Placement, ExpertServer],
) -> None:
    placement, server = served
    with contextlib.closing(connection(server, "pace")) as conn:
        conn.connect()
        channel = conn.channel
        assert isinstance(channel, NixlChannel)
        layer, x, ids, weights = request_for(placement, 1)
        channel.send(layer, x, ids, weights)
        channel.receive(time.monotonic() + 10)
        assert channel._usual_s is not None and channel._usual_s > 0  # learned from a real answer
        channel._learn(300e-6)
        channel._learn(200e-6)
        assert channel._usual_s == pytest.approx(200e-6)
        assert channel._spin_s == pytest.approx(SPIN_FACTOR * 200e-6)
        channel._learn(3e-3)  # one late answer (a server that was asleep)
        assert channel._usual_s == pytest.approx(200e-6 + USUAL_RISE * 2.8e-3)
        assert channel._spin_s == pytest.approx(SPIN_FACTOR * channel._usual_s)
        for _ in range(40):  # answers that keep coming late: the spin gives up
            channel._learn(5e-3)
        assert channel._spin_s == SPIN_S


def test_a_waiting_client_is_awake_when_its_answer_is_due(served: tuple[Placement, ExpertServer]) -> None:
    _, server = served
    with contextlib.closing(connection(server, "due")) as conn:
        conn.connect()
        channel = conn.channel
        assert isinstance(channel, NixlChannel)
        channel._usual_s = 2e-3  # a server that usually answers in 2 ms (a large frame, a computation)
        channel._spin_s = spin_for(channel._usual_s)

        interval_after = channel._interval_after
        assert interval_after(0.0) == 0.0  # right after the send
        assert interval_after(1e-3) == pytest.approx(1e-3 / 4)  # a quarter of the wait...
        # ...but never past the time to wake
        assert interval_after(1.8e-3) == pytest.approx(2e-3 - WAKE_S - 1.8e-3)
        assert interval_after(2e-3 - WAKE_S - 5e-6) == MIN_SLEEP_S
        assert interval_after(2e-3 - WAKE_S + 50e-6) == 0.0  # awake: the answer is due
        assert interval_after(2.4e-3) == 0.0  # still due: DUE_SPIN_FACTOR x 2 ms after it
        assert interval_after(2.6e-3) == MAX_SLEEP_S  # later than usual: slept for again
        channel._usual_s = None  # nothing learned: a quarter of the wait, from SPIN_S on
        assert interval_after(1.8e-3) == pytest.approx(1.8e-3 / 4)


def test_an_answer_seen_after_a_sleep_counts_from_the_last_look_that_missed_it(
    served: tuple[Placement, ExpertServer],
) -> None:
    placement, server = served
    with after_one_request(server, placement, "missed") as (channel, request, _):
        if channel.inline_bytes == 0:
            pytest.skip("a WRITE completes (and its notice leaves) only as its waiter makes progress")

        def server_answered(requests: int) -> bool:
            """The server answered its ``requests``-th request (read on its side: the waiter is not
            looking meanwhile)."""
            [row] = [r for r in attached(server) if r["client_id"] == "missed"]
            return bool(row["requests"] == requests and row["state"] == "IDLE")

        channel._usual_s = None  # (what the first exchange taught, out of the way)
        channel.send(*request)
        assert not channel.answered()  # looked at once: no server answers that fast
        missed = channel._missed_s
        wait_for(lambda: server_answered(2), 10, "the server's second answer")
        assert channel.answered()  # seen late, after the waiter's sleep
        assert missed > 0 and channel._usual_s == pytest.approx(missed)  # not the time it slept
        channel.receive(time.monotonic() + 10)
        channel._usual_s = None
        channel.send(*request)
        wait_for(lambda: server_answered(3), 10, "the server's third answer")
        assert channel.answered()  # seen at the first look: no bound on when it came, nothing learned
        assert channel._usual_s is None
        channel.receive(time.monotonic() + 10)


def test_requests_of_every_size_round_trip_and_match_the_local_experts(
    served: tuple[Placement, ExpertServer],
) -> None:
    placement, server = served
    conn = connection(server)
    conn.connect()
    try:
        channel = conn.channel
        assert isinstance(channel, NixlChannel) and conn.handle["transport"] == "nixl"
        inline = nixl_of(server).inline_bytes and not channel.split
        # As served, a frame of at most INLINE_BYTES (the slot's whole frame, if smaller) travels in
        # its notice: 64 tokens of 64 float32 (17 KB) by WRITE, the rest inline.
        assert channel.inline_bytes == (
            min(INLINE_BYTES, frame_length(server.limits.capacity_bytes)) if inline else 0
        )
        writes = counted_writes(channel)
        for num_tokens in (1, 2, 7, 33, 64):  # 64: the slot's whole capacity
            layer, x, ids, weights = request_for(placement, num_tokens)
            channel.send(layer, x, ids, weights)
            y = channel.receive(time.monotonic() + 10).clone()
            torch.testing.assert_close(y, expert_answer(server, layer, x, ids), rtol=1e-4, atol=1e-4)
        [row] = [r for r in attached(server) if r["client_id"] == "c"]
        assert row["requests"] == 5
        assert len(writes) == (1 if inline else 5), writes
    finally:
        conn.close()
    wait_for(lambda: not attached(server), 5, "the slot released after close")


def expert_answer(server: ExpertServer, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What the server's one expert of ``request_for`` answers for x, computed here."""
    stack = server.stack
    group = stack.group_table[layer, int(ids[0, 0])]
    gate, up = (x @ stack.w13[group].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ stack.w2[group].T


def test_answers_of_one_shape_come_in_one_view_that_holds_the_latest(
    served: tuple[Placement, ExpertServer],
) -> None:
    placement, server = served
    with after_one_request(server, placement, "views") as (channel, (layer, x, ids, weights), y):
        torch.testing.assert_close(y, expert_answer(server, layer, x, ids), rtol=1e-4, atol=1e-4)
        channel.send(layer, -2 * x, ids, weights)
        again = channel.receive(time.monotonic() + 10)
        torch.testing.assert_close(again, expert_answer(server, layer, -2 * x, ids), rtol=1e-4, atol=1e-4)
        channel.send(layer, x, ids, weights)
        latest = channel.receive(time.monotonic() + 10)
        assert latest is again  # the same shape: the view made for the earlier answer
        torch.testing.assert_close(latest, expert_answer(server, layer, x, ids), rtol=1e-4, atol=1e-4)
        layer, x, ids, weights = request_for(placement, 3)
        channel.send(layer, x, ids, weights)
        other = channel.receive(time.monotonic() + 10)
        assert other.shape == (3, 64)
        torch.testing.assert_close(other, expert_answer(server, layer, x, ids), rtol=1e-4, atol=1e-4)


def test_channels_opened_and_closed_on_one_thread_while_another_decodes(
    served: tuple[Placement, ExpertServer],
) -> None:
    """What a placement switch does: one thread attaches the next placement's channels (and the
    old ones close) while the decoding thread sends on its own. The process's one agent is driven
    by both; every answer stays right and nothing hangs."""
    placement, server = served
    layer, x, ids, weights = request_for(placement, 7)
    decoding = connection(server, "decoder")
    decoding.connect()
    assert decoding.channel is not None
    decoding.channel.send(layer, x, ids, weights)
    want = decoding.channel.receive(time.monotonic() + 10).clone()
    failures: list[BaseException] = []
    stop = threading.Event()

    def switch() -> None:
        try:
            for i in range(12):
                conn = connection(server, f"switch-{i}")
                conn.connect()
                assert conn.channel is not None
                conn.channel.send(layer, x, ids, weights)
                conn.channel.receive(time.monotonic() + 10)
                conn.close()
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            stop.set()

    switcher = threading.Thread(target=switch)
    switcher.start()
    rounds = 0
    try:
        while not stop.is_set():
            decoding.channel.send(layer, x, ids, weights)
            torch.testing.assert_close(decoding.channel.receive(time.monotonic() + 10), want)
            rounds += 1
    finally:
        switcher.join(timeout=60)
        decoding.close()
    assert not switcher.is_alive() and not failures, failures
    assert rounds > 0
    wait_for(lambda: not attached(server), 5, "every slot released")


def test_a_cpu_server_lists_host_memory_only_and_is_offered_host_memory(
    served: tuple[Placement, ExpertServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client offers GPU memory only to a server whose ``/v1/info`` lists ``VRAM`` for nixl (and
    only with a GPU of its own); a server of an earlier version lists nothing. What the server lists
    is what the client's choice is made from."""
    _, server = served
    info = http_json("GET", f"{server.url}/v1/info", timeout_s=5.0)
    assert info["transports"]["nixl"] == {"memory": ["DRAM"]}
    asked: list[dict] = []  # type: ignore[type-arg]

    def choose(described: dict) -> Memory:  # type: ignore[type-arg]
        asked.append(described)
        return area_memory(described)

    monkeypatch.setattr(nixl_client, "area_memory", choose)
    conn = connection(server, "listed")
    conn.connect()
    try:
        assert asked == [{"memory": ["DRAM"]}]
        assert isinstance(conn.channel, NixlChannel)
        assert conn.channel.offer_made.memory.kind == "DRAM" and conn.handle["memory"] == "DRAM"
    finally:
        conn.close()
    gpu = torch.cuda.is_available()
    assert area_memory({"memory": ["DRAM", "VRAM"]}).kind == ("VRAM" if gpu else "DRAM")
    for described in ({}, {"memory": ["DRAM"]}, {"memory": "VRAM"}, {"memory": None}):
        assert area_memory(described).kind == "DRAM", described


def test_a_closed_channels_areas_serve_the_next_channel(served: tuple[Placement, ExpertServer]) -> None:
    """The server still knows a closed channel's areas under this process's agent while another
    channel holds that agent. The next channel's offer takes the same areas, registered once, so
    its metadata repeats what the server knows; new areas at a freed one's address would carry a
    new key, which NIXL refuses (seen with GPU memory: the CUDA caching allocator hands a freed
    block out again at once)."""
    placement, server = served
    layer, x, ids, weights = request_for(placement, 3)

    def retired() -> bool:
        client_endpoint().deliver()  # progress: a closed channel's last ping completes
        return client_endpoint().retiring() == 0

    # Earlier tests' channels first: areas whose retiring ends between two of ours would be the
    # spare the next offer takes.
    wait_for(retired, 5, "earlier channels' writes retired")
    holder = connection(server, "holder")
    holder.connect()
    try:
        assert isinstance(holder.channel, NixlChannel)
        held = holder.channel.offer_made.send_address
        addresses = []
        for i in range(3):
            conn = connection(server, f"again-{i}")
            conn.connect()
            channel = conn.channel
            assert isinstance(channel, NixlChannel)
            addresses.append(channel.offer_made.send_address)
            channel.send(layer, x, ids, weights)
            assert channel.receive(time.monotonic() + 10).shape == x.shape
            conn.close()
            wait_for(retired, 5, "the closed channel's writes retired")
        assert len(set(addresses)) == 1 and held not in addresses, (held, addresses)
        holder.channel.send(layer, x, ids, weights)  # and the holder is unaffected
        assert holder.channel.receive(time.monotonic() + 10).shape == x.shape
    finally:
        holder.close()


def test_a_refused_request_comes_back_as_a_remote_error_and_the_slot_stays_usable(
    served: tuple[Placement, ExpertServer],
) -> None:
    placement, server = served
    conn = connection(server, "refused")
    conn.connect()
    try:
        channel = conn.channel
        assert channel is not None
        layer, x, ids, weights = request_for(placement, 3)
        channel.send(layer, x, torch.full_like(ids, 10_000), weights)  # no such expert
        with pytest.raises(RemoteError, match="expert"):
            channel.receive(time.monotonic() + 10)
        channel.send(layer, x, ids, weights)
        assert channel.receive(time.monotonic() + 10).shape == x.shape
    finally:
        conn.close()


def test_a_corrupt_header_is_answered_with_an_error_status(served: tuple[Placement, ExpertServer]) -> None:
    placement, server = served
    with after_one_request(server, placement, "corrupt") as (channel, request, _):
        layer, x, ids, weights = request
        # A header whose payload size is far beyond the slot, written straight into the slot (split
        # frames: sent in the notice): the server must refuse it, not read past the slot.
        bad = SlotHeader(FrameKind.REQUEST, dtype_code(x.dtype), layer, 2, 2, x.shape[1], 99, 1 << 31)
        tail = b""
        if channel.split:
            tail = bad.pack()
        else:
            assert channel.send_buffer is not None
            bad.pack_into(channel.send_buffer, HEADER_OFFSET)
        channel._expect = (99, bad.num_tokens, bad.hidden, bad.dtype)  # what a reply must echo
        channel.writes.write_frame(0, notice(Notice.REQUEST, channel.slot, channel.generation, 99, tail))
        with pytest.raises(RemoteError) as error:
            channel.receive(time.monotonic() + 10)
        assert error.value.status == Status.TOO_LARGE
        channel.send(layer, x, ids, weights)  # and the slot serves the next request
        assert channel.receive(time.monotonic() + 10).shape == x.shape


def test_a_request_notice_with_a_wrong_tail_is_never_served(served: tuple[Placement, ExpertServer]) -> None:
    """Split frames need the header in the request's notice; whole frames carry it in the slot and
    take a header alone in a notice for a forgery; a frame in a notice must hold exactly the payload
    its header declares, within what the slot agreed to take (nothing, for a slot that takes frames
    by WRITE only). Every such notice is dropped and counted, and the slot serves the next request."""
    placement, server = served
    transport = nixl_of(server)
    with after_one_request(server, placement, "headless") as (channel, request, _):
        assert channel.split is transport.split_host_frames
        layer, x, ids, weights = request
        header = SlotHeader(FrameKind.REQUEST, dtype_code(x.dtype), layer, 2, 2, x.shape[1], 7, 100)
        wrong_tails = [
            b"" if channel.split else bytes(48),  # no header, or one too many
            header.pack() + bytes(99),  # a frame a byte short of its header's payload
            header.pack() + bytes(101),  # a byte over
        ]
        for seq, tail in enumerate(wrong_tails, start=5):
            refused = transport.refused_notices
            channel.writes.write_frame(0, notice(Notice.REQUEST, channel.slot, channel.generation, seq, tail))
            deadline = time.monotonic() + 5
            while transport.refused_notices == refused:
                assert time.monotonic() < deadline, (
                    f"the notice with a tail of {len(tail)} bytes was never seen"
                )
                channel.writes.settle()
                time.sleep(0.01)
        assert [r["requests"] for r in attached(server) if r["client_id"] == "headless"] == [1]
        channel.send(layer, x, ids, weights)  # and the slot serves the next request
        assert channel.receive(time.monotonic() + 10).shape == x.shape


def test_an_answer_whose_notice_does_not_add_up_fails_the_channel(
    served: tuple[Placement, ExpertServer],
) -> None:
    """An answer's notice with a frame the channel did not agree to, or with a payload other than
    its header declares, is a malformed response: the channel fails (its client fails over) and
    nothing of it is taken for y."""
    placement, server = served
    with after_one_request(server, placement, "misanswered") as (channel, request, y):
        layer, x, _, _ = request
        size = y.numel() * y.element_size()
        header = SlotHeader(FrameKind.RESPONSE, dtype_code(x.dtype), layer, 2, 2, x.shape[1], 99, size)
        says = (
            "bytes after the header in a split frame's notice"
            if channel.split
            else (
                "payload bytes in the notice, the header says" if channel.inline_bytes else "takes at most 0"
            )
        )
        channel._expect = (99, 2, x.shape[1], dtype_code(x.dtype))
        channel._answer_tail = header.pack() + bytes(size - 1)
        with pytest.raises(ChannelClosed, match=says):
            channel._take_response()


def test_a_client_or_server_of_an_earlier_version_exchanges_every_frame_by_write(
    served: tuple[Placement, ExpertServer],
) -> None:
    """``inline_bytes`` is agreed in the handshake: a client that offers none (an earlier version)
    gets none, and a handle that names none (an earlier server) makes a channel that sends every
    frame by WRITE; the exchange works both ways."""
    placement, server = served
    layer, x, ids, weights = request_for(placement, 1)
    offer = NixlChannel.offer(server.limits.capacity_bytes)
    offer.inline_bytes = 0  # as a client of an earlier version offers
    del offer.body["inline_bytes"]
    body = {"client_id": "earlier", "transport": "nixl", "offer": offer.body}
    status, text = post_slot(server, body)
    assert status == 201, text
    handle = json.loads(text)
    assert handle["inline_bytes"] == 0
    del handle["inline_bytes"]
    channel = NixlChannel.connect(handle, "127.0.0.1", 5.0, offer)
    try:
        assert channel.inline_bytes == 0
        writes = counted_writes(channel)
        channel.send(layer, x, ids, weights)
        assert channel._answer_tail == b"" and channel.receive(time.monotonic() + 10).shape == x.shape
        assert len(writes) == 1
    finally:
        channel.close()  # (its goodbye releases the slot)
    wait_for(lambda: not [r for r in attached(server) if r["client_id"] == "earlier"], 5, "the slot released")


@pytest.mark.parametrize("given", [INLINE_BYTES + 1, -1, "16k"])
def test_a_handle_granting_frames_in_notices_the_client_did_not_offer_is_refused(
    served: tuple[Placement, ExpertServer], given: object
) -> None:
    """The client takes frames in notices only up to what it offered (and none where the server
    splits its frames); a handle that says otherwise fails the handshake, naming the field."""
    _, server = served
    offer = NixlChannel.offer(server.limits.capacity_bytes)
    status, text = post_slot(server, {"client_id": "overgranted", "transport": "nixl", "offer": offer.body})
    assert status == 201, text
    handle = json.loads(text)
    try:
        handle["inline_bytes"] = given
        with pytest.raises(ChannelClosed, match="inline_bytes: at most the 16384 offered"):
            NixlChannel.connect(handle, "127.0.0.1", 5.0, offer)
    finally:
        url = f"{server.url}/v1/slots/nixl/{handle['slot']}?client_id=overgranted"
        http_json("DELETE", url, timeout_s=5.0, token=TOKEN)


def post_slot(server: ExpertServer, body: dict, token: str | None = TOKEN) -> tuple[int, str]:  # type: ignore[type-arg]
    try:
        return 201, json.dumps(http_json("POST", f"{server.url}/v1/slots", body, timeout_s=5.0, token=token))
    except HandshakeError as error:
        code = int(str(error).split("HTTP ")[1].split(":")[0])
        return code, str(error)


@pytest.mark.parametrize(
    ("change", "token", "code", "says"),
    [
        ({}, None, 401, "data token"),
        ({}, "tok-wrong-" + "x" * 30, 401, "data token"),
        ({"offer": None}, TOKEN, 400, "offer: transport nixl needs"),
        ({"offer": "not an object"}, TOKEN, 400, "offer: a JSON object"),
        ({"offer.agent_metadata": "!!!"}, TOKEN, 400, "offer.agent_metadata: not valid base64"),
        ({"offer.agent_metadata": encode(b"nixlSerDes|garbage")}, TOKEN, 400, "NIXL refused it"),
        ({"offer.answer_address": -5}, TOKEN, 400, "offer.answer_address"),
        ({"offer.answer_address": "shift"}, TOKEN, 400, "offer.answer_address"),
        ({"offer.answer_bytes": 16}, TOKEN, 400, "offer.answer_bytes"),
        ({"offer.answer_shift": 1 << 30}, TOKEN, 400, "is not memory the client's agent registered"),
        ({"offer.answer_memory": "GPU"}, TOKEN, 400, "offer.answer_memory: DRAM or VRAM"),
        ({"offer.answer_device": -1}, TOKEN, 400, "offer.answer_memory: DRAM or VRAM"),
        ({"offer.answer_memory": "VRAM"}, TOKEN, 400, "offer.answer_memory: VRAM, but this server computes"),
        ({"offer.inline_bytes": -1}, TOKEN, 400, "offer.inline_bytes: a non-negative integer"),
        ({"offer.inline_bytes": "16k"}, TOKEN, 400, "offer.inline_bytes: a non-negative integer"),
    ],
)
def test_a_bad_handshake_is_refused_and_allocates_nothing(
    served: tuple[Placement, ExpertServer],
    change: dict,
    token: str | None,
    code: int,
    says: str,  # type: ignore[type-arg]
) -> None:
    _, server = served
    offer = NixlChannel.offer(server.limits.capacity_bytes)
    try:
        body: dict[str, Any] = {"client_id": "rogue", "transport": "nixl", "offer": dict(offer.body)}
        for key, value in change.items():
            if key == "offer.answer_shift":
                body["offer"]["answer_address"] += value
            elif key.startswith("offer."):
                body["offer"][key.removeprefix("offer.")] = value
            else:
                body[key] = value
        peers_before = set(nixl_of(server).endpoint.peers())
        status, text = post_slot(server, body, token)
        assert status == code, text
        assert says in text, text
        assert not [r for r in attached(server) if r["client_id"] == "rogue"]
        # No agent left loaded either (a peer of an earlier test may finish retiring meanwhile).
        assert set(nixl_of(server).endpoint.peers()) <= peers_before
    finally:
        offer.close()


def test_metadata_claiming_an_attached_clients_agent_is_refused(
    served: tuple[Placement, ExpertServer],
) -> None:
    """Another process makes an agent under the name of this process's client agent: the server,
    which knows that name with other connection details, refuses it and allocates nothing."""
    _, server = served
    conn = connection(server, "victim")
    conn.connect()
    script = textwrap.dedent(
        """
        import json, sys, numpy
        from eaas.runtime.transport.nixl_endpoint import Endpoint, encode
        endpoint = Endpoint("client")
        endpoint.name = sys.argv[1]
        endpoint.agent = endpoint.library.nixl_agent(sys.argv[1], endpoint.library.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"]))
        area = numpy.zeros(1 << 20, numpy.uint8)
        registration = endpoint.register(int(area.ctypes.data), area.nbytes)
        print(json.dumps({"agent_metadata": encode(endpoint.metadata(registration)),
                          "answer_address": int(area.ctypes.data), "answer_bytes": area.nbytes,
                          "answer_memory": "DRAM", "answer_device": 0}))
        """
    )
    try:
        made = subprocess.run(
            [sys.executable, "-c", script, client_endpoint().name],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        forged = json.loads(made.stdout.strip().splitlines()[-1])
        before = len(attached(server))
        status, text = post_slot(server, {"client_id": "forger", "transport": "nixl", "offer": forged})
        assert status == 400 and "NIXL refused it" in text, text
        assert len(attached(server)) == before
        channel = conn.channel  # the victim is unaffected
        assert channel is not None
        layer, x, ids, weights = request_for(served[0], 2)
        channel.send(layer, x, ids, weights)
        assert channel.receive(time.monotonic() + 10).shape == x.shape
    finally:
        conn.close()


THIEF_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from eaas.runtime.auth import Tokens
    from eaas.runtime.client.connection import ServerConnection
    from eaas.runtime.transport.nixl_endpoint import Notice, TransferSet, notice
    url, token, victim_slot, victim_address, generation = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    conn = ServerConnection(0, url, "nixl", "thief", 5.0, 2.0, tokens=Tokens((token,)))
    conn.connect()
    channel = conn.channel
    try:  # the victim's slot itself: this agent holds no key to it
        TransferSet(channel.endpoint, channel.peer, channel.offer_made.send_address, victim_address, 64)
        print("wrote into the victim's slot", flush=True)
    except Exception as exc:
        print("refused:", type(exc).__name__, flush=True)
    channel.writes.write_frame(0, notice(Notice.REQUEST, victim_slot, generation, 1))
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # the notification leaves as this agent makes progress
        channel.writes.settle()
        channel.endpoint.deliver()
        time.sleep(0.001)
    print("announced", flush=True)
    conn.close()
    """
)


def test_a_stolen_slot_is_never_served(served: tuple[Placement, ExpertServer]) -> None:
    """Another client process announces a request in the victim's slot: the server sees the
    announcement come from an agent that does not hold that slot and ignores it; and the thief's
    agent cannot even address the victim's slot memory (it was given the key to its own only)."""
    placement, server = served
    victim = connection(server, "victim")
    victim.connect()
    try:
        assert victim.channel is not None
        refused = nixl_of(server).refused_notices
        handle = victim.handle
        args = [server.url, TOKEN, *(str(handle[k]) for k in ("slot", "slot_address", "generation"))]
        thief = subprocess.run(
            [sys.executable, "-c", THIEF_SCRIPT, *args], capture_output=True, text=True, timeout=60
        )
        assert thief.returncode == 0, thief.stderr[-2000:]
        assert "refused: nixlNotFoundError" in thief.stdout, thief.stdout
        assert "announced" in thief.stdout
        wait_for(lambda: nixl_of(server).refused_notices > refused, 5, "the stolen slot's notice refused")
        assert [r["requests"] for r in attached(server) if r["client_id"] == "victim"] == [0]
        layer, x, ids, weights = request_for(placement, 2)
        victim.channel.send(layer, x, ids, weights)  # the victim's slot still works, untouched
        assert victim.channel.receive(time.monotonic() + 10).shape == x.shape
    finally:
        victim.close()


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from eaas.runtime.auth import Tokens
    from eaas.runtime.client.connection import ServerConnection
    url, token, layer, expert = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    conn = ServerConnection(0, url, "nixl", "doomed-client", 5.0, 2.0, tokens=Tokens((token,)))
    conn.connect()
    conn.channel.send(layer, torch.randn(2, 64), torch.tensor([[expert, -1]] * 2), torch.ones(2, 2))
    conn.channel.receive(time.monotonic() + 10)
    print("slot", conn.handle["slot"], flush=True)
    time.sleep(120)
    """
)


def test_a_killed_client_frees_its_slot_and_its_agent(served: tuple[Placement, ExpertServer]) -> None:
    placement, server = served
    layer, expert = placement.experts_of(0)[0]
    peers_before = set(nixl_of(server).endpoint.peers())
    doomed = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, server.url, TOKEN, str(layer), str(expert)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert doomed.stdout is not None
        line = doomed.stdout.readline()
        assert line.startswith("slot"), line
        [doomed_agent] = set(nixl_of(server).endpoint.peers()) - peers_before
        doomed.kill()
        doomed.wait(timeout=10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)
    started = time.monotonic()
    wait_for(
        lambda: not [r for r in attached(server) if r["client_id"] == "doomed-client"],
        10,
        "the killed client's slot released",
    )
    print(f"killed client's slot released after {time.monotonic() - started:.2f} s")
    # Its agent is let go of (other peers may come and go meanwhile: earlier tests' slots retiring).
    assert doomed_agent not in nixl_of(server).endpoint.peers()


SERVER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from eaas.runtime.placement import Placement
    from eaas.runtime.server import ExpertServer
    placement = Placement.from_json(Path(sys.argv[2]).read_text())
    server = ExpertServer.from_placement(sys.argv[1], placement, 0, transports=("nixl",), max_tokens=64)
    server.start()
    print(json.dumps({"url": server.url}), flush=True)
    sys.stdin.read()
    """
)


def test_a_killed_server_fails_its_waiting_client_at_once(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    (tmp_path / "placement.json").write_text(placement.to_json())
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(checkpoint), str(tmp_path / "placement.json")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        url = json.loads(process.stdout.readline())["url"]
        conn = ServerConnection(0, url, "nixl", "left-behind", 30.0, 5.0)
        conn.connect()
        channel = conn.channel
        assert channel is not None
        layer, x, ids, weights = request_for(placement, 2)
        channel.send(layer, x, ids, weights)
        channel.receive(time.monotonic() + 10)
        process.send_signal(19)  # SIGSTOP: the request below is never answered
        channel.send(layer, x, ids, weights)
        time.sleep(0.1)
        assert not channel.answered()  # a hang raises nothing in NIXL: the client's probe covers it
        process.kill()
        process.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="the server is gone"):
            channel.receive(time.monotonic() + 30)
        waited = time.monotonic() - started
        print(f"dead server seen by its waiting client after {waited * 1e3:.0f} ms")
        assert waited < 1.0
        conn.drop()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


LEFT_HUNG_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from eaas.runtime.client.connection import ServerConnection
    from eaas.runtime.placement import Placement
    from eaas.runtime.transport.nixl_client import client_endpoint
    sys.path.insert(0, sys.argv[4])
    from test_nixl import request_for
    placement = Placement.from_json(Path(sys.argv[1]).read_text())
    url, pid, other_url = sys.argv[2], int(sys.argv[3]), sys.argv[5]
    conn = ServerConnection(0, url, "nixl", "left-hung", 30.0, 5.0)
    conn.connect()
    other = ServerConnection(0, other_url, "nixl", "busy", 30.0, 5.0)
    other.connect()
    layer, x, ids, weights = request_for(placement, 2)

    def round_trip():  # to the other server: progress on the agent, as a decoding client makes
        other.channel.send(layer, x, ids, weights)
        other.channel.receive(time.monotonic() + 10)

    conn.channel.send(layer, x, ids, weights)
    conn.channel.receive(time.monotonic() + 10)
    os.kill(pid, signal.SIGSTOP)
    conn.channel.send(layer, x, ids, weights)  # never answered: in flight when the channel closes
    time.sleep(0.2)
    conn.drop()
    endpoint = client_endpoint()
    for _ in range(50):
        round_trip()
    kept = (endpoint.retiring(), len(endpoint.peers()))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (endpoint.retiring() or time.monotonic() < deadline - 3):
        round_trip()  # UCX reports the dead server in these progress calls
    print(json.dumps({"kept": kept, "after": (endpoint.retiring(), len(endpoint.peers()))}), flush=True)
    """
)


def test_a_channel_closed_on_a_hung_server_keeps_its_connection_until_the_server_dies(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Closing a channel whose request a hung (SIGSTOPped) server never answered, then the server
    dying: NIXL 1.5 frees its endpoint object when the peer is removed while UCX keeps closing the
    connection, and the server's death then crashed the client (SIGSEGV, in its next progress call).
    The channel's connection is kept until the server answers or dies, then let go of. The client
    runs in a child process, so that a crash fails this test rather than ending the run."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    (tmp_path / "placement.json").write_text(placement.to_json())
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", SERVER_SCRIPT, str(checkpoint), str(tmp_path / "placement.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        urls = [json.loads(server.stdout.readline())["url"] for server in servers if server.stdout]
        client = subprocess.run(
            [
                sys.executable,
                "-c",
                LEFT_HUNG_SCRIPT,
                str(tmp_path / "placement.json"),
                urls[0],
                str(servers[0].pid),
                str(Path(__file__).parent),
                urls[1],
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "UCX_TLS": "tcp"},  # the pod network's transport, as in the drills
        )
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
            server.wait(timeout=10)
    assert client.returncode == 0, f"the client exited with {client.returncode}:\n{client.stderr[-3000:]}"
    outcome = json.loads(client.stdout.strip().splitlines()[-1])
    assert outcome["kept"] == [1, 2]  # the hung server's connection, kept while it hangs
    assert outcome["after"] == [0, 1]  # let go of once it died


def connect_while_served(server: NixlServerTransport, client_id: str, offer: NixlOffer) -> NixlChannel:
    """``NixlChannel.connect`` to a server transport no loop drives: this thread makes its progress
    meanwhile (the channel's claim completes once the server took it)."""
    handle = server.attach(client_id, offer.body)
    connected: list[NixlChannel | BaseException] = []

    def connect() -> None:
        try:
            connected.append(NixlChannel.connect(handle, "127.0.0.1", 5.0, offer))
        except BaseException as exc:
            connected.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    while thread.is_alive():
        server.wait(1e-3)
    assert isinstance(connected[0], NixlChannel), connected
    return connected[0]


def next_request(server: NixlServerTransport, channel: NixlChannel) -> Request:
    """The next request ``server`` gets (driving ``channel`` meanwhile: its notice leaves)."""
    requests: list[Request] = []

    def polled() -> bool:
        requests.extend(server.poll())
        channel.answered()
        return bool(requests)

    wait_for(polled, 10, "the request")
    return requests[0]


def test_notices_for_a_closed_channel_are_dropped_not_kept() -> None:
    """An answer that comes after its channel closed (the client's deadline passed) is for no open
    channel: it is dropped. Kept, it would sit in the shared agent's mailboxes for as long as the
    process holds that server through another channel (an answer in its notice: up to 16 KiB)."""
    capacity = 64 << 10
    server = NixlServerTransport(TransportOptions(max_clients=3, capacity_bytes=capacity))
    endpoint = client_endpoint()

    def open_channel(client_id: str) -> NixlChannel:
        return connect_while_served(server, client_id, NixlChannel.offer(capacity, server.describe()))

    def echo(request: Request) -> None:
        """Answers ``request`` with its own x."""
        h = request.header
        size = h.num_tokens * h.hidden * 4
        header = SlotHeader(
            FrameKind.RESPONSE, h.dtype, h.layer, h.num_tokens, h.top_k, h.hidden, h.seq, size
        )
        server.respond(request, lambda: header)

    ids, weights = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    keep = open_channel("keep")  # holds the server's agent, as another channel of the process does
    try:
        for i in range(2):
            late = open_channel(f"late-{i}")
            late.send(3, torch.full((2, 64), float(i)), ids, weights)
            request = next_request(server, late)
            late.close()  # (gave up) ...
            echo(request)  # ... and its answer comes all the same, before the server reads the goodbye
            # The server's next notice to this process comes after that answer's.
            keep.send(3, torch.ones(2, 64), ids, weights)
            echo(next_request(server, keep))

            def answered() -> bool:
                server.wait(0)  # (progress: the answer's notice leaves)
                return keep.answered()

            wait_for(answered, 10, "the answer")
            assert torch.equal(keep.receive(time.monotonic() + 10), torch.ones(2, 64))
            # (mailboxes of this server's agent only: other tests' channels may still be open)
            assert [key for key in endpoint._mail if key[0] == keep.peer] == [
                (keep.peer, keep.slot, keep.generation)
            ]
    finally:
        keep.close()
        server.close()


def test_a_slot_whose_client_never_claims_it_is_released_after_the_grace() -> None:
    """The handshake's answer can be lost on the way (the client gave up and let its offer go, with
    nothing to release). A client that says it claims its slot (``claim_ping``) and does not within
    ``attach_grace_s`` loses it. One that claimed keeps it however long it stays idle, and so does
    a client of an earlier version, which does not claim."""
    capacity = 64 << 10
    server = NixlServerTransport(TransportOptions(max_clients=3, capacity_bytes=capacity, attach_grace_s=0.2))
    older = NixlChannel.offer(capacity, server.describe())
    try:
        earlier_version = {key: value for key, value in older.body.items() if key != "claim_ping"}
        server.attach("older", earlier_version)
        claimed = connect_while_served(server, "claimed", NixlChannel.offer(capacity, server.describe()))
        lost = NixlChannel.offer(capacity, server.describe())
        lost_slot = server.attach("lost", lost.body)["slot"]  # last: the others' grace ends before
        lost.close()  # (its answer never came)
        released: list[int] = []

        def reaped() -> bool:
            released.extend(server.reap())
            return bool(released)

        wait_for(reaped, 10, "the unclaimed slot released")
        assert released == [lost_slot]
        assert server.reap() == []  # past every slot's grace now
        states = {row["client_id"]: row["state"] for row in server.slots()}
        assert states == {"older": "IDLE", "claimed": "IDLE", "lost": "OFFLINE"}
        claimed.send(3, torch.ones(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        assert next_request(server, claimed).slot == claimed.slot  # and the claimed slot serves on
        claimed.close()
    finally:
        older.close()
        server.close()


def test_the_free_slot_released_longest_ago_is_handed_out_first() -> None:
    """A slot's former holder can still write into it (its key is not revoked): one that has not
    seen its release yet should find the slot unused for as long as the server can manage."""
    capacity = 64 << 10
    server = NixlServerTransport(TransportOptions(max_clients=3, capacity_bytes=capacity))
    offers = [NixlChannel.offer(capacity, server.describe()) for _ in range(4)]
    try:
        assert [server.attach(f"c{i}", offers[i].body)["slot"] for i in range(3)] == [0, 1, 2]
        assert server.detach(1) and server.detach(0)
        assert server.attach("c3", offers[3].body)["slot"] == 1  # released before slot 0
    finally:
        server.close()
        for offer in offers:
            offer.close()


def test_metadata_is_refused_above_its_bound_in_base64_as_the_message_says() -> None:
    most = encode(bytes(MAX_METADATA_BYTES))
    assert len(decode(most, "offer.agent_metadata")) == MAX_METADATA_BYTES
    with pytest.raises(
        OfferRefused, match=f"offer.agent_metadata: base64 text of at most {MAX_METADATA_BYTES}"
    ):
        decode(encode(bytes(MAX_METADATA_BYTES + 3)), "offer.agent_metadata")


def test_an_answer_that_cannot_be_written_releases_the_slot_and_says_so() -> None:
    """A client whose answer's WRITE failed, though it is still there, is told its slot is released
    (``O``) and fails over at once, rather than at its deadline."""
    capacity = 64 << 10
    server = NixlServerTransport(TransportOptions(max_clients=1, capacity_bytes=capacity))
    try:
        channel = connect_while_served(server, "c", NixlChannel.offer(capacity, server.describe()))
        x = torch.ones(80, 64)  # 20 KiB: a frame that goes by WRITE, not in its notice
        channel.send(3, x, torch.zeros(80, 2, dtype=torch.int32), torch.ones(80, 2))
        requests = [next_request(server, channel)]

        def broken(*args: Any) -> None:
            raise RuntimeError("the previous NIXL write of this slot has not completed")

        server._slots[requests[0].slot].writes.write_frame = broken  # type: ignore[method-assign]
        h = requests[0].header
        kind = FrameKind.RESPONSE
        header = SlotHeader(kind, h.dtype, h.layer, h.num_tokens, h.top_k, h.hidden, h.seq, x.numel() * 4)
        server.respond(requests[0], lambda: header)
        outcome: list[BaseException] = []

        def receive() -> None:
            try:
                channel.receive(time.monotonic() + 30)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=receive)
        started = time.monotonic()
        waiter.start()
        while waiter.is_alive() and time.monotonic() - started < 30:
            server.wait(1e-3)  # (progress: the notice leaves)
        assert len(outcome) == 1 and isinstance(outcome[0], ChannelClosed), outcome
        assert "released this slot" in str(outcome[0]) and time.monotonic() - started < 10
        channel.close()
    finally:
        server.close()
