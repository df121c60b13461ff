"""Stateless tensor math shared by the attention side and the reference model.

Legend: B = batch, S = new tokens per sequence, T = tokens, H = hidden, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eaas.runtime.model.config import MoEConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like transformers."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(config: MoEConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, cos/sin scale) of ``config``'s rotary embedding.

    Without scaling: ``theta ** (-2i / rotary_dim)`` and scale 1. With YaRN: each frequency is
    blended between itself (extrapolation) and itself / factor (interpolation) by a linear ramp
    over the dimensions whose wavelengths fall between ``beta_fast`` and ``beta_slow`` rotations
    of the original context; the scale is the attention factor.
    """
    dim, base = config.rotary_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    yarn = config.rope_scaling
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn.factor, yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    scale = yarn.attention_factor
    if scale is None:
        if yarn.mscale and yarn.mscale_all_dim:
            scale = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        else:
            scale = yarn_mscale(factor)
    return inv_freq, float(scale)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, R] for integer ``positions`` [B, S] and ``inv_freq`` [R / 2] (halves layout)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [B, S, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x [B, S, heads, D] with its first R dims rotated by cos/sin [B, S, R]; the rest pass through.

    ``interleaved``: the rotated pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout); they are
    returned de-interleaved (evens then odds), as transformers does, which leaves q·k unchanged
    as long as queries and keys get the same treatment.
    """
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    if interleaved:
        x_rot = torch.cat((x_rot[..., 0::2], x_rot[..., 1::2]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, :, None] + rotated * sin[:, :, None]
    return out if not x_pass.shape[-1] else torch.cat((out, x_pass), dim=-1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); x [T, H], gate/up [I, H], down [H, I] -> [T, H]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
