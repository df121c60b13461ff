"""The expert FFN's gated activation: ``act = f(gate, up)`` between the two GEMMs.

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
