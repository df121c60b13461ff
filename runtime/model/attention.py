"""The attention variants: ``gqa`` (grouped-query attention, optional biases, q/k norm, partial
rotary, attention sinks and a sliding window) and ``mla`` (DeepSeek's Multi-head Latent Attention
over a latent KV cache).

Both take the normalised hidden states of new tokens and return the attention output before
the residual add. Two paths compute the attention itself (``PATHS``):

- ``paged``: ``eaas.kernels.paged_attention`` reads the cache's blocks in place (``Cache.blocks``)
  with an online softmax; no gathered copy of the cache, no per-group copy of K/V, no full score
  matrix and no host sync. Its backend is Triton on CUDA, chunked torch on CPU.
- ``reference``: the cache gathered into one tensor (``Cache.read``), K/V repeated per query
  group and the whole score matrix in float32: the oracle the paged path is tested against.

Legend: B = batch, S = new tokens per sequence, N = heads, D = head dim,
L = cached positions, r = kv_lora_rank, R = rotary dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaas.kernels.paged_attention import paged_attention
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.kv_cache import Cache
from eaas.runtime.model.layers import apply_rope, rms_norm, rope_cos_sin, rope_frequencies, yarn_mscale

PATHS = ("paged", "reference")


class Rope:
    """The rotary embedding of a model: frequencies computed once, cos/sin per call."""

    def __init__(self, config: MoEConfig) -> None:
        self.inv_freq, self.scale = rope_frequencies(config)
        self.interleaved = config.rope_interleave

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.scale, dtype)


def softmax_scale(config: MoEConfig) -> float:
    """1/sqrt(qk head dim), times MLA's YaRN correction ``mscale(factor, mscale_all_dim)**2``."""
    scale = config.qk_head_dim**-0.5
    yarn = config.rope_scaling
    if config.attention == "mla" and yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def _linear(x: torch.Tensor, t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, t[f"{name}.weight"], t.get(f"{name}.bias"))


