"""The expert FFN's gated activation: ``act = f(gate, up)`` between the two GEMMs, and the
block scales of FP8 expert weights.

- ``silu``: ``silu(gate) * up`` (Mixtral, Qwen, DeepSeek, GLM).
- ``clamped_swiglu`` (gpt-oss): gate clamped above at ``limit``, up clamped to
  ``[-limit, limit]``, then ``gate * sigmoid(alpha * gate) * (up + 1)``.

Every backend implements both (the Triton kernels as a constexpr branch of the first GEMM's
epilogue); ``Activation.apply`` is the PyTorch definition they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

ActivationKind = Literal["silu", "clamped_swiglu"]


@dataclass(frozen=True)
class Activation:
    kind: ActivationKind = "silu"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0  # clamped_swiglu only

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "clamped_swiglu"):
            raise ValueError(f"activation: kind must be 'silu' or 'clamped_swiglu', got {self.kind!r}")
        if self.limit <= 0:
            raise ValueError(f"activation: limit must be > 0, got {self.limit}")

    @property
    def code(self) -> int:
        """The Triton kernels' constexpr for this kind."""
        return 0 if self.kind == "silu" else 1

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [..., I] -> act [..., I] (in their dtype)."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = Activation()


@dataclass(frozen=True)
class BlockScales:
    """Block-scaled FP8 expert weights (DeepSeek's layout): ``w13`` and ``w2`` are
    ``float8_e4m3fn`` and weight[g, r, c] = fp8[g, r, c] * scale[g, r // rows, c // cols].

    ``w13`` [G, ceil(2I / rows), ceil(H / cols)] and ``w2`` [G, ceil(H / rows), ceil(I / cols)],
    float32; ``block`` = (rows, cols).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]

    def expand(self, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """One group's scale [R/rows, C/cols] -> per-element scale [R, C]."""
        rows, cols = self.block
        return scale.repeat_interleave(rows, 0)[: shape[0]].repeat_interleave(cols, 1)[:, : shape[1]]
