"""The two grouped GEMMs of the expert FFN, in Triton, on a static (persistent) grid.

Legend: T = tokens, K = entries per token, H = hidden, I = intermediate, G = groups,
R = T*K entry rows (positions in ``Alignment.sorted_entries``).

1. ``gate_up_silu``: ``act[r] = silu(x[t] @ gate[g].T) * (x[t] @ up[g].T)`` for each sorted entry
   row r (token t, group g); gate and up are both accumulated by the same program, so the SiLU·mul
   is the GEMM's epilogue and ``[R, 2I]`` never exists in memory. Optional gate/up biases and the
   clamped SwiGLU of gpt-oss (``activation.py``) are constexpr branches of the same epilogue.
2. ``down_combine``: ``out[t] += weight[t, k] * (act[r] @ down[g].T + b2[g])`` with fp32 atomics,
   so the bias, the router weight and the combine are the epilogue and no ``[T, K, H]``
   intermediate exists.

With ``FP8``, the weights are ``float8_e4m3fn`` with one float32 scale per block (DeepSeek's
layout): each weight tile is dequantised in registers as it is loaded. When the K step lies
inside one scale block (``SCALE_COLS % BLOCK_K == 0``, true for DeepSeek's 128 x 128 blocks and
every tuned tile) that takes one scale per output column; otherwise a scale is gathered per
element, so any tile shape works with any block shape.

Schedule (the Expert-as-a-Service paper, Algorithm 1): the grid is a fixed number of programs
(SMs × occupancy, or the number of tiles if smaller). Program p starts at tile p of the first
group and walks the group list; a group with n tiles consumes n tile numbers, so a program's
cursor drops by n when it moves on, and every ``num_programs``-th tile is the program's. Empty
groups consume none. With ``SHRINK`` the walk is over the compacted active groups and ends after
the last one; without it the walk visits all G groups and reads each one's count from global
memory (the baseline the group-shrink ablation compares against). Tiles inside a group are
numbered output-column-major so programs running at the same time share a weight slice (one HBM
read, the rest from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaas.kernels.activation import SILU, Activation
from eaas.kernels.align import Alignment
from eaas.kernels.configs import TileConfig
from eaas.kernels.triton_env import is_interpreted, multiprocessor_count

INTERPRETER_PROGRAMS = 4  # grid size under TRITON_INTERPRET=1 (programs run one after another)


@triton.jit
def _dequantize_tile(
    w,  # [BK, BN] fp8: columns are weight rows ``rows`` [BN], rows are input dims ``ks`` [BK]
    scale_ptr,  # this group's scales [rows / SCALE_ROWS, in / SCALE_COLS]
    rows,
    ks,
    k_start,
    row_mask,
    k_mask,
    stride_s_row,
    stride_s_col,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w * scale[row block, col block] in fp32."""
    if SCALE_COLS % BLOCK_K == 0:  # the K step lies in one scale block: one scale per column
        k_block = (k_start // SCALE_COLS) * stride_s_col
        scale = tl.load(scale_ptr + (rows // SCALE_ROWS) * stride_s_row + k_block, mask=row_mask)[None, :]
    else:  # blocks narrower than the K step: a scale per element
        scale = tl.load(
            scale_ptr
            + (rows // SCALE_ROWS)[None, :] * stride_s_row
            + (ks // SCALE_COLS)[:, None] * stride_s_col,
            mask=k_mask[:, None] & row_mask[None, :],
        )
    return w.to(tl.float32) * scale


@triton.jit
def _gate_up_silu_tile(
    x_ptr,
    w13_ptr,
    b13_ptr,
    s13_ptr,
    act_ptr,
    sorted_entries_ptr,
    group,
    count,
    start,
    m_block,
    n_block,
    inter,
    hidden,
    topk,
    stride_x_token,
    stride_x_hidden,
    stride_w_group,
    stride_w_row,
    stride_w_hidden,
    stride_act_row,
    stride_act_col,
    stride_b_group,
    stride_s_group,
    stride_s_row,
    stride_s_col,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row_in_group = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = row_in_group < count
    rows = start + row_in_group  # positions in sorted_entries / rows of act
    entries = tl.load(sorted_entries_ptr + rows, mask=row_mask, other=0)
    tokens = (entries // topk).to(tl.int64)  # [BM]
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] in [0, I)
    col_mask = cols < inter
    w_group_ptr = w13_ptr + group.to(tl.int64) * stride_w_group
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, hidden, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_x_token + ks[None, :] * stride_x_hidden,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        b_mask = k_mask[:, None] & col_mask[None, :]
        b_offsets = ks[:, None] * stride_w_hidden + cols[None, :].to(tl.int64) * stride_w_row
        b_gate = tl.load(w_group_ptr + b_offsets, mask=b_mask, other=0.0)  # [BK, BN]
        b_up = tl.load(w_group_ptr + inter * stride_w_row + b_offsets, mask=b_mask, other=0.0)  # [BK, BN]
        if FP8:
            s_group_ptr = s13_ptr + group.to(tl.int64) * stride_s_group
            b_gate = _dequantize_tile(
                b_gate, s_group_ptr, cols, ks, k_start, col_mask, k_mask, stride_s_row, stride_s_col,
                SCALE_ROWS, SCALE_COLS, BLOCK_K,
            ).to(a.dtype)  # fmt: skip
            b_up = _dequantize_tile(
                b_up, s_group_ptr, inter + cols, ks, k_start, col_mask, k_mask, stride_s_row, stride_s_col,
                SCALE_ROWS, SCALE_COLS, BLOCK_K,
            ).to(a.dtype)  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
            b_gate = b_gate.to(tl.float32)
            b_up = b_up.to(tl.float32)
        acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        b_group_ptr = b13_ptr + group.to(tl.int64) * stride_b_group
        acc_gate += tl.load(b_group_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_group_ptr + inter + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up, fp32
    else:  # clamped SwiGLU (gpt-oss)
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    tl.store(
        act_ptr + rows[:, None].to(tl.int64) * stride_act_row + cols[None, :] * stride_act_col,
        act.to(act_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w13_ptr,
    b13_ptr,
    s13_ptr,
    act_ptr,
    sorted_entries_ptr,
    walk_groups_ptr,
    walk_counts_ptr,
    walk_starts_ptr,
    num_active_ptr,
    num_groups,
    num_programs,
    inter,
    hidden,
    topk,
    stride_x_token,
    stride_x_hidden,
    stride_w_group,
    stride_w_row,
    stride_w_hidden,
    stride_act_row,
    stride_act_col,
    stride_b_group,
    stride_s_group,
    stride_s_row,
    stride_s_col,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SHRINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(inter, BLOCK_N)
    walk_length = tl.load(num_active_ptr) if SHRINK else num_groups
    tile = tl.program_id(0)
    for slot in range(0, walk_length):
        count = tl.load(walk_counts_ptr + slot)
        group = tl.load(walk_groups_ptr + slot) if SHRINK else slot
        m_tiles = tl.cdiv(count, BLOCK_M)
        tiles_here = m_tiles * n_tiles
        if tile < tiles_here:
            start = tl.load(walk_starts_ptr + slot)
            while tile < tiles_here:
                n_block = tile // m_tiles
                m_block = tile - n_block * m_tiles
                _gate_up_silu_tile(
                    x_ptr,
                    w13_ptr,
                    b13_ptr,
                    s13_ptr,
                    act_ptr,
                    sorted_entries_ptr,
                    group,
                    count,
                    start,
                    m_block,
                    n_block,
                    inter,
                    hidden,
                    topk,
                    stride_x_token,
                    stride_x_hidden,
                    stride_w_group,
                    stride_w_row,
                    stride_w_hidden,
                    stride_act_row,
                    stride_act_col,
                    stride_b_group,
                    stride_s_group,
                    stride_s_row,
                    stride_s_col,
                    alpha,
                    limit,
                    HAS_BIAS,
                    ACTIVATION,
                    FP8,
                    SCALE_ROWS,
                    SCALE_COLS,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    UPCAST,
                    PRECISION,
                )
                tile += num_programs
        tile -= tiles_here


@triton.jit
def _down_combine_tile(
    act_ptr,
    w2_ptr,
    b2_ptr,
    s2_ptr,
    out_ptr,
    sorted_entries_ptr,
    weight_ptr,
    group,
    count,
    start,
    m_block,
    n_block,
    hidden,
    inter,
    topk,
    stride_act_row,
    stride_act_col,
    stride_w_group,
    stride_w_row,
    stride_w_inter,
    stride_out_token,
    stride_b_group,
    stride_s_group,
    stride_s_row,
    stride_s_col,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row_in_group = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = row_in_group < count
    rows = (start + row_in_group).to(tl.int64)
    entries = tl.load(sorted_entries_ptr + rows, mask=row_mask, other=0)
    tokens = (entries // topk).to(tl.int64)  # [BM]
    router_weight = tl.load(weight_ptr + entries, mask=row_mask, other=0.0).to(tl.float32)  # [BM]
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] in [0, H)
    col_mask = cols < hidden
    w_group_ptr = w2_ptr + group.to(tl.int64) * stride_w_group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, inter, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = ks < inter
        a = tl.load(
            act_ptr + rows[:, None] * stride_act_row + ks[None, :] * stride_act_col,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        b = tl.load(
            w_group_ptr + ks[:, None] * stride_w_inter + cols[None, :].to(tl.int64) * stride_w_row,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BK, BN]
        if FP8:  # w2[g] is [H, I]: the tile's columns are its rows H (cols), its rows I (ks)
            b = _dequantize_tile(
                b, s2_ptr + group.to(tl.int64) * stride_s_group, cols, ks, k_start, col_mask, k_mask,
                stride_s_row, stride_s_col, SCALE_ROWS, SCALE_COLS, BLOCK_K,
            ).to(a.dtype)  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(b2_ptr + group.to(tl.int64) * stride_b_group + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc = acc * router_weight[:, None]
    tl.atomic_add(
        out_ptr + tokens[:, None] * stride_out_token + cols[None, :],
        acc,
        mask=row_mask[:, None] & col_mask[None, :],
        sem="relaxed",
    )


@triton.jit
def _down_combine_kernel(
    act_ptr,
    w2_ptr,
    b2_ptr,
    s2_ptr,
    out_ptr,
    sorted_entries_ptr,
    weight_ptr,
    walk_groups_ptr,
    walk_counts_ptr,
    walk_starts_ptr,
    num_active_ptr,
    num_groups,
    num_programs,
    hidden,
    inter,
    topk,
    stride_act_row,
    stride_act_col,
    stride_w_group,
    stride_w_row,
    stride_w_inter,
    stride_out_token,
    stride_b_group,
    stride_s_group,
    stride_s_row,
    stride_s_col,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SHRINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    walk_length = tl.load(num_active_ptr) if SHRINK else num_groups
    tile = tl.program_id(0)
    for slot in range(0, walk_length):
        count = tl.load(walk_counts_ptr + slot)
        group = tl.load(walk_groups_ptr + slot) if SHRINK else slot
        m_tiles = tl.cdiv(count, BLOCK_M)
        tiles_here = m_tiles * n_tiles
        if tile < tiles_here:
            start = tl.load(walk_starts_ptr + slot)
            while tile < tiles_here:
                n_block = tile // m_tiles
                m_block = tile - n_block * m_tiles
                _down_combine_tile(
                    act_ptr,
                    w2_ptr,
                    b2_ptr,
                    s2_ptr,
                    out_ptr,
                    sorted_entries_ptr,
                    weight_ptr,
                    group,
                    count,
                    start,
                    m_block,
                    n_block,
                    hidden,
                    inter,
                    topk,
                    stride_act_row,
                    stride_act_col,
                    stride_w_group,
                    stride_w_row,
                    stride_w_inter,
                    stride_out_token,
                    stride_b_group,
                    stride_s_group,
                    stride_s_row,
                    stride_s_col,
                    HAS_BIAS,
                    FP8,
                    SCALE_ROWS,
                    SCALE_COLS,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    UPCAST,
                    PRECISION,
                )
                tile += num_programs
        tile -= tiles_here


def _walk_arrays(alignment: Alignment, shrink: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(groups, counts, starts) the persistent walk reads: compacted with shrink, all G without."""
    if shrink:
        return alignment.active_groups, alignment.active_counts, alignment.active_starts
    return alignment.active_groups, alignment.group_counts, alignment.group_starts


def grid_size(num_rows: int, num_groups: int, n_tiles: int, config: TileConfig, device: torch.device) -> int:
    """Programs to launch: min(SMs × occupancy, a bound on the tiles computed from shapes alone).

    At most ``ceil(R / BLOCK_M) + min(G, R)`` row blocks exist (each active group adds at most
    one partial block), times ``n_tiles`` output-column blocks.
    """
    tile_bound = (triton.cdiv(num_rows, config.block_m) + min(num_groups, num_rows)) * n_tiles
    if device.type == "cuda":
        programs = multiprocessor_count(device.index or 0) * config.programs_per_sm
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(programs, tile_bound))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get a full-precision dot (not TF32); 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def gate_up_silu(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [G, 2I, H]: rows [0, I) gate, [I, 2I) up
    alignment: Alignment,
    topk: int,
    config: TileConfig,
    shrink: bool = True,
    b13: torch.Tensor | None = None,  # [G, 2I]
    activation: Activation = SILU,
    scales: torch.Tensor | None = None,  # FP8 w13: [G, 2I / rows, H / cols] float32
    scale_block: tuple[int, int] = (1, 1),
) -> torch.Tensor:  # [T*K, I], dtype of x; rows of sorted positions (only valid rows written)
    """First GEMM with the bias and activation (SiLU·mul by default) as its epilogue, one row per
    sorted entry position."""
    num_groups, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_rows = alignment.sorted_entries.numel()
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(inter, config.block_n)
    programs = grid_size(num_rows, num_groups, n_tiles, config, x.device)
    walk_groups, walk_counts, walk_starts = _walk_arrays(alignment, shrink)
    _gate_up_silu_kernel[(programs,)](
        x,
        w13,
        w13 if b13 is None else b13,  # never read without HAS_BIAS
        w13 if scales is None else scales,  # never read without FP8
        act,
        alignment.sorted_entries,
        walk_groups,
        walk_counts,
        walk_starts,
        alignment.num_active,
        num_groups,
        programs,
        inter,
        hidden,
        topk,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        act.stride(1),
        0 if b13 is None else b13.stride(0),
        *(scales.stride() if scales is not None else (0, 0, 0)),
        activation.alpha,
        activation.limit,
        HAS_BIAS=b13 is not None,
        ACTIVATION=activation.code,
        FP8=scales is not None,
        SCALE_ROWS=scale_block[0],
        SCALE_COLS=scale_block[1],
        SHRINK=shrink,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        UPCAST=_needs_upcast(x.dtype),
        PRECISION=_precision(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return act


def down_combine(
    act: torch.Tensor,  # [T*K, I] from gate_up_silu
    w2: torch.Tensor,  # [G, H, I]
    weight_of: torch.Tensor,  # [T, K] router weights
    alignment: Alignment,
    out: torch.Tensor,  # [T, H] float32, zeroed; accumulated into
    config: TileConfig,
    shrink: bool = True,
    b2: torch.Tensor | None = None,  # [G, H]
    scales: torch.Tensor | None = None,  # FP8 w2: [G, H / rows, I / cols] float32
    scale_block: tuple[int, int] = (1, 1),
) -> torch.Tensor:  # out
    """Second GEMM with the bias, the router weight and the per-token combine as its epilogue."""
    num_groups, hidden, inter = w2.shape
    topk = weight_of.shape[1]
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("down_combine: out must be a contiguous float32 [T, H] tensor (atomic accumulation)")
    weights = weight_of.reshape(-1).contiguous()  # [T*K]
    num_rows = alignment.sorted_entries.numel()
    n_tiles = triton.cdiv(hidden, config.block_n)
    programs = grid_size(num_rows, num_groups, n_tiles, config, act.device)
    walk_groups, walk_counts, walk_starts = _walk_arrays(alignment, shrink)
    _down_combine_kernel[(programs,)](
        act,
        w2,
        w2 if b2 is None else b2,  # never read without HAS_BIAS
        w2 if scales is None else scales,  # never read without FP8
        out,
        alignment.sorted_entries,
        weights,
        walk_groups,
        walk_counts,
        walk_starts,
        alignment.num_active,
        num_groups,
        programs,
        hidden,
        inter,
        topk,
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        0 if b2 is None else b2.stride(0),
        *(scales.stride() if scales is not None else (0, 0, 0)),
        HAS_BIAS=b2 is not None,
        FP8=scales is not None,
        SCALE_ROWS=scale_block[0],
        SCALE_COLS=scale_block[1],
        SHRINK=shrink,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        UPCAST=_needs_upcast(act.dtype),
        PRECISION=_precision(act.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _needs_upcast(dtype: torch.dtype) -> bool:
    # Triton's CPU interpreter computes bf16 arithmetic wrongly; upcasting the loaded tiles to
    # fp32 there is exact. On a GPU bf16 tiles go to the tensor cores as they are.
    return dtype == torch.bfloat16 and is_interpreted(_gate_up_silu_kernel)
