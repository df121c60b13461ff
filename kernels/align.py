"""Token alignment and group shrink on the device (Triton; no host synchronisation).

An *entry* is one (token, k) pair of ``group_of[T, K]``, numbered ``t * K + k``. Alignment sorts
the valid entries by group so each group's entries are contiguous, and **group shrink** compacts
the groups that have entries to the front of three small arrays (id, count, start) with a
prefix scan, so the GEMMs walk only active groups and stop after the last one (the
Expert-as-a-Service paper, §4.1).

Tiles never straddle two groups: the GEMMs cut each group's run of entries into ``BLOCK_M`` rows
and mask the tail, which is what padding every group to ``BLOCK_M`` achieves elsewhere, without
materialising pad rows.

One memset and three launches, all sized from shapes alone (CUDA-graph capturable):
1. count: ``counts[g] += 1`` per valid entry (atomics);
2. shrink (one program): exclusive prefix sums of counts → starts; prefix sum of ``count > 0``
   → slot of each active group; writes the compact arrays and ``num_active``;
3. scatter: each valid entry takes the next position of its group's run (atomics).
The order of entries inside one group is not deterministic; results do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN_BLOCK = 256  # entries per program of the count and scatter kernels
SHRINK_BLOCK = 1024  # groups per step of the shrink scan


@dataclass(frozen=True)
class Alignment:
    """Device-side routing metadata. All int32, all on the device of ``group_of``.

    Only the first ``num_active[0]`` elements of the ``active_*`` arrays and the first
    ``group_counts.sum()`` elements of ``sorted_entries`` are meaningful (the rest is unset).
    """

    sorted_entries: torch.Tensor  # [T*K]: entry ids t*K+k, grouped by group (ascending group id)
    group_counts: torch.Tensor  # [G]: valid entries per group
    group_starts: torch.Tensor  # [G]: first position of each group's run in sorted_entries
    active_groups: torch.Tensor  # [G]: compacted ids of groups with entries, ascending
    active_counts: torch.Tensor  # [G]: their counts
    active_starts: torch.Tensor  # [G]: their starts
    num_active: torch.Tensor  # [1]: number of active groups


@triton.jit
def _count_kernel(group_of_ptr, counts_ptr, num_entries, num_groups, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < num_entries
    group = tl.load(group_of_ptr + offsets, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (group >= 0) & (group < num_groups)
    tl.atomic_add(counts_ptr + group, 1, mask=valid, sem="relaxed")


@triton.jit
def _shrink_kernel(
    counts_ptr,
    starts_ptr,
    cursor_ptr,
    active_groups_ptr,
    active_counts_ptr,
    active_starts_ptr,
    num_active_ptr,
    num_groups,
    BLOCK: tl.constexpr,
):
    rows_before = 0  # entries in groups before this chunk
    active_before = 0  # active groups before this chunk
    for chunk in range(0, num_groups, BLOCK):
        group = chunk + tl.arange(0, BLOCK)
        in_range = group < num_groups
        count = tl.load(counts_ptr + group, mask=in_range, other=0)
        start = rows_before + tl.cumsum(count, axis=0) - count
        tl.store(starts_ptr + group, start, mask=in_range)
        tl.store(cursor_ptr + group, start, mask=in_range)
        is_active = (count > 0).to(tl.int32)
        slot = active_before + tl.cumsum(is_active, axis=0) - is_active
        keep = in_range & (count > 0)
        tl.store(active_groups_ptr + slot, group, mask=keep)
        tl.store(active_counts_ptr + slot, count, mask=keep)
        tl.store(active_starts_ptr + slot, start, mask=keep)
        rows_before += tl.sum(count, axis=0)
        active_before += tl.sum(is_active, axis=0)
    tl.store(num_active_ptr, active_before)


@triton.jit
def _scatter_kernel(
    group_of_ptr, cursor_ptr, sorted_entries_ptr, num_entries, num_groups, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < num_entries
    group = tl.load(group_of_ptr + offsets, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (group >= 0) & (group < num_groups)
    position = tl.atomic_add(cursor_ptr + group, 1, mask=valid, sem="relaxed")
    tl.store(sorted_entries_ptr + position, offsets, mask=valid)


def align_entries(group_of: torch.Tensor, num_groups: int) -> Alignment:
    """Sort the entries of ``group_of[T, K]`` (int, ``-1`` = skip) by group and shrink the group list.

    Ids outside ``[0, num_groups)`` are skipped like ``-1`` (range checks need a host sync; the
    backend does them where they are free).
    """
    flat = group_of.reshape(-1).contiguous()  # [T*K]
    num_entries = flat.numel()
    device = flat.device
    meta = torch.zeros(6 * num_groups + 1, dtype=torch.int32, device=device)
    counts, starts, cursor, active_groups, active_counts, active_starts = meta[: 6 * num_groups].view(
        6, num_groups
    )
    num_active = meta[6 * num_groups :]
    sorted_entries = torch.empty(num_entries, dtype=torch.int32, device=device)  # tail never read
    entry_grid = (triton.cdiv(max(num_entries, 1), ALIGN_BLOCK),)
    if num_entries:
        _count_kernel[entry_grid](flat, counts, num_entries, num_groups, BLOCK=ALIGN_BLOCK)
    _shrink_kernel[(1,)](
        counts,
        starts,
        cursor,
        active_groups,
        active_counts,
        active_starts,
        num_active,
        num_groups,
        BLOCK=min(SHRINK_BLOCK, triton.next_power_of_2(max(num_groups, 16))),
    )
    if num_entries:
        _scatter_kernel[entry_grid](flat, cursor, sorted_entries, num_entries, num_groups, BLOCK=ALIGN_BLOCK)
    return Alignment(sorted_entries, counts, starts, active_groups, active_counts, active_starts, num_active)
