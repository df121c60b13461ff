"""Strict validation of requests. Each check raises ``ProtocolError`` naming the field and what is allowed.

Three stages, so a stream transport knows how much it may read before trusting a header:
``check_framing`` (can the frame be read at all), ``check_request`` (does the header fit this
server), ``check_experts`` (do the ids in the payload name experts this server hosts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaas.runtime.protocol.errors import ProtocolError
from eaas.runtime.protocol.header import MAGIC, VERSION, DType, FrameKind, SlotHeader, Status
from eaas.runtime.protocol.payload import request_layout, response_bytes


@dataclass(frozen=True)
class ServerLimits:
    """What one expert server accepts."""

    hidden: int
    num_experts: int
    max_top_k: int
    max_tokens: int  # tokens per request (slot capacity)
    capacity_bytes: int  # payload bytes per slot
    moe_layers: frozenset[int]  # MoE layers of the model
    hosted_layers: frozenset[int]  # layers with at least one expert hosted here


def check_framing(header: SlotHeader, capacity_bytes: int) -> None:
    """Is this a request frame of this protocol whose payload fits the slot?"""
    if header.magic != MAGIC:
        raise ProtocolError(Status.BAD_MAGIC, f"magic: expected {MAGIC:#010x}, got {header.magic:#010x}")
    if header.version != VERSION:
        raise ProtocolError(
            Status.BAD_VERSION, f"version: this server speaks {VERSION}, got {header.version}"
        )
    if header.kind != FrameKind.REQUEST:
        raise ProtocolError(
            Status.BAD_KIND, f"kind: expected {FrameKind.REQUEST.value} (request), got {header.kind}"
        )
    if header.payload_bytes > capacity_bytes:
        raise ProtocolError(
            Status.TOO_LARGE,
            f"payload_bytes: the slot holds {capacity_bytes} bytes, got {header.payload_bytes}",
        )


def check_request(header: SlotHeader, limits: ServerLimits) -> None:
    """Does the header describe a request this server can compute?"""
    check_framing(header, limits.capacity_bytes)
    if header.dtype not in DType._value2member_map_:
        allowed = ", ".join(f"{d.value} ({d.name.lower()})" for d in DType)
        raise ProtocolError(Status.BAD_DTYPE, f"dtype: must be one of {allowed}, got {header.dtype}")
    if header.hidden != limits.hidden:
        raise ProtocolError(
            Status.BAD_SHAPE, f"hidden: this model has hidden size {limits.hidden}, got {header.hidden}"
        )
    if not 1 <= header.top_k <= limits.max_top_k:
        raise ProtocolError(
            Status.BAD_SHAPE, f"top_k: must be in [1, {limits.max_top_k}], got {header.top_k}"
        )
    if header.num_tokens > limits.max_tokens:
        raise ProtocolError(
            Status.TOO_LARGE,
            f"num_tokens: a slot holds at most {limits.max_tokens} tokens, got {header.num_tokens}",
        )
    if header.layer not in limits.moe_layers:
        shown = f"{min(limits.moe_layers)}..{max(limits.moe_layers)}" if limits.moe_layers else "none"
        raise ProtocolError(
            Status.BAD_LAYER, f"layer: MoE layers of this model are {shown}, got {header.layer}"
        )
    if header.layer not in limits.hosted_layers:
        raise ProtocolError(Status.NOT_HOSTED, f"layer: this server hosts no expert of layer {header.layer}")
    expected = request_layout(header.num_tokens, header.top_k, header.hidden, header.dtype).total
    if header.payload_bytes != expected:
        raise ProtocolError(
            Status.SIZE_MISMATCH,
            f"payload_bytes: {header.num_tokens} tokens x top_k {header.top_k} x hidden {header.hidden} "
            f"({DType(header.dtype).name.lower()}) need {expected}, got {header.payload_bytes}",
        )


def check_experts(
    layer: int,
    ids: torch.Tensor,  # [T, K] int32, -1 = not here
    weights: torch.Tensor,  # [T, K] float32
    group_table: torch.Tensor,  # [L, E] int64: group of each hosted (layer, expert), -1 elsewhere
) -> torch.Tensor:  # [T, K] int64 group ids, -1 = skip
    """Maps the request's expert ids to hosted groups; refuses ids that are invalid or not hosted here.

    Works on host or device tensors; on a device it synchronises once (one small copy of flags).
    """
    num_experts = group_table.shape[1]
    ids64 = ids.to(torch.int64)
    bad = (ids64 < -1) | (ids64 >= num_experts)
    active = ids64 >= 0
    groups = torch.where(active & ~bad, group_table[layer][ids64.clamp(0, num_experts - 1)], -1)
    missing = active & ~bad & (groups < 0)
    nonfinite = active & ~torch.isfinite(weights)
    found = torch.stack([bad.any(), missing.any(), nonfinite.any()]).tolist()  # the one synchronisation
    if found[0]:
        value = int(ids64[bad][0])
        raise ProtocolError(Status.BAD_EXPERT, f"expert ids: must be in [-1, {num_experts}), got {value}")
    if found[1]:
        expert = int(ids64[missing][0])
        raise ProtocolError(
            Status.NOT_HOSTED, f"(layer {layer}, expert {expert}) is not hosted on this server"
        )
    if found[2]:
        raise ProtocolError(Status.BAD_VALUE, "router weights: must be finite")
    return groups


def check_response(header: SlotHeader, seq: int, num_tokens: int, hidden: int, dtype: int) -> None:
    """Is this the response to request ``seq``? (Error statuses are the caller's to read.)"""
    if header.magic != MAGIC or header.version != VERSION or header.kind != FrameKind.RESPONSE:
        raise ProtocolError(
            Status.BAD_KIND,
            f"not a version-{VERSION} response "
            f"(magic {header.magic:#x}, version {header.version}, kind {header.kind})",
        )
    if header.seq != seq:
        raise ProtocolError(Status.BAD_KIND, f"seq: expected the response to {seq}, got {header.seq}")
    if header.status != Status.OK:
        return
    if (header.num_tokens, header.hidden, header.dtype) != (num_tokens, hidden, dtype):
        raise ProtocolError(
            Status.BAD_SHAPE,
            f"response shape: expected {num_tokens} x {hidden} of dtype {dtype}, "
            f"got {header.num_tokens} x {header.hidden} of dtype {header.dtype}",
        )
    expected = response_bytes(num_tokens, hidden, dtype)
    if header.payload_bytes != expected:
        raise ProtocolError(
            Status.SIZE_MISMATCH, f"payload_bytes: expected {expected}, got {header.payload_bytes}"
        )
