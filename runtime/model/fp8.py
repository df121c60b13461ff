"""DeepSeek's block-scaled FP8 weights: ``float8_e4m3fn`` tensors with a float32
``<name>_scale_inv`` of one scale per ``block × block`` tile (128 × 128 in DeepSeek-V3), declared
by ``quantization_config`` in config.json. The stored scale multiplies: w = q * scale_inv.
"""

from __future__ import annotations

import math
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, cols) of a scale block when config.json declares block-scaled FP8, else None."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "mxfp4":  # gpt-oss: the blocks and scales name themselves (see mxfp4.py)
        return None
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not supported (fp8, mxfp4)"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size must be [rows, cols] > 0, got {block!r}"
        )
    return block[0], block[1]


def is_fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether DeepSeek's convention stores ``name`` in FP8: every 2-D projection except the
    embedding, the LM head and the routers."""
    excluded = ("embed_tokens.weight", "lm_head.weight", ".gate.weight", "shared_expert_gate.weight")
    return len(shape) == 2 and name.endswith(".weight") and not name.endswith(excluded)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (FP8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32), one scale per
    tile so that the tile's largest magnitude maps to FP8's largest finite value."""
    rows, cols = weight.shape
    scales = scale_shape((rows, cols), block)
    w = weight.to(torch.float32)
    padded = torch.zeros(scales[0] * block[0], scales[1] * block[1])
    padded[:rows, :cols] = w
    tiles = padded.view(scales[0], block[0], scales[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [N/bn, K/bk]
    scale_inv = amax / FP8_MAX
    quantized = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = quantized.view_as(padded)[:rows, :cols].to(FP8_DTYPE)
    return quantized.contiguous(), scale_inv


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """FP8 weight [N, K] and scale_inv [ceil(N/bn), ceil(K/bk)] -> weight [N, K] in ``dtype``."""
    rows, cols = weight.shape
    expected = scale_shape((rows, cols), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {(rows, cols)} "
            f"in {block[0]}x{block[1]} blocks (expected {expected})"
        )
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
    return (weight.to(torch.float32) * scale[:, :cols]).to(dtype)
