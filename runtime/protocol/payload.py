"""Payload layout of requests and responses, and zero-copy tensor views over a slot.

Request payload (sections start on 64-byte boundaries):

| section | shape | dtype |
|---|---|---|
| hidden states x | [T, H] | header dtype |
| expert ids this server applies | [T, K] | int32, -1 = the expert lives elsewhere |
| router weights | [T, K] | float32 |

Response payload: y [T, H] in the header dtype, the router-weighted sum of this server's experts
for each token; or, when ``status != OK``, a UTF-8 error message of at most ``MAX_MESSAGE_BYTES``.
Legend: T = tokens, K = top-k, H = hidden.

A payload is host memory (a ``memoryview`` of a slot) or device memory (a 1-D uint8 tensor, as
in the GPU transports): the views and writers below take either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaas.runtime.protocol.header import DType, SlotHeader, dtype_code, torch_dtype

ALIGN = 64
MAX_MESSAGE_BYTES = 1024
_ITEM = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class RequestLayout:
    x_offset: int
    ids_offset: int
    weights_offset: int
    total: int  # payload bytes


def request_layout(num_tokens: int, top_k: int, hidden: int, dtype: int) -> RequestLayout:
    """Offsets of the three sections; ``dtype`` is a ``DType`` code (``KeyError`` if unknown)."""
    x_bytes = num_tokens * hidden * _ITEM[DType(dtype)]
    entries = num_tokens * top_k
    ids_offset = _align(x_bytes)
    weights_offset = _align(ids_offset + 4 * entries)
    return RequestLayout(0, ids_offset, weights_offset, weights_offset + 4 * entries)


def response_bytes(num_tokens: int, hidden: int, dtype: int) -> int:
    return num_tokens * hidden * _ITEM[DType(dtype)]


def slot_capacity_bytes(max_tokens: int, max_top_k: int, hidden: int) -> int:
    """Payload bytes a slot needs for the largest request (float32) or response or error message."""
    largest = request_layout(max_tokens, max_top_k, hidden, DType.FLOAT32).total
    return _align(max(largest, MAX_MESSAGE_BYTES))


Payload = memoryview | torch.Tensor  # host bytes, or a 1-D uint8 tensor (device memory)


def payload_size(payload: Payload) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


def staged_x(
    area: torch.Tensor, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The request's x section [T, H] in ``area`` (a request payload as a 1-D uint8 tensor), or None
    when x of that size or device does not fit there (``Channel.staging``)."""
    try:
        num_bytes = num_tokens * hidden * _ITEM[dtype_code(dtype)]
    except ValueError:  # not a dtype the protocol carries: ``send`` names it
        return None
    if area.device != device or num_bytes > area.numel() or num_tokens < 1 or hidden < 1:
        return None
    return area[:num_bytes].view(dtype).view(num_tokens, hidden)


def is_staged(x: torch.Tensor, area: torch.Tensor) -> bool:
    """True when x already lies where ``write_request`` would copy it (``staged_x``'s view)."""
    return x.data_ptr() == area.data_ptr() and x.is_contiguous() and x.device == area.device


