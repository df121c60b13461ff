"""The ``triton`` backend of ``paged_attention``: attention that walks each row's block table.

Legend as in ``paged_attention.py``: B rows, S queries per row, Hq / Hk query / cached heads,
G = Hq / Hk, Dk / Dv key / value dims, b positions per block, W table width.

One program per (row and query, cached head, block of BLOCK_G of that head's G query heads): it
loads its queries once ``[BLOCK_G, Dk]``, then visits only the blocks its query can see (from the
window's first block to the block of the query's own position), loading each block's keys
``[Dk, b]`` and values ``[b, Dv]`` straight from the pool through the table, with an online
softmax (running max and sum in float32, the sink logit as their start). So a GQA group reads its
cached head once, MLA's N heads share one latent row read (values are the rows' first Dv dims,
no second load from another tensor), and nothing of size L is ever written. Loop bounds come from
the query's position, loaded on the device: the host never waits.

Without a table (the contiguous ``KVCache``), row i's positions are pool[i] and the program walks
it in tiles of BLOCK_T positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaas.kernels.triton_env import require_runnable


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [B, S, Hq, Dk]
    k_ptr,  # [P, Hk, b, Dk]
    v_ptr,  # [P, Hk, b, Dv] (the key pool itself when values are the keys' first Dv dims)
    tables_ptr,  # [B, W] int
    positions_ptr,  # [B, S] int
    sinks_ptr,  # [Hq]
    out_ptr,  # [B, S, Hq, Dv]
    steps,
    group,
    key_dim,
    value_dim,
    block_size,  # b: positions per pool block (with a table), or the positions of a row (without)
    window,
    scale,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vp,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_tb,
    stride_tw,
    stride_pb,
    stride_ps,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    HAS_TABLES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 dots (no TF32)
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row_step = tl.program_id(0)
    row = row_step // steps
    step = row_step % steps
    kv_head = tl.program_id(1)
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    head_mask = g < group
    heads = kv_head * group + g
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, BLOCK_T)
    dk_mask = dk < key_dim
    dv_mask = dv < value_dim

    position = tl.load(positions_ptr + row * stride_pb + step * stride_ps)
    q = tl.load(
        q_ptr + row * stride_qb + step * stride_qs + heads[:, None] * stride_qh + dk[None, :] * stride_qd,
        mask=head_mask[:, None] & dk_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_DK]
    if HAS_SINKS:
        running_max = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        running_sum = tl.full((BLOCK_G,), 1.0, tl.float32)
    else:
        running_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)

    span = block_size if HAS_TABLES else BLOCK_T  # positions per loop step
    # the first position a query sees (branch-free: ``window`` is a runtime value)
    lowest = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    for j in range(lowest // span, position // span + 1):
        if HAS_TABLES:
            block = tl.load(tables_ptr + row * stride_tb + j * stride_tw).to(tl.int64)
            k_base = k_ptr + block * stride_kp + kv_head * stride_kh
            v_base = v_ptr + block * stride_vp + kv_head * stride_vh
            offsets = t
            in_block = t < block_size
        else:
            k_base = k_ptr + row * stride_kp + kv_head * stride_kh
            v_base = v_ptr + row * stride_vp + kv_head * stride_vh
            offsets = j * BLOCK_T + t
            in_block = offsets < block_size
        key_positions = j * span + t
        keys = tl.load(
            k_base + offsets[None, :] * stride_kt + dk[:, None] * stride_kd,
            mask=dk_mask[:, None] & in_block[None, :],
            other=0.0,
        )  # [BLOCK_DK, BLOCK_T]
        if IEEE:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
            scores = tl.dot(q, keys, input_precision="ieee") * scale
        else:
            scores = tl.dot(q, keys) * scale  # [BLOCK_G, BLOCK_T] float32
        visible = (
            in_block & (key_positions <= position) & ((key_positions > position - window) | (window <= 0))
        )
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        values = tl.load(
            v_base + offsets[:, None] * stride_vt + dv[None, :] * stride_vd,
            mask=in_block[:, None] & dv_mask[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_DV]
        if IEEE:
            weighted = tl.dot(probs, values, input_precision="ieee")
        else:
            weighted = tl.dot(probs.to(values.dtype), values)
        acc = acc * rescale[:, None] + weighted
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + row * stride_ob + step * stride_os + heads[:, None] * stride_oh + dv[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dv_mask[None, :],
    )


def tile_sizes(group: int, key_dim: int, value_dim: int, block_size: int, has_tables: bool) -> dict[str, int]:
    """The kernel's tiles (powers of two, at least 16: ``tl.dot``'s smallest on a GPU): up to 32
    of a group's query heads a program, a pool block (or 16 positions without a table) a step."""
    return {
        "BLOCK_G": max(16, min(triton.next_power_of_2(group), 32)),
        "BLOCK_T": max(16, triton.next_power_of_2(block_size)) if has_tables else 16,
        "BLOCK_DK": max(16, triton.next_power_of_2(key_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
    }


def paged_attention_triton(
    q: torch.Tensor,  # [B, S, Hq, Dk]
    key_pool: torch.Tensor,  # [P, Hk, b, Dk]
    value_pool: torch.Tensor | None,  # [P, Hk, b, Dv], or None: values are the keys' first Dv dims
    block_tables: torch.Tensor | None,  # [B, W] int, or None: row i's positions are key_pool[i]
    positions: torch.Tensor,  # [B, S] int
    *,
    scale: float,
    value_dim: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [B, S, Hq, Dv], dtype of q
    require_runnable(q.device, _paged_attention_kernel)
    batch, steps, num_heads, key_dim = q.shape
    kv_heads, block_size = key_pool.shape[1], key_pool.shape[2]
    group = num_heads // kv_heads
    values = key_pool if value_pool is None else value_pool
    out = torch.empty(batch, steps, num_heads, value_dim, dtype=q.dtype, device=q.device)
    tables = block_tables if block_tables is not None else positions  # unused without tables
    tiles = tile_sizes(group, key_dim, value_dim, block_size, block_tables is not None)
    grid = (batch * steps, kv_heads, triton.cdiv(group, tiles["BLOCK_G"]))
    _paged_attention_kernel[grid](
        q,
        key_pool,
        values,
        tables,
        positions,
        sinks if sinks is not None else q,
        out,
        steps,
        group,
        key_dim,
        value_dim,
        block_size,
        window,
        scale,
        *q.stride(),
        *key_pool.stride(),
        *values.stride(),
        *tables.stride(),
        *positions.stride(),
        *out.stride(),
        HAS_TABLES=block_tables is not None,
        HAS_SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        **tiles,
    )
    return out
