"""Attention that reads a paged KV cache in place: ``paged_attention`` and its backends.

Legend: B = sequences, S = new tokens per sequence, Hq / Hk = query / cached heads (G = Hq / Hk
query heads share one cached head: GQA; MLA is Hk = 1 with its latent rows as keys), Dk / Dv =
key / value dims, P = blocks in the pool, b = positions per block, W = blocks per row's table.

The cache is a pool of blocks ``[P, Hk, b, D]``; row i's position p lives in block
``block_tables[i, p // b]`` at offset ``p % b``. A query at position p attends to the positions
<= p (with a ``window``, only the last ``window`` of them), with an optional learned ``sinks``
logit per query head that takes its share of the softmax mass (gpt-oss). Softmax in float32.

Backends (by name, ``BACKENDS``):

- ``torch``: online softmax (flash-decoding's running max and sum) over chunks of the rows' block
  columns. Each chunk gathers its blocks (``CHUNK_POSITIONS`` positions a row, into one buffer
  reused from chunk to chunk: a bounded copy, never the whole cache) and brings their heads
  together as ``[B, Hk, C, D]``; GQA by viewing the queries as ``[B, Hk, G * S, D]`` (no
  per-group copy of K/V); no score matrix beyond one chunk's. Runs anywhere; the CPU path.
  Without a table (the contiguous ``KVCache``) the chunks are views: no copy at all.
- ``triton``: one program per (row, query, cached head, block of the G heads) that walks the row's
  blocks through the table (``paged_attention_triton.py``); CUDA, or CPU under
  ``TRITON_INTERPRET=1`` (tests). Imported on first use.

``auto`` picks ``triton`` for CUDA tensors and ``torch`` otherwise. Nothing here reads a tensor's
value on the host: loop bounds come from shapes, masks from ``positions`` on the device.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

CHUNK_POSITIONS = 256  # positions per online-softmax step of the torch backend


class PagedAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor | None,
        block_tables: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        scale: float,
        value_dim: int,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class _Chunks:
    """The rows' cached positions in chunks as ``[B, Hk, C, D]``: with a table, a gather of whole
    blocks into a buffer reused from chunk to chunk, then (with more than one cached head) their
    heads brought together; without a table, a view of the pool (no copy)."""

    def __init__(self, pool: torch.Tensor, block_tables: torch.Tensor | None, chunk_positions: int) -> None:
        self.pool = pool
        self.tables = block_tables
        self.block_size = pool.shape[2]
        if block_tables is None:
            self.step = chunk_positions  # positions per chunk
            self.starts = range(0, self.block_size, chunk_positions)
        else:
            self.step = max(1, chunk_positions // self.block_size)  # blocks per chunk
            self.starts = range(0, block_tables.shape[1], self.step)
        self.buffer: torch.Tensor | None = None

    def first_position(self, start: int) -> int:
        return start if self.tables is None else start * self.block_size

    def __call__(self, start: int) -> torch.Tensor:  # [B, Hk, C, D]
        if self.tables is None:
            return self.pool[:, :, start : start + self.step]
        columns = self.tables[:, start : start + self.step]  # [B, n]
        batch, n = columns.shape
        _, heads, size, dim = self.pool.shape
        out = None
        if n == self.step:  # (index_select along dim 0: torch's fast path; along another, slow)
            if self.buffer is None:
                self.buffer = self.pool.new_empty(batch * n, heads, size, dim)
            out = self.buffer
        blocks = torch.index_select(self.pool, 0, columns.reshape(-1), out=out)  # [B*n, Hk, b, D]
        return blocks.view(batch, n, heads, size, dim).transpose(1, 2).reshape(batch, heads, n * size, dim)


def paged_attention_torch(
    q: torch.Tensor,  # [B, S, Hq, Dk]
    key_pool: torch.Tensor,  # [P, Hk, b, Dk]
    value_pool: torch.Tensor | None,  # [P, Hk, b, Dv], or None: values are the keys' first Dv dims
    block_tables: torch.Tensor | None,  # [B, W] int64, or None: row i's positions are key_pool[i]
    positions: torch.Tensor,  # [B, S] int64 position of each query
    *,
    scale: float,
    value_dim: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [Hq]
    chunk_positions: int = CHUNK_POSITIONS,
) -> torch.Tensor:  # [B, S, Hq, Dv], dtype of q
    """Attention over the paged cache by online softmax over chunks of positions (module doc)."""
    batch, steps, num_heads, key_dim = q.shape
    kv_heads = key_pool.shape[1]
    group = num_heads // kv_heads
    rows = group * steps  # queries per cached head
    # Queries of one cached head side by side: [B, Hk, G * S, Dk], rows ordered (g, s).
    grouped = q.view(batch, steps, kv_heads, group, key_dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, kv_heads, rows, key_dim)
    query_positions = positions[:, None, None, :, None]  # [B, 1, 1, S, 1]
    stats_shape = (batch, kv_heads, group, steps, 1)
    if sinks is None:
        running_max = torch.full(stats_shape, float("-inf"), device=q.device)
        running_sum = torch.zeros(stats_shape, device=q.device)
    else:  # the sink is one more logit with no value: it starts the running max and sum
        running_max = sinks.to(torch.float32).view(1, kv_heads, group, 1, 1).expand(stats_shape).clone()
        running_sum = torch.ones(stats_shape, device=q.device)
    acc = torch.zeros(batch, kv_heads, rows, value_dim, device=q.device)  # float32
    key_chunks = _Chunks(key_pool, block_tables, chunk_positions)
    value_chunks = None if value_pool is None else _Chunks(value_pool, block_tables, chunk_positions)
    for start in key_chunks.starts:
        keys = key_chunks(start)  # [B, Hk, C, Dk]
        values = keys[..., :value_dim] if value_chunks is None else value_chunks(start)  # [B, Hk, C, Dv]
        width = keys.shape[2]
        scores = (grouped @ keys.transpose(-1, -2)).to(torch.float32).mul_(scale)  # [B, Hk, G*S, C]
        scores = scores.view(batch, kv_heads, group, steps, width)
        first = key_chunks.first_position(start)
        key_positions = torch.arange(first, first + width, device=q.device)
        hidden = key_positions > query_positions  # [B, 1, 1, S, C]
        if window:
            hidden |= key_positions <= query_positions - window
        scores.masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows that saw nothing yet
        probs = scores.sub_(safe_max).exp_()
        rescale = torch.exp(running_max - safe_max)
        running_sum = running_sum * rescale + probs.sum(dim=-1, keepdim=True)
        weighted = probs.to(q.dtype).view(batch, kv_heads, rows, width) @ values  # [B, Hk, G*S, Dv]
        acc = acc.mul_(rescale.view(batch, kv_heads, rows, 1)).add_(weighted)
        running_max = new_max
    out = (acc / running_sum.view(batch, kv_heads, rows, 1)).view(batch, kv_heads, group, steps, value_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, value_dim).to(q.dtype)


BACKENDS: dict[str, PagedAttention] = {"torch": paged_attention_torch}
_LAZY_BACKENDS = {"triton": "eaas.kernels.paged_attention_triton:paged_attention_triton"}
BACKEND_NAMES = ("auto", "torch", "triton")


def get_backend(name: str, device: torch.device) -> PagedAttention:
    """The backend ``name`` (one of ``BACKEND_NAMES``); ``auto``: triton on CUDA, else torch."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS and name in _LAZY_BACKENDS:
        module, attribute = _LAZY_BACKENDS[name].split(":")
        BACKENDS[name] = getattr(importlib.import_module(module), attribute)
    if name not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    return BACKENDS[name]


def paged_attention(
    q: torch.Tensor,  # [B, S, Hq, Dk]
    key_pool: torch.Tensor,  # [P, Hk, b, Dk]
    value_pool: torch.Tensor | None,  # [P, Hk, b, Dv], or None: values are the keys' first Dv dims
    block_tables: torch.Tensor | None,  # [B, W] int64, or None: row i's positions are key_pool[i]
    positions: torch.Tensor,  # [B, S] int64
    *,
    scale: float,
    value_dim: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [Hq]
    backend: str = "auto",
) -> torch.Tensor:  # [B, S, Hq, Dv], dtype of q
    """Softmax(q · K^T * scale) · V for each query over the positions it sees (module doc)."""
    if q.shape[2] % key_pool.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of cached heads ({key_pool.shape[1]})"
        )
    fn = get_backend(backend, q.device)
    return fn(
        q,
        key_pool,
        value_pool,
        block_tables,
        positions,
        scale=scale,
        value_dim=value_dim,
        window=window,
        sinks=sinks,
    )
