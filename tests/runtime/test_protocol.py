"""The slot protocol: header layout, payload layout, strict validation (with fuzzed headers)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaas.runtime.protocol import (
    HEADER_OFFSET,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_OFFSET,
    VERSION,
    DType,
    FrameKind,
    ProtocolError,
    RequestWriter,
    ServerLimits,
    SlotHeader,
    SlotState,
    Status,
    check_experts,
    check_request,
    check_response,
    is_staged,
    read_request,
    read_response,
    request_layout,
    slot_capacity_bytes,
    slot_stride,
    staged_x,
    write_request,
    write_response,
)

LIMITS = ServerLimits(
    hidden=64,
    num_experts=8,
    max_top_k=2,
    max_tokens=16,
    capacity_bytes=slot_capacity_bytes(16, 2, 64),
    moe_layers=frozenset({1, 2}),
    hosted_layers=frozenset({1}),
)


def request_header(num_tokens: int = 3, top_k: int = 2, layer: int = 1, **changes: int) -> SlotHeader:
    size = request_layout(num_tokens, top_k, 64, DType.FLOAT32).total
    fields = {
        "kind": FrameKind.REQUEST, "dtype": DType.FLOAT32, "layer": layer, "num_tokens": num_tokens,
        "top_k": top_k, "hidden": 64, "seq": 7, "payload_bytes": size,
    }  # fmt: skip
    fields.update(changes)
    return SlotHeader(**fields)


def test_header_is_48_little_endian_bytes_with_magic_first() -> None:
    header = request_header()
    raw = header.pack()
    assert len(raw) == HEADER_SIZE == 48
    assert raw[:4] == b"EAAS" and struct.unpack_from("<I", raw)[0] == MAGIC
    assert struct.unpack_from("<H", raw, 4)[0] == VERSION
    assert SlotHeader.unpack_from(raw) == header
    assert HEADER_OFFSET + HEADER_SIZE == PAYLOAD_OFFSET  # header and payload are contiguous


@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_any_48_bytes_unpack_and_repack_identically(raw: bytes) -> None:
    header = SlotHeader.unpack_from(raw)
    repacked = header.pack()
    assert repacked[:28] == raw[:28] and repacked[32:] == raw[32:]  # bytes 28..32 are padding


def test_slot_states_are_the_design_values() -> None:
    assert [s.value for s in SlotState] == [0, 1, 2, 3, 4]
    assert [s.name for s in SlotState] == ["IDLE", "REQUEST_READY", "RESPONSE_READY", "OFFLINE", "SERVING"]
    assert slot_stride(1) % 4096 == 0 and slot_stride(4096 - PAYLOAD_OFFSET) == 4096


@pytest.mark.parametrize("as_tensor", [False, True], ids=["memoryview", "uint8 tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_request_and_response_payloads_round_trip(dtype: torch.dtype, as_tensor: bool) -> None:
    # The GPU transports hand the same functions a uint8 tensor (device memory) instead of bytes.
    raw = bytearray(LIMITS.capacity_bytes)
    buffer: memoryview | torch.Tensor = (
        torch.zeros(LIMITS.capacity_bytes, dtype=torch.uint8) if as_tensor else memoryview(raw)
    )
    x = torch.randn(5, 64).to(dtype)
    ids = torch.tensor([[0, -1], [3, 4], [-1, 7], [1, 2], [5, -1]])
    weights = torch.rand(5, 2)
    size = write_request(buffer, x, ids, weights)
    header = request_header(
        num_tokens=5, dtype=int(DType[str(dtype).removeprefix("torch.").upper()]), payload_bytes=size
    )
    got_x, got_ids, got_weights = read_request(buffer, header)
    assert (
        torch.equal(got_x, x)
        and torch.equal(got_ids, ids.to(torch.int32))
        and torch.equal(got_weights, weights)
    )
    y = torch.randn(5, 64).to(dtype)
    assert write_response(buffer, y) == y.numel() * y.element_size()
    assert torch.equal(read_response(buffer, header), y)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["memoryview", "uint8 tensor"])
@pytest.mark.parametrize(
    ("ids_dtype", "weights_dtype", "grad"),
    [
        (torch.int64, torch.float32, False),  # the client's usual: numpy fills ids and weights
        (torch.int32, torch.float64, False),
        (torch.int64, torch.bfloat16, False),  # numpy has no bf16: torch copies
        (torch.int64, torch.float32, True),  # weights still in an autograd graph: torch copies
    ],
)
def test_ids_and_weights_of_any_dtype_are_written_as_int32_and_float32(
    ids_dtype: torch.dtype, weights_dtype: torch.dtype, grad: bool, as_tensor: bool
) -> None:
    buffer: memoryview | torch.Tensor = (
        torch.full((LIMITS.capacity_bytes,), 0xAB, dtype=torch.uint8)
        if as_tensor
        else memoryview(bytearray(b"\xab" * LIMITS.capacity_bytes))
    )
    x = torch.randn(4, 64)
    ids = torch.tensor([[0, -1], [3, 4], [-1, 7], [1, 2]], dtype=ids_dtype)
    weights = torch.rand(4, 2).to(weights_dtype).requires_grad_(grad)
    size = write_request(buffer, x, ids, weights)
    _, got_ids, got_weights = read_request(buffer, request_header(num_tokens=4, payload_bytes=size))
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids, ids.to(torch.int32))
    assert torch.equal(got_weights, weights.detach().to(torch.float32))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["memoryview", "uint8 tensor"])
def test_a_request_writer_rewrites_its_views_only_for_a_new_shape(as_tensor: bool) -> None:
    # A channel keeps one writer for its send area: the views of the last shape are reused.
    buffer: memoryview | torch.Tensor = (
        torch.zeros(LIMITS.capacity_bytes, dtype=torch.uint8)
        if as_tensor
        else memoryview(bytearray(LIMITS.capacity_bytes))
    )
    writer = RequestWriter(buffer)
    shapes = [(5, 2, torch.float32), (5, 2, torch.float32), (3, 1, torch.bfloat16), (5, 2, torch.float32)]
    made = []
    for step, (tokens, top_k, dtype) in enumerate(shapes):
        x = torch.randn(tokens, 64).to(dtype)
        ids = torch.randint(-1, 8, (tokens, top_k))
        weights = torch.rand(tokens, top_k)
        size = writer.write(x, ids, weights)
        made.append(writer._x)
        header = request_header(
            num_tokens=tokens, top_k=top_k, dtype=int(DType[str(dtype).removeprefix("torch.").upper()]),
            payload_bytes=size, seq=step,
        )  # fmt: skip
        got_x, got_ids, got_weights = read_request(buffer, header)
        assert torch.equal(got_x, x) and torch.equal(got_ids, ids.to(torch.int32))
        assert torch.equal(got_weights, weights)
    assert made[1] is made[0] and made[2] is not made[1] and made[3] is not made[2]


def test_a_request_writer_refuses_what_does_not_fit_or_disagrees() -> None:
    writer = RequestWriter(memoryview(bytearray(LIMITS.capacity_bytes)))
    too_many = LIMITS.capacity_bytes // (64 * 4) + 1
    with pytest.raises(ValueError, match=f"request of {too_many} tokens needs .* the slot holds"):
        writer.write(
            torch.zeros(too_many, 64), torch.zeros(too_many, 2, dtype=torch.int64), torch.ones(too_many, 2)
        )
    x = torch.randn(4, 64)
    writer.write(x, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2))  # views for 4 tokens, top-2
    # ids of one token would broadcast over four in a numpy assignment: refused instead
    with pytest.raises(ValueError, match=r"ids \(1, 2\) and weights \(4, 2\): both \[4, K\]"):
        writer.write(x, torch.zeros(1, 2, dtype=torch.int64), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"ids \(4, 2\) and weights \(4, 1\)"):
        writer.write(x, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 1))


def test_staged_x_is_the_x_section_and_send_recognises_it() -> None:
    area = torch.zeros(LIMITS.capacity_bytes, dtype=torch.uint8)
    cpu = torch.device("cpu")
    staged = staged_x(area, 5, 64, torch.bfloat16, cpu)
    assert staged is not None and staged.shape == (5, 64) and staged.data_ptr() == area.data_ptr()
    assert is_staged(staged, area) and not is_staged(staged.clone(), area)
    assert not is_staged(staged_x(area, 8, 64, torch.float32, cpu).t(), area)  # type: ignore[union-attr]
    assert staged_x(area, LIMITS.capacity_bytes // 128 + 1, 64, torch.float32, cpu) is None  # too big
    assert staged_x(area, 5, 64, torch.int64, cpu) is None  # not a dtype the protocol carries
    assert staged_x(area, 0, 64, torch.float32, cpu) is None
    x = torch.randn(5, 64).to(torch.bfloat16)
    staged.copy_(x)
    ids, weights = torch.zeros(5, 2, dtype=torch.int64), torch.ones(5, 2)
    size = write_request(area, staged, ids, weights, include_x=False)
    got_x, _, _ = read_request(area, request_header(num_tokens=5, dtype=DType.BFLOAT16, payload_bytes=size))
    assert torch.equal(got_x, x)


@pytest.mark.parametrize(
    ("changes", "status", "field"),
    [
        ({"magic": 0xDEADBEEF}, Status.BAD_MAGIC, "magic"),
        ({"version": 2}, Status.BAD_VERSION, "version"),
        ({"kind": FrameKind.RESPONSE}, Status.BAD_KIND, "kind"),
        ({"dtype": 9}, Status.BAD_DTYPE, "dtype"),
        ({"hidden": 128}, Status.BAD_SHAPE, "hidden"),
        ({"top_k": 3}, Status.BAD_SHAPE, "top_k"),
        ({"top_k": 0}, Status.BAD_SHAPE, "top_k"),
        ({"num_tokens": 17, "payload_bytes": 100}, Status.TOO_LARGE, "num_tokens"),
        ({"payload_bytes": 1 << 40}, Status.TOO_LARGE, "payload_bytes"),
        ({"layer": 0}, Status.BAD_LAYER, "layer"),
        ({"layer": 2}, Status.NOT_HOSTED, "layer"),
        ({"payload_bytes": 12}, Status.SIZE_MISMATCH, "payload_bytes"),
    ],
)
def test_bad_headers_are_refused_with_a_status_naming_the_field(
    changes: dict, status: Status, field: str
) -> None:
    with pytest.raises(ProtocolError) as error:
        check_request(request_header(**changes), LIMITS)
    assert error.value.status == status
    assert error.value.message.startswith(field), error.value.message


def test_a_good_header_passes() -> None:
    check_request(request_header(num_tokens=16), LIMITS)
    check_request(request_header(num_tokens=0), LIMITS)


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        SlotHeader,
        kind=st.integers(0, 255),
        dtype=st.integers(0, 255),
        layer=st.integers(0, 2**32 - 1),
        num_tokens=st.integers(0, 2**32 - 1),
        top_k=st.integers(0, 2**16 - 1),
        hidden=st.sampled_from([0, 63, 64, 65, 2**32 - 1]),
        seq=st.integers(0, 2**64 - 1),
        payload_bytes=st.integers(0, 2**64 - 1),
        status=st.integers(0, 2**16 - 1),
        magic=st.sampled_from([MAGIC, 0, 2**32 - 1]),
        version=st.sampled_from([VERSION, 0, 2, 2**16 - 1]),
        reserved=st.integers(0, 2**32 - 1),
    )
)
def test_fuzzed_headers_either_pass_or_raise_protocol_error(header: SlotHeader) -> None:
    try:
        check_request(header, LIMITS)
    except ProtocolError as error:
        assert error.status != Status.OK and error.message
        return
    # Accepted: then the payload described is exactly what fits.
    assert header.payload_bytes == request_layout(header.num_tokens, header.top_k, 64, header.dtype).total
    assert header.payload_bytes <= LIMITS.capacity_bytes


def test_expert_ids_map_to_groups_and_unknown_or_foreign_ids_are_refused() -> None:
    table = torch.full((3, 8), -1, dtype=torch.int64)
    table[1, 2], table[1, 5] = 0, 1
    weights = torch.ones(2, 2)
    groups = check_experts(1, torch.tensor([[2, -1], [5, 2]], dtype=torch.int32), weights, table)
    assert groups.tolist() == [[0, -1], [1, 0]]
    with pytest.raises(ProtocolError, match=r"\(layer 1, expert 3\) is not hosted") as error:
        check_experts(1, torch.tensor([[2, 3], [5, 2]], dtype=torch.int32), weights, table)
    assert error.value.status == Status.NOT_HOSTED
    for bad in (8, -2):
        with pytest.raises(ProtocolError) as error:
            check_experts(1, torch.tensor([[2, bad], [5, 2]], dtype=torch.int32), weights, table)
        assert error.value.status == Status.BAD_EXPERT
    with pytest.raises(ProtocolError) as error:
        check_experts(
            1, torch.tensor([[2, -1]], dtype=torch.int32), torch.tensor([[float("nan"), 1.0]]), table
        )
    assert error.value.status == Status.BAD_VALUE


def test_responses_are_matched_by_sequence_number_and_shape() -> None:
    ok = SlotHeader(FrameKind.RESPONSE, DType.FLOAT32, 1, 3, 2, 64, seq=9, payload_bytes=3 * 64 * 4)
    check_response(ok, 9, 3, 64, DType.FLOAT32)
    with pytest.raises(ProtocolError, match="seq"):
        check_response(ok, 10, 3, 64, DType.FLOAT32)  # a late or duplicated answer
    with pytest.raises(ProtocolError, match="shape"):
        check_response(ok, 9, 4, 64, DType.FLOAT32)
    error = SlotHeader(FrameKind.RESPONSE, 0, 1, 0, 0, 64, seq=9, payload_bytes=10, status=Status.NOT_HOSTED)
    check_response(error, 9, 3, 64, DType.FLOAT32)  # error statuses pass through to the caller
