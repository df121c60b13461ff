"""The ``triton`` backend equals the per-group-loop reference (CPU: through TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, assert_matches, make_case, reference_fp32

from eaas.kernels import experts_forward
from eaas.kernels.configs import TileConfig

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize(
    ("num_tokens", "topk", "num_groups", "num_active"),
    [
        (1, 1, 1, 1),
        (1, 8, 512, 8),
        (7, 2, 8, 3),
        (64, 8, 512, 1),
        (64, 8, 512, 8),
        (300, 4, 64, 6),
    ],
)
def test_matches_reference(num_tokens: int, topk: int, num_groups: int, num_active: int) -> None:
    case = make_case(num_tokens, topk, num_groups, hidden=32, inter=16, num_active=num_active)
    assert_matches(experts_forward(*case.args(), backend="triton"), reference_fp32(case), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes(dtype: torch.dtype) -> None:
    case = make_case(48, 8, 64, hidden=64, inter=48, num_active=5, dtype=dtype, seed=1)
    y = experts_forward(*case.args(), backend="triton")
    assert y.dtype == dtype
    assert_matches(y, reference_fp32(case), dtype)


@pytest.mark.parametrize("num_tokens", [0, 5])
def test_no_work(num_tokens: int) -> None:
    """T = 0 and all entries -1 both give zeros of the right shape."""
    case = make_case(num_tokens, 4, 16, hidden=32, inter=16, num_active=2, skip_fraction=1.0)
    y = experts_forward(*case.args(), backend="triton")
    assert y.shape == (num_tokens, 32)
    assert torch.count_nonzero(y) == 0


def test_every_token_on_one_group() -> None:
    """Many row blocks of one group (count 200 > BLOCK_M) among 256 empty ones."""
    case = make_case(100, 2, 257, hidden=32, inter=16, num_active=1, skip_fraction=0.0, seed=3)
    assert_matches(experts_forward(*case.args(), backend="triton"), reference_fp32(case), torch.float32)


def test_odd_sizes() -> None:
    """H, I not multiples of the tile sizes (masking on every edge), K = 3, G = 5."""
    case = make_case(23, 3, 5, hidden=37, inter=19, num_active=5, dtype=torch.float16, seed=4)
    assert_matches(experts_forward(*case.args(), backend="triton"), reference_fp32(case), torch.float16)


def test_strided_inputs() -> None:
    """Row-padded x, transposed-storage weights, int32 ids and bf16 router weights."""
    case = make_case(20, 4, 6, hidden=32, inter=16, num_active=4, seed=5)
    padded_x = torch.zeros(20, 48, device=DEVICE)
    padded_x[:, :32] = case.x
    x = padded_x[:, :32]  # row stride 48
    w13 = case.w13.transpose(1, 2).contiguous().transpose(1, 2)  # [G, 2I, H] with H-stride 2I
    w2 = case.w2.transpose(1, 2).contiguous().transpose(1, 2)  # [G, H, I] with I-stride H
    weight_of = case.weight_of.to(torch.bfloat16)
    y = experts_forward(x, case.group_of.to(torch.int32), weight_of, w13, w2, backend="triton")
    case.weight_of = weight_of.float()
    assert_matches(y, reference_fp32(case), torch.float32)


def test_shrink_off_equals_on() -> None:
    from eaas.kernels.triton_backend import experts_forward_triton

    case = make_case(40, 8, 48, hidden=32, inter=16, num_active=4, seed=6)
    with_shrink = experts_forward_triton(*case.args(), shrink=True)
    without_shrink = experts_forward_triton(*case.args(), shrink=False)
    assert_matches(without_shrink, reference_fp32(case), torch.float32)
    torch.testing.assert_close(with_shrink, without_shrink, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        TileConfig(block_m=16, block_n=16, block_k=16, programs_per_sm=1),
        TileConfig(block_m=32, block_n=64, block_k=16, programs_per_sm=3),
    ],
    ids=["16x16x16", "32x64x16"],
)
def test_tile_configs(config: TileConfig) -> None:
    from eaas.kernels.triton_backend import experts_forward_triton

    case = make_case(90, 4, 12, hidden=48, inter=40, num_active=3, seed=7)
    y = experts_forward_triton(*case.args(), configs=(config, config))
    assert_matches(y, reference_fp32(case), torch.float32)


def test_group_id_out_of_range_is_an_error_on_cpu() -> None:
    if DEVICE.type != "cpu":
        pytest.skip("range checks need a host sync; the CUDA path skips them")
    case = make_case(4, 2, 3, hidden=32, inter=16, num_active=2)
    case.group_of[0, 0] = 3
    with pytest.raises(ValueError, match=r"group_of values must be -1 \(skip\) or in \[0, G=3\)"):
        experts_forward(*case.args(), backend="triton")


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(0, 40),
    topk=st.integers(1, 8),
    num_groups=st.integers(1, 40),
    data=st.data(),
)
def test_random_routings(num_tokens: int, topk: int, num_groups: int, data: st.DataObject) -> None:
    num_active = data.draw(st.integers(1, min(num_groups, 8)), label="num_active")
    hidden = data.draw(st.sampled_from([16, 24, 33]), label="hidden")
    inter = data.draw(st.sampled_from([16, 20]), label="inter")
    skip = data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="skip_fraction")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    case = make_case(num_tokens, topk, num_groups, hidden, inter, num_active, skip_fraction=skip, seed=seed)
    assert_matches(experts_forward(*case.args(), backend="triton"), reference_fp32(case), torch.float32)
