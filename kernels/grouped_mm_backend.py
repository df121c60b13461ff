"""The ``grouped_mm`` backend: PyTorch's ``torch._grouped_mm`` over all G hosted groups.

The baseline the Triton kernels are measured against. Entries are sorted by group with plain
tensor ops (``argsort``, ``scatter_add_``, ``cumsum``: no host synchronisation); both GEMMs get
``offs`` with one end per group, so empty groups are visited (they are not shrunk away).
``torch._grouped_mm`` has a CUTLASS fast path for bf16 on SM90/SM100; other CUDA devices of
SM80+ and the CPU use torch's fallback (a loop over groups). It needs 16-byte aligned strides,
so H and I must be multiples of 16 bytes / element size (8 for bf16/fp16, 4 for fp32).
"""

from __future__ import annotations

import torch

from eaas.kernels.activation import SILU, Activation, BlockScales
from eaas.kernels.checks import check_expert_biases, check_expert_inputs, check_group_range

BACKEND = "grouped_mm"


def _check_supported(x: torch.Tensor, hidden: int, inter: int) -> None:
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        raise RuntimeError(
            f"the 'grouped_mm' kernel backend needs torch._grouped_mm (PyTorch >= 2.8); this is "
            f"torch {torch.__version__}. Use backend='triton' or backend='torch'."
        )
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        if major < 8:
            raise RuntimeError(
                f"the 'grouped_mm' kernel backend needs a CUDA device of compute capability >= 8.0; "
                f"{torch.cuda.get_device_name(x.device)} is {major}.{minor}. Use backend='triton' or 'torch'."
            )
    elif x.device.type != "cpu":
        raise RuntimeError(f"the 'grouped_mm' kernel backend runs on CUDA or CPU tensors, got {x.device}")
    per_16_bytes = 16 // x.element_size()
    if hidden % per_16_bytes or inter % per_16_bytes:
        raise ValueError(
            f"experts_forward[{BACKEND}]: torch._grouped_mm needs 16-byte aligned rows, so H and I must be "
            f"multiples of {per_16_bytes} for {x.dtype}; got H={hidden}, I={inter}. Use backend='triton'."
        )


def experts_forward_grouped_mm(
    x: torch.Tensor,  # [T, H]
    group_of: torch.Tensor,  # [T, K] int, -1 = skip
    weight_of: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [G, 2I, H]
    w2: torch.Tensor,  # [G, H, I]
    *,
    b13: torch.Tensor | None = None,  # [G, 2I] gate then up biases
    b2: torch.Tensor | None = None,  # [G, H] down biases
    activation: Activation = SILU,
    scales: BlockScales | None = None,
) -> torch.Tensor:  # [T, H], dtype of x
    """``experts_forward`` on two ``torch._grouped_mm`` calls (outputs in x.dtype, combine in fp32);
    biases are added per row by the group each row belongs to."""
    if scales is not None:
        raise ValueError(
            f"experts_forward[{BACKEND}]: block-scaled FP8 weights are not supported by torch._grouped_mm; "
            "use backend='triton' (or 'torch'), or load the experts dequantised"
        )
    shapes = check_expert_inputs(x, group_of, weight_of, w13, w2, BACKEND)
    check_expert_biases(shapes, x, b13, b2, BACKEND)
    _check_supported(x, shapes.hidden, shapes.inter)
    if x.device.type == "cpu":
        check_group_range(group_of, shapes.num_groups, BACKEND)
    num_tokens, topk, num_groups = shapes.num_tokens, shapes.topk, shapes.num_groups
    out = torch.zeros((num_tokens, shapes.hidden), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or topk == 0:
        return out.to(x.dtype)
    flat_group = group_of.reshape(-1).to(torch.int64)  # [R = T*K]
    # -1 sorts last as group G; rows past offs[-1] are ignored by the GEMMs and masked below.
    sort_key = torch.where(flat_group < 0, num_groups, flat_group)
    order = torch.argsort(sort_key, stable=True)  # [R]
    counts = torch.zeros(num_groups + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, sort_key, torch.ones_like(sort_key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_groups], dim=0, dtype=torch.int32)  # [G] group ends
    tokens = order // topk  # [R]
    rows = x.index_select(0, tokens)  # [R, H]
    row_groups = sort_key.index_select(0, order)  # [R], G for skipped entries
    bias_rows = row_groups.clamp(max=num_groups - 1)  # skipped rows are masked below
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [R, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.index_select(0, bias_rows)
    act = activation.apply(gate_up[:, : shapes.inter], gate_up[:, shapes.inter :])  # [R, I]
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [R, H]
    if b2 is not None:
        down = down + b2.index_select(0, bias_rows)
    valid = (row_groups < num_groups)[:, None]  # [R, 1]
    weights = weight_of.reshape(-1).index_select(0, order).to(torch.float32)[:, None]  # [R, 1]
    contribution = torch.where(valid, down.to(torch.float32) * weights, 0.0)  # [R, H]
    out.index_add_(0, tokens, contribution)
    return out.to(x.dtype)