def _view(buffer: Payload, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer[offset : offset + count * dtype.itemsize].view(dtype)
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def read_request(payload: Payload, header: SlotHeader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (no copies) of x [T, H], ids [T, K] int32, weights [T, K] float32 in ``payload``.

    The header must have passed ``check_request``; the views alias the slot until it is rewritten.
    """
    t, k, h = header.num_tokens, header.top_k, header.hidden
    layout = request_layout(t, k, h, header.dtype)
    x = _view(payload, torch_dtype(header.dtype), layout.x_offset, t * h).view(t, h)
    ids = _view(payload, torch.int32, layout.ids_offset, t * k).view(t, k)
    weights = _view(payload, torch.float32, layout.weights_offset, t * k).view(t, k)
    return x, ids, weights


def write_request(
    payload: Payload,
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, K] int, -1 = not here
    weights: torch.Tensor,  # [T, K]
    include_x: bool = True,
) -> int:
    """Writes a request payload; returns its size in bytes (``RequestWriter.write``, once).

    With ``include_x=False`` the hidden-states section is left alone (a stream transport sends x
    from the tensor itself, scatter-gather, instead of copying it into the slot first).
    """
    return RequestWriter(payload).write(x, ids, weights, include_x)


class RequestWriter:
    """Writes requests into one payload (a channel's send area), keeping the views of the sections
    made for the last request's shape: a decode step's layers repeat it. Right after a large frame
    went through the caches, making the views cost a request ~50 µs on the 2-core VM, and filling
    them ~10 (docs/benchmarks.md)."""

    def __init__(self, payload: Payload) -> None:
        self.payload = payload
        self._key: tuple[int, int, int, torch.dtype] | None = None
        self._total = 0
        self._x: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None  # [T, K] int32 in the payload
        self._weights: torch.Tensor | None = None  # [T, K] float32 in the payload
        self._host: tuple[np.ndarray, np.ndarray] | None = None  # numpy's views of the same, host memory

    def write(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, include_x: bool = True) -> int:
        """Writes x [T, H], ids [T, K] (int, -1 = not here) and weights [T, K]; returns the payload's
        size in bytes. ``ValueError`` when the request does not fit the payload or the shapes disagree."""
        t, h = x.shape
        k = ids.shape[1]
        key = (t, k, h, x.dtype)
        if key != self._key:
            self._views(key)
        if ids.shape != weights.shape or ids.shape[0] != t:
            shapes = f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)}"
            raise ValueError(f"{shapes}: both [{t}, K] are needed for {t} tokens")
        if t:
            if include_x:
                assert self._x is not None
                self._x.copy_(x)
            if self._host is None or not self._numpy_filled(ids, weights):
                assert self._ids is not None and self._weights is not None
                self._ids.copy_(ids)
                self._weights.copy_(weights)
        return self._total

    def _numpy_filled(self, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        """Fills the host sections through numpy, in a fifth of torch's time; False when a tensor
        has no numpy view (GPU memory, autograd, a dtype numpy lacks: torch copies them). Asking
        first cost more than the fill: ~9 µs right after a large frame, on the 2-core VM."""
        assert self._host is not None
        try:
            ids_values, weights_values = ids.numpy(), weights.numpy()
        except (TypeError, RuntimeError):
            return False
        self._host[0][:] = ids_values
        self._host[1][:] = weights_values
        return True

    def _views(self, key: tuple[int, int, int, torch.dtype]) -> None:
        t, k, h, dtype = key
        layout = request_layout(t, k, h, dtype_code(dtype))
        size = payload_size(self.payload)
        if layout.total > size:
            raise ValueError(
                f"request of {t} tokens needs {layout.total} payload bytes, the slot holds {size}"
            )
        self._key = None  # (until every view is made)
        self._x = _view(self.payload, dtype, layout.x_offset, t * h).view(t, h)
        self._ids = _view(self.payload, torch.int32, layout.ids_offset, t * k).view(t, k)
        self._weights = _view(self.payload, torch.float32, layout.weights_offset, t * k).view(t, k)
        host = _host_bytes(self.payload)
        self._host = None
        if host is not None:
            entries = 4 * t * k
            ids_section = host[layout.ids_offset : layout.ids_offset + entries]
            weights_section = host[layout.weights_offset : layout.weights_offset + entries]
            self._host = (
                ids_section.view(np.int32).reshape(t, k),
                weights_section.view(np.float32).reshape(t, k),
            )
        self._total = layout.total
        self._key = key


def _host_bytes(payload: Payload) -> np.ndarray | None:
    """``payload`` as a numpy byte array when it is host memory."""
    if isinstance(payload, memoryview):
        return np.frombuffer(payload, dtype=np.uint8)
    return payload.numpy() if payload.device.type == "cpu" else None


def write_response(payload: Payload, y: torch.Tensor) -> int:
    """Writes y [T, H] into ``payload``; returns its size in bytes."""
    count = y.numel()
    if count:
        _view(payload, y.dtype, 0, count).copy_(y.reshape(-1))
    return count * y.element_size()


def read_response(payload: Payload, header: SlotHeader) -> torch.Tensor:
    """A view of y [T, H] in ``payload`` (copy it before the slot is reused)."""
    t, h = header.num_tokens, header.hidden
    return _view(payload, torch_dtype(header.dtype), 0, t * h).view(t, h)


def write_message(payload: memoryview, message: str) -> int:
    """Writes an error message (truncated to ``MAX_MESSAGE_BYTES``); returns its size in bytes."""
    data = message.encode("utf-8", errors="replace")[:MAX_MESSAGE_BYTES]
    payload[: len(data)] = data
    return len(data)


def read_message(payload: memoryview, header: SlotHeader) -> str:
    size = min(header.payload_bytes, MAX_MESSAGE_BYTES, len(payload))
    return bytes(payload[:size]).decode("utf-8", errors="replace")
