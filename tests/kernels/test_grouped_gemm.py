"""Each grouped GEMM kernel against its own reference (gate_up+SiLU·mul, down+combine)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, TOLERANCE, make_case

from eaas.kernels.configs import TileConfig
from eaas.kernels.reference import down_combine_reference, gate_up_silu_reference

CONFIGS = [
    TileConfig(block_m=16, block_n=16, block_k=16),
    TileConfig(block_m=32, block_n=32, block_k=64),
]


def _sorted_rows(group_of: torch.Tensor, num_groups: int):  # -> (alignment, entries [N], groups [N], N)
    from eaas.kernels.align import align_entries

    alignment = align_entries(group_of, num_groups)
    num_valid = int(alignment.group_counts.sum().item())
    entries = alignment.sorted_entries[:num_valid].long()
    groups = group_of.reshape(-1)[entries].long()
    return alignment, entries, groups, num_valid


@pytest.mark.parametrize("config", CONFIGS, ids=["16x16x16", "32x32x64"])
@pytest.mark.parametrize("shrink", [True, False], ids=["shrink", "no-shrink"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gate_up_silu(config: TileConfig, shrink: bool, dtype: torch.dtype) -> None:
    from eaas.kernels.grouped_gemm import gate_up_silu

    case = make_case(45, 4, 10, hidden=40, inter=24, num_active=3, dtype=dtype, seed=11)
    alignment, entries, groups, num_valid = _sorted_rows(case.group_of, 10)
    act = gate_up_silu(case.x, case.w13, alignment, 4, config, shrink=shrink)
    assert act.shape == (45 * 4, 24) and act.dtype == dtype
    expected = gate_up_silu_reference(case.x, case.w13, entries, groups, topk=4)
    torch.testing.assert_close(
        act[:num_valid].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("config", CONFIGS, ids=["16x16x16", "32x32x64"])
@pytest.mark.parametrize("shrink", [True, False], ids=["shrink", "no-shrink"])
def test_down_combine(config: TileConfig, shrink: bool) -> None:
    from eaas.kernels.grouped_gemm import down_combine

    case = make_case(45, 4, 10, hidden=40, inter=24, num_active=3, seed=12)
    alignment, entries, groups, num_valid = _sorted_rows(case.group_of, 10)
    act = torch.randn(45 * 4, 24, device=DEVICE)
    out = torch.zeros(45, 40, device=DEVICE)
    down_combine(act, case.w2, case.weight_of, alignment, out, config, shrink=shrink)
    expected = down_combine_reference(act[:num_valid], case.w2, entries, groups, case.weight_of)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_down_combine_accumulates_into_out() -> None:
    """The combine adds to ``out`` (a caller can fold a residual or a shared expert in)."""
    from eaas.kernels.grouped_gemm import down_combine

    case = make_case(8, 2, 3, hidden=32, inter=16, num_active=3, seed=13)
    alignment, entries, groups, num_valid = _sorted_rows(case.group_of, 3)
    act = torch.randn(16, 16, device=DEVICE)
    out = torch.ones(8, 32, device=DEVICE)
    down_combine(act, case.w2, case.weight_of, alignment, out, CONFIGS[0])
    expected = 1 + down_combine_reference(act[:num_valid], case.w2, entries, groups, case.weight_of)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_down_combine_rejects_16_bit_out() -> None:
    from eaas.kernels.grouped_gemm import down_combine

    case = make_case(4, 1, 2, hidden=32, inter=16, num_active=1)
    alignment, *_ = _sorted_rows(case.group_of, 2)
    out = torch.zeros(4, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        down_combine(torch.zeros(4, 16, device=DEVICE), case.w2, case.weight_of, alignment, out, CONFIGS[0])
