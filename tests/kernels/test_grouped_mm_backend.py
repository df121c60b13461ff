"""The ``grouped_mm`` backend (torch._grouped_mm; torch's CPU fallback here) equals the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_matches, make_case, reference_fp32

from eaas.kernels import experts_forward

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "num_groups", "num_active"), [(1, 1, 1), (37, 512, 8), (200, 64, 3)])
def test_matches_reference(dtype: torch.dtype, num_tokens: int, num_groups: int, num_active: int) -> None:
    if dtype != torch.bfloat16 and torch.cuda.is_available():
        pytest.skip("on CUDA torch._grouped_mm is tested in bf16 (its fast path)")
    case = make_case(num_tokens, 8, num_groups, hidden=32, inter=16, num_active=num_active, dtype=dtype)
    y = experts_forward(*case.args(), backend="grouped_mm")
    assert y.dtype == dtype
    assert_matches(y, reference_fp32(case), dtype)


@pytest.mark.parametrize("num_tokens", [0, 6])
def test_no_work(num_tokens: int) -> None:
    case = make_case(
        num_tokens, 2, 4, hidden=32, inter=16, num_active=2, dtype=torch.bfloat16, skip_fraction=1.0
    )
    y = experts_forward(*case.args(), backend="grouped_mm")
    assert y.shape == (num_tokens, 32) and torch.count_nonzero(y) == 0


def test_unaligned_sizes_are_a_clear_error() -> None:
    case = make_case(4, 2, 3, hidden=36, inter=20, num_active=2, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"H and I must be multiples of 8 for torch.bfloat16; got H=36, I=20"
    ):
        experts_forward(*case.args(), backend="grouped_mm")
