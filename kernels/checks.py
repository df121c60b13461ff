"""Argument checks shared by the fast backends: messages name the argument and what was expected.

Only shapes, dtypes and devices are checked (no host synchronisation, so the checks are safe
inside CUDA-graph capture). Group ids are not range-checked here: that needs the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaas.kernels.activation import BlockScales

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ExpertShapes:
    """Sizes of one ``experts_forward`` call (T, K, H, I, G in the legend)."""

    num_tokens: int  # T
    topk: int  # K
    hidden: int  # H
    inter: int  # I
    num_groups: int  # G


def check_expert_inputs(
    x: torch.Tensor,  # [T, H] float
    group_of: torch.Tensor,  # [T, K] int32/int64
    weight_of: torch.Tensor,  # [T, K] float
    w13: torch.Tensor,  # [G, 2I, H], dtype of x
    w2: torch.Tensor,  # [G, H, I], dtype of x (float8_e4m3fn with ``scales``)
    backend: str,
    scales: BlockScales | None = None,
) -> ExpertShapes:
    """Validate the ``experts_forward`` arguments and return their sizes."""

    def fail(message: str) -> None:
        raise ValueError(f"experts_forward[{backend}]: {message}")

    if x.dim() != 2:
        fail(f"x must be [T, H], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if group_of.dim() != 2 or group_of.shape[0] != num_tokens:
        fail(f"group_of must be [T={num_tokens}, K], got shape {tuple(group_of.shape)}")
    topk = group_of.shape[1]
    if tuple(weight_of.shape) != (num_tokens, topk):
        fail(f"weight_of must be [T, K] = {(num_tokens, topk)}, got shape {tuple(weight_of.shape)}")
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        fail(f"w13 must be [G, 2I, H={hidden}], got shape {tuple(w13.shape)}")
    num_groups, two_inter, _ = w13.shape
    inter = two_inter // 2
    if tuple(w2.shape) != (num_groups, hidden, inter):
        fail(f"w2 must be [G, H, I] = {(num_groups, hidden, inter)}, got shape {tuple(w2.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        fail(f"x.dtype must be one of float32, float16, bfloat16, got {x.dtype}")
    if scales is not None:
        if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
            fail(f"with block scales, w13 and w2 must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
        rows, cols = scales.block
        for name, scale, (r, c) in (
            ("scales.w13", scales.w13, (2 * inter, hidden)),
            ("scales.w2", scales.w2, (hidden, inter)),
        ):
            want = (num_groups, -(-r // rows), -(-c // cols))
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                fail(
                    f"{name} must be {list(want)} float32 for {rows}x{cols} blocks, "
                    f"got {list(scale.shape)} {scale.dtype}"
                )
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        fail(f"w13 and w2 must have the dtype of x ({x.dtype}), got {w13.dtype} and {w2.dtype}")
    if group_of.dtype not in INDEX_DTYPES:
        fail(f"group_of.dtype must be int32 or int64, got {group_of.dtype}")
    if weight_of.dtype not in FLOAT_DTYPES:
        fail(f"weight_of.dtype must be a float dtype, got {weight_of.dtype}")
    devices = {t.device for t in (x, group_of, weight_of, w13, w2)}
    if len(devices) != 1:
        fail(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    return ExpertShapes(num_tokens, topk, hidden, inter, num_groups)


def check_expert_biases(
    shapes: ExpertShapes, x: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None, backend: str
) -> None:
    """``b13`` [G, 2I] and ``b2`` [G, H], in x's dtype and device, when given."""
    for name, bias, shape in (
        ("b13", b13, (shapes.num_groups, 2 * shapes.inter)),
        ("b2", b2, (shapes.num_groups, shapes.hidden)),
    ):
        if bias is None:
            continue
        if tuple(bias.shape) != shape or bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(
                f"experts_forward[{backend}]: {name} must be {list(shape)} {x.dtype} on {x.device}, "
                f"got {list(bias.shape)} {bias.dtype} on {bias.device}"
            )


def check_group_range(group_of: torch.Tensor, num_groups: int, backend: str) -> None:
    """Raise when an id is outside ``[-1, G)``. Reads the values: a host sync on CUDA."""
    if group_of.numel() == 0:
        return
    low, high = int(group_of.min()), int(group_of.max())
    if low < -1 or high >= num_groups:
        raise ValueError(
            f"experts_forward[{backend}]: group_of values must be -1 (skip) or in [0, G={num_groups}), "
            f"got values in [{low}, {high}]"
        )
