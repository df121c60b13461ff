"""MXFP4 weights (gpt-oss's published experts): 4-bit e2m1 values, two per byte (low nibble
first), in blocks of 32 sharing one power-of-two scale stored as a biased exponent (e8m0, bias
127). ``<name>_blocks`` [..., N/32, 16] uint8 and ``<name>_scales`` [..., N/32] uint8 together
hold a [..., N] tensor; dequantised here to bfloat16 on load.
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCK = 32  # values per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
            f"(expected blocks [..., G, {BLOCK // 2}] with scales [..., G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack(
        (table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1
    )  # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127)[..., None]  # [..., G, 32]
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., N] (N a multiple of 32) -> (blocks [..., N/32, 16], scales [..., N/32]), each
    block scaled so its largest magnitude fits e2m1's 6.0, values rounded to the nearest code."""
    if values.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {values.shape[-1]}")
    grouped = values.to(torch.float32).unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = grouped.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # scale = 2**exponent
    scaled = grouped / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)