def _causal_softmax(
    scores: torch.Tensor,  # [B, N, S, L]
    positions: torch.Tensor,  # [B, S]
    dtype: torch.dtype,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [B, N, S, L]
    """Softmax (float32) over the positions a query at position p sees: those <= p, and with a
    ``window`` only the last ``window`` of them. ``sinks``: one learned logit per head that joins
    each softmax and takes its share of the probability mass, which is then dropped."""
    keys = torch.arange(scores.shape[-1], device=scores.device)
    visible = keys <= positions[:, :, None]  # [B, S, L]
    if window:
        visible &= keys > positions[:, :, None] - window
    scores = scores.to(torch.float32).masked_fill(~visible[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(dtype)
    sink = sinks.to(torch.float32).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1].to(dtype)


def gqa(
    config: MoEConfig,
    t: dict[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,  # [B, S, H]
    positions: torch.Tensor,  # [B, S]
    cache: Cache,
    rope: Rope,
    path: str = "paged",
) -> torch.Tensor:  # [B, S, H]
    c = config
    p = f"model.layers.{layer}.self_attn"
    batch, steps, _ = x.shape
    q = _linear(x, t, f"{p}.q_proj").view(batch, steps, c.num_heads, c.head_dim)
    k = _linear(x, t, f"{p}.k_proj").view(batch, steps, c.num_kv_heads, c.head_dim)
    v = _linear(x, t, f"{p}.v_proj").view(batch, steps, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, t[f"{p}.q_norm.weight"], c.rms_norm_eps)
        k = rms_norm(k, t[f"{p}.k_norm.weight"], c.rms_norm_eps)
    cos, sin = rope(positions, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(layer, positions, k, v)
    window = c.sliding_window if layer in c.sliding_window_layers else 0
    sinks = t.get(f"{p}.sinks")
    if path == "paged":
        blocks = cache.blocks(layer)
        out = paged_attention(
            q,
            blocks.keys,
            blocks.values,
            blocks.tables,
            positions,
            scale=softmax_scale(c),
            value_dim=c.head_dim,
            window=window,
            sinks=sinks,
        )  # [B, S, N, D]
        return _linear(out.reshape(batch, steps, c.num_heads * c.head_dim), t, f"{p}.o_proj")
    total = int(positions.max()) + 1
    group = c.num_heads // c.num_kv_heads
    cached_keys, cached_values = cache.read(layer, total)
    assert cached_values is not None
    keys = cached_keys.repeat_interleave(group, dim=1)  # [B, N, L, D]
    values = cached_values.repeat_interleave(group, dim=1)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * softmax_scale(c)  # [B, N, S, L]
    probs = _causal_softmax(scores, positions, q.dtype, window, sinks)
    out = (probs @ values).transpose(1, 2).reshape(batch, steps, c.num_heads * c.head_dim)
    return _linear(out, t, f"{p}.o_proj")


def mla(
    config: MoEConfig,
    t: dict[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,  # [B, S, H]
    positions: torch.Tensor,  # [B, S]
    cache: Cache,
    rope: Rope,
    path: str = "paged",
) -> torch.Tensor:  # [B, S, H]
    """MLA in its absorbed form: queries are mapped into the latent space (q_nope · W_UK), so
    attention reads the cached latent rows directly and no per-head K/V is ever materialised;
    the output is mapped back out of the latent space by W_UV before o_proj."""
    c = config
    p = f"model.layers.{layer}.self_attn"
    batch, steps, _ = x.shape
    r, nope, rot, vdim = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    if c.q_lora_rank:
        q_latent = rms_norm(
            F.linear(x, t[f"{p}.q_a_proj.weight"]), t[f"{p}.q_a_layernorm.weight"], c.rms_norm_eps
        )
        q = F.linear(q_latent, t[f"{p}.q_b_proj.weight"])
    else:
        q = F.linear(x, t[f"{p}.q_proj.weight"])
    q = q.view(batch, steps, c.num_heads, nope + rot)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    compressed = F.linear(x, t[f"{p}.kv_a_proj_with_mqa.weight"])  # [B, S, r + R]
    latent = rms_norm(compressed[..., :r], t[f"{p}.kv_a_layernorm.weight"], c.rms_norm_eps)
    k_rot = compressed[..., r:].reshape(batch, steps, 1, rot)
    cos, sin = rope(positions, q.dtype)
    q_rot = apply_rope(q_rot, cos, sin, interleaved=rope.interleaved)
    k_rot = apply_rope(k_rot, cos, sin, interleaved=rope.interleaved)
    cache.write(layer, positions, torch.cat((latent[:, :, None], k_rot), dim=-1))
    kv_b = t[f"{p}.kv_b_proj.weight"].view(c.num_heads, nope + vdim, r)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [N, nope, r], [N, v, r]
    q_full = torch.cat((torch.einsum("bsnd,ndr->bsnr", q_nope, w_uk), q_rot), dim=-1)  # [B, S, N, r + R]
    if path == "paged":  # one cached head shared by all N query heads; values = the latent dims
        blocks = cache.blocks(layer)
        out_latent = paged_attention(
            q_full, blocks.keys, None, blocks.tables, positions, scale=softmax_scale(c), value_dim=r
        )  # [B, S, N, r]
    else:
        total = int(positions.max()) + 1
        rows = cache.read(layer, total)[0][:, 0]  # [B, L, r + R]
        scores = torch.einsum("bsnc,blc->bnsl", q_full, rows) * softmax_scale(c)  # [B, N, S, L]
        probs = _causal_softmax(scores, positions, q.dtype)
        out_latent = torch.einsum("bnsl,blr->bsnr", probs, rows[..., :r])  # [B, S, N, r]
    out = torch.einsum("bsnr,nvr->bsnv", out_latent, w_uv).reshape(batch, steps, c.num_heads * vdim)
    return F.linear(out, t[f"{p}.o_proj.weight"])


VARIANTS = {"gqa": gqa, "mla": mla}
