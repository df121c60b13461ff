"""Shared inputs and tolerances of the kernel tests (imported by the test modules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# |y - ref| <= TOLERANCE * (1 + |ref|), with ref the float32 reference on the same (rounded)
# inputs and values of order one. Measured worst cases on CPU over 12 seeds (T=64, K=8, H=64,
# I=48): triton fp32 1.3e-6, fp16 1.3e-3, bf16 9.3e-3; grouped_mm fp16 2.7e-3, bf16 2.8e-2
# (it rounds gate/up to bf16 before the SiLU).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


@dataclass
class ExpertCase:
    x: torch.Tensor  # [T, H]
    group_of: torch.Tensor  # [T, K]
    weight_of: torch.Tensor  # [T, K]
    w13: torch.Tensor  # [G, 2I, H]
    w2: torch.Tensor  # [G, H, I]

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.group_of, self.weight_of, self.w13, self.w2


def make_case(
    num_tokens: int,
    topk: int,
    num_groups: int,
    hidden: int,
    inter: int,
    num_active: int,
    dtype: torch.dtype = torch.float32,
    skip_fraction: float = 0.2,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> ExpertCase:
    """Random inputs whose tokens use ``num_active`` of ``num_groups`` groups (some entries -1)."""
    generator = torch.Generator().manual_seed(seed)
    active = torch.randperm(num_groups, generator=generator)[:num_active]
    group_of = active[torch.randint(0, max(num_active, 1), (num_tokens, topk), generator=generator)]
    group_of[torch.rand(num_tokens, topk, generator=generator) < skip_fraction] = -1
    return ExpertCase(
        x=torch.randn(num_tokens, hidden, generator=generator).to(dtype).to(device),
        group_of=group_of.to(device),
        weight_of=torch.rand(num_tokens, topk, generator=generator).to(device),
        w13=(torch.randn(num_groups, 2 * inter, hidden, generator=generator) / hidden**0.5)
        .to(dtype)
        .to(device),
        w2=(torch.randn(num_groups, hidden, inter, generator=generator) / inter**0.5).to(dtype).to(device),
    )


def reference_fp32(case: ExpertCase) -> torch.Tensor:
    """The per-group-loop reference in float32 on the case's (already rounded) inputs."""
    from eaas.kernels.reference import experts_forward_reference

    return experts_forward_reference(
        case.x.float(), case.group_of, case.weight_of, case.w13.float(), case.w2.float()
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (any dtype) equals ``expected`` (float32) within ``TOLERANCE[dtype]``."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tolerance = TOLERANCE[dtype]
    error = (actual.float() - expected).abs()
    bound = tolerance * (1 + expected.abs())
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert worst <= 1.0, f"max error {error.max().item():.3e} exceeds tolerance {tolerance} ({dtype})"
