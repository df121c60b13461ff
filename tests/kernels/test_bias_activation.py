"""Expert biases and the clamped SwiGLU (gpt-oss) in every backend, against the reference and
against the definition written out per (token, entry)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_matches, make_case

from eaas.kernels import experts_forward
from eaas.kernels.activation import Activation
from eaas.kernels.reference import experts_forward_reference

CLAMPED = Activation("clamped_swiglu", alpha=1.702, limit=0.7)  # a low limit so the clamps bite


def _biases(
    num_groups: int, hidden: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    b13 = torch.randn(num_groups, 2 * inter, generator=generator).to(dtype).to(DEVICE)
    b2 = torch.randn(num_groups, hidden, generator=generator).to(dtype).to(DEVICE)
    return b13, b2


def test_reference_matches_the_definition_with_biases_and_clamp() -> None:
    case = make_case(9, 3, 5, hidden=12, inter=7, num_active=4, device=torch.device("cpu"), seed=21)
    case.x *= 3  # large activations, so both clamps are exercised
    b13, b2 = (b.cpu() for b in _biases(5, 12, 7, torch.float32))
    expected = torch.zeros(9, 12)
    for token in range(9):
        for k in range(3):
            group = int(case.group_of[token, k])
            if group < 0:
                continue
            gate = case.x[token] @ case.w13[group, :7].T + b13[group, :7]
            up = case.x[token] @ case.w13[group, 7:].T + b13[group, 7:]
            gate, up = gate.clamp(max=0.7), up.clamp(-0.7, 0.7)
            hidden = gate * torch.sigmoid(1.702 * gate) * (up + 1)
            expected[token] += case.weight_of[token, k] * (hidden @ case.w2[group].T + b2[group])
    actual = experts_forward_reference(*case.args(), b13=b13, b2=b2, activation=CLAMPED)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    gate_all = case.x @ case.w13[case.group_of.clamp(min=0)[:, 0], :7].transpose(-1, -2)
    assert (gate_all > 0.7).any(), "the case must reach the clamp"


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("activation", [Activation(), CLAMPED], ids=["silu", "clamped"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_match_the_reference(
    backend: str, activation: Activation, with_bias: bool, dtype: torch.dtype
) -> None:
    case = make_case(37, 4, 12, hidden=32, inter=16, num_active=7, dtype=dtype, seed=3)
    b13, b2 = _biases(12, 32, 16, dtype) if with_bias else (None, None)
    b13_32, b2_32 = (None if b is None else b.float() for b in (b13, b2))
    expected = experts_forward_reference(
        case.x.float(), case.group_of, case.weight_of, case.w13.float(), case.w2.float(),
        b13=b13_32, b2=b2_32, activation=activation,
    )  # fmt: skip
    actual = experts_forward(*case.args(), backend=backend, b13=b13, b2=b2, activation=activation)
    assert_matches(actual, expected, dtype)


def test_bad_biases_and_activations_are_named() -> None:
    case = make_case(4, 2, 3, hidden=8, inter=4, num_active=2)
    b13, b2 = _biases(3, 8, 4, torch.float32)
    with pytest.raises(ValueError, match=r"experts_forward\[triton\]: b13 must be \[3, 8\]"):
        experts_forward(*case.args(), backend="triton", b13=b13[:, :4])
    with pytest.raises(ValueError, match=r"experts_forward\[grouped_mm\]: b2 must be \[3, 8\] torch.float32"):
        experts_forward(*case.args(), backend="grouped_mm", b2=b2.double())
    with pytest.raises(ValueError, match="kind must be 'silu' or 'clamped_swiglu'"):
        Activation("gelu")  # type: ignore[arg-type]
