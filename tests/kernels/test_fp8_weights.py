"""Block-scaled FP8 expert weights (DeepSeek's layout): the Triton kernels dequantise tiles as they
load them and must equal the reference on the dequantised weights (CPU: under the interpreter)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_matches, make_case

from eaas.kernels import experts_forward
from eaas.kernels.activation import BlockScales
from eaas.kernels.reference import experts_forward_reference
from eaas.runtime.model.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks


def _quantize(
    weights: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[G, R, C] -> (fp8 [G, R, C], scales [G, R/rows, C/cols], dequantised float32 [G, R, C])."""
    pairs = [quantize_fp8_blocks(w.float().cpu(), block) for w in weights]
    fp8 = torch.stack([q for q, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    exact = torch.stack([dequantize_fp8_blocks(q, s, block, torch.float32) for q, s in pairs])
    return fp8.to(DEVICE), scales.to(DEVICE), exact.to(DEVICE)


@pytest.mark.parametrize("block", [(16, 16), (8, 32), (128, 128)], ids=["16x16", "8x32", "128x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_equals_the_dequantised_reference(block: tuple[int, int], dtype: torch.dtype) -> None:
    # I = 24 and H = 40 are not multiples of the blocks: partial blocks at every edge.
    case = make_case(29, 4, 6, hidden=40, inter=24, num_active=5, dtype=dtype, seed=8)
    w13, s13, exact13 = _quantize(case.w13, block)
    w2, s2, exact2 = _quantize(case.w2, block)
    scales = BlockScales(s13, s2, block)
    expected = experts_forward_reference(case.x.float(), case.group_of, case.weight_of, exact13, exact2)
    for backend in ("torch", "triton"):
        actual = experts_forward(case.x, case.group_of, case.weight_of, w13, w2, backend, scales=scales)
        assert_matches(actual, expected, dtype)


def test_fp8_arguments_are_checked() -> None:
    case = make_case(4, 2, 3, hidden=32, inter=16, num_active=2)
    w13, s13, _ = _quantize(case.w13, (16, 16))
    w2, s2, _ = _quantize(case.w2, (16, 16))
    x, group_of, weight_of = case.x, case.group_of, case.weight_of
    with pytest.raises(
        ValueError, match=r"scales.w2 must be \[3, 2, 1\] float32 for 16x16 blocks, got \[3, 2\]"
    ):
        experts_forward(
            x, group_of, weight_of, w13, w2, "triton", scales=BlockScales(s13, s2[:, :, 0], (16, 16))
        )
    with pytest.raises(ValueError, match="with block scales, w13 and w2 must be float8_e4m3fn"):
        experts_forward(x, group_of, weight_of, case.w13, w2, "triton", scales=BlockScales(s13, s2, (16, 16)))
    with pytest.raises(ValueError, match=r"grouped_mm\]: block-scaled FP8 weights are not supported"):
        experts_forward(x, group_of, weight_of, w13, w2, "grouped_mm", scales=BlockScales(s13, s2, (16, 16)))
