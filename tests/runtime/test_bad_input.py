"""Bad input never takes a server down: fuzzed headers, truncated frames and wrong sizes over real shm
and real sockets get an error status or a clean disconnect, and the server keeps serving."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from datapath_helpers import PROMPTS, generate_concurrently, in_process_servers, urls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaas.runtime.client.connection import http_json
from eaas.runtime.model import CheckpointReader, load_reference
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.protocol import (
    HEADER_OFFSET,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_OFFSET,
    VERSION,
    DType,
    FrameKind,
    SlotHeader,
    SlotState,
    Status,
    request_layout,
)
from eaas.runtime.server import ExpertServer
from eaas.runtime.transport import liveness
from eaas.runtime.transport.doorbell import Doorbell
from eaas.runtime.transport.shm_segment import SHM_DIR, Segment
from eaas.runtime.transport.tcp_socket import HELLO, HELLO_MAGIC

FUZZ_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints: dict[str, Path]) -> Iterator[tuple[Path, Placement, dict[int, ExpertServer]]]:
    checkpoint = tiny_checkpoints["qwen3_moe"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    with in_process_servers(checkpoint, placement, max_tokens=8) as servers:
        yield checkpoint, placement, servers


def headers() -> st.SearchStrategy[SlotHeader]:
    """Mostly plausible request headers with one or more fields off."""
    return st.builds(
        SlotHeader,
        kind=st.sampled_from([FrameKind.REQUEST, FrameKind.REQUEST, FrameKind.RESPONSE, 0, 255]),
        dtype=st.sampled_from([DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16, 0, 4, 255]),
        layer=st.sampled_from([0, 1, 2, 3, 2**32 - 1]),
        num_tokens=st.sampled_from([0, 1, 3, 8, 9, 2**31]),
        top_k=st.sampled_from([0, 1, 4, 5, 2**16 - 1]),
        hidden=st.sampled_from([64, 63, 0, 2**32 - 1]),
        seq=st.integers(0, 2**64 - 1),
        payload_bytes=st.one_of(st.integers(0, 4096), st.sampled_from([2**63, 2**32])),
        magic=st.sampled_from([MAGIC, MAGIC, 0x12345678]),
        version=st.sampled_from([VERSION, VERSION, 0, 7]),
        status=st.integers(0, 2**16 - 1),
        reserved=st.sampled_from([0, 0, 1, 2**32 - 1]),
    )


def consistent(header: SlotHeader) -> SlotHeader:
    """The same header with payload_bytes matching its shape (so deeper checks are exercised)."""
    if header.dtype in (1, 2, 3) and header.num_tokens <= 64 and header.top_k <= 64:
        size = request_layout(header.num_tokens, header.top_k, header.hidden % 4096, header.dtype).total
        return header._replace(payload_bytes=size)
    return header


def assert_still_serving(cluster: tuple[Path, Placement, dict[int, ExpertServer]]) -> None:
    checkpoint, placement, servers = cluster
    for server in servers.values():
        assert server.is_healthy()
    [(tokens, _)] = generate_concurrently(checkpoint, placement, urls(servers), ["shm"], PROMPTS[:2], 2)
    assert tokens == load_reference(checkpoint).generate(PROMPTS[:2], 2)[0]


@FUZZ_SETTINGS
@given(header=headers(), make_consistent=st.booleans(), payload_seed=st.integers(0, 2**16))
def test_fuzzed_shm_requests_get_an_answer(
    cluster: tuple[Path, Placement, dict[int, ExpertServer]],
    header: SlotHeader,
    make_consistent: bool,
    payload_seed: int,
) -> None:
    server = cluster[2][0]
    if make_consistent:
        header = consistent(header)
    handle = http_json("POST", f"{server.url}/v1/slots", {"client_id": "fuzzer", "transport": "shm"})
    segment = Segment.attach(handle["segment"])
    liveness.hold(segment.fd, segment.slot_offset(handle["slot"]))  # as every shm client does
    try:
        slot = segment.slot(handle["slot"])
        payload = slot[PAYLOAD_OFFSET:]
        size = min(len(payload), header.payload_bytes, 1 << 16)
        noise = torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(payload_seed)
        )
        payload[:size] = noise.numpy().tobytes()
        header.pack_into(slot, HEADER_OFFSET)
        segment.flags[handle["slot"]] = SlotState.REQUEST_READY
        bell = Doorbell.open(SHM_DIR / handle["bell"])
        bell.ring()
        bell.close()
        deadline = time.monotonic() + 10
        while segment.flags[handle["slot"]] != SlotState.RESPONSE_READY:
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.001)
        response = SlotHeader.unpack_from(slot, HEADER_OFFSET)
        assert response.kind == FrameKind.RESPONSE and response.seq == header.seq
        if response.status == Status.OK:
            assert header.magic == MAGIC and header.version == VERSION and header.kind == FrameKind.REQUEST
        else:
            assert 0 < response.payload_bytes <= 1024  # an error message
        del slot, payload
    finally:
        # Release, then detach, as a client does: closing the segment first drops the liveness
        # lock, and the server's reaper may free the slot before the DELETE reaches it (a 404).
        http_json("DELETE", f"{server.url}/v1/slots/shm/{handle['slot']}")
        segment.close()


def tcp_connect(server: ExpertServer) -> socket.socket:
    handle = http_json("POST", f"{server.url}/v1/slots", {"client_id": "fuzzer", "transport": "tcp"})
    sock = socket.create_connection(("127.0.0.1", handle["port"]), timeout=10)
    sock.sendall(HELLO.pack(HELLO_MAGIC, handle["slot"], handle["token"]))
    return sock


def read_response(sock: socket.socket) -> SlotHeader | None:
    """The response header, or None when the server closed the connection."""
    data = b""
    while len(data) < HEADER_SIZE:
        chunk = sock.recv(HEADER_SIZE - len(data))
        if not chunk:
            return None
        data += chunk
    header = SlotHeader.unpack_from(data)
    remaining = header.payload_bytes
    while remaining > 0:
        chunk = sock.recv(min(remaining, 1 << 16))
        if not chunk:
            return None
        remaining -= len(chunk)
    return header


@FUZZ_SETTINGS
@given(header=headers(), make_consistent=st.booleans())
def test_fuzzed_tcp_frames_get_an_error_or_a_clean_disconnect(
    cluster: tuple[Path, Placement, dict[int, ExpertServer]], header: SlotHeader, make_consistent: bool
) -> None:
    server = cluster[2][1]
    if make_consistent:
        header = consistent(header)
    with tcp_connect(server) as sock:
        sock.sendall(header.pack())
        if header.payload_bytes <= server.limits.capacity_bytes:
            sock.sendall(bytes(header.payload_bytes))
        response = read_response(sock)
    if response is not None:
        assert response.kind == FrameKind.RESPONSE and response.seq == header.seq
        if response.status == Status.OK:
            assert header.magic == MAGIC and header.version == VERSION


@pytest.mark.parametrize(
    "garbage",
    [
        b"",  # connect and leave
        b"EA",  # half a header
        SlotHeader(FrameKind.REQUEST, 1, 1, 2, 4, 64, 1, request_layout(2, 4, 64, 1).total).pack()
        + bytes(100),
        b"GET / HTTP/1.1\r\n\r\n" + bytes(64),  # not our protocol at all
    ],
    ids=["nothing", "half-header", "truncated-payload", "http"],
)
def test_truncated_and_foreign_frames_are_dropped(
    cluster: tuple[Path, Placement, dict[int, ExpertServer]], garbage: bytes
) -> None:
    server = cluster[2][0]
    with tcp_connect(server) as sock:
        sock.sendall(garbage)
    assert_still_serving(cluster)


def test_a_wrong_hello_token_is_disconnected(
    cluster: tuple[Path, Placement, dict[int, ExpertServer]],
) -> None:
    server = cluster[2][0]
    handle = http_json("POST", f"{server.url}/v1/slots", {"client_id": "intruder", "transport": "tcp"})
    with socket.create_connection(("127.0.0.1", handle["port"]), timeout=10) as sock:
        sock.sendall(struct.pack("<IIQ", HELLO_MAGIC, handle["slot"], handle["token"] ^ 1))
        assert sock.recv(1) == b""  # closed without a word
    http_json("DELETE", f"{server.url}/v1/slots/tcp/{handle['slot']}")


def test_servers_still_serve_after_all_of_that(
    cluster: tuple[Path, Placement, dict[int, ExpertServer]],
) -> None:
    assert_still_serving(cluster)
    refused = sum(
        sample.value
        for server in cluster[2].values()
        for metric in server.metrics.requests.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["status"] != "OK"
    )
    assert refused > 0  # the fuzzers did reach the validation
