"""The attention side of a MoE model: everything an attention client runs.

Embedding, attention with a KV cache, norms, the router, the shared expert, dense FFN layers and
the LM head. Routed experts live on the expert side (``expert_side.py``).
Legend: B = batch, S = new tokens per sequence, T = tokens, H = hidden, K = top-k, V = vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaas.runtime.model.attention import PATHS, VARIANTS, Rope
from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.kv_cache import Cache
from eaas.runtime.model.layers import rms_norm, swiglu
from eaas.runtime.model.naming import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    attention_side_tensor_names,
    mlp_tensor_names,
    router_tensor_names,
    shared_expert_gate_name,
    shared_expert_prefix,
)


class AttentionSide:
    """Attention-side weights of every layer and the math that uses them. ``attention`` picks how
    attention reads the cache (``attention.PATHS``): ``paged`` in place, ``reference`` the oracle."""

    def __init__(self, config: MoEConfig, tensors: dict[str, torch.Tensor], attention: str = "paged") -> None:
        if attention not in PATHS:
            raise ValueError(f"attention: unknown path {attention!r}; choose one of {', '.join(PATHS)}")
        self.attention_path = attention
        self.config = config
        self.t = tensors
        self.dtype = tensors[EMBED].dtype
        self.rope = Rope(config)
        self._variant = VARIANTS[config.attention]

    @classmethod
    def from_checkpoint(
        cls, reader: CheckpointReader, dtype: torch.dtype | None = None, attention: str = "paged"
    ) -> AttentionSide:
        return cls(
            reader.config, reader.load(attention_side_tensor_names(reader.config), dtype=dtype), attention
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int -> hidden [B, S, H]."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size})")
        return F.embedding(tokens, self.t[EMBED])

    def attention(self, layer: int, h: torch.Tensor, cache: Cache) -> torch.Tensor:
        """h [B, S, H] -> h + attention(norm(h)) [B, S, H]; writes this step's keys/values to ``cache``.

        New tokens of sequence b sit at positions ``cache.lengths[b] + s``; causal masking by
        position makes right-padded batches (sequences with fewer new tokens) exact.
        """
        c = self.config
        x = rms_norm(h, self.t[f"model.layers.{layer}.input_layernorm.weight"], c.rms_norm_eps)
        positions = cache.lengths[:, None] + torch.arange(h.shape[1], device=h.device)  # [B, S]
        return h + self._variant(c, self.t, layer, x, positions, cache, self.rope, self.attention_path)

    def ffn_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            h, self.t[f"model.layers.{layer}.post_attention_layernorm.weight"], self.config.rms_norm_eps
        )

    def dense_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The dense FFN of a non-MoE layer; x [T, H] -> [T, H]."""
        gate, up, down = (self.t[n] for n in mlp_tensor_names(f"model.layers.{layer}.mlp"))
        return swiglu(x, gate, up, down)

    def shared_expert(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The always-on shared expert of a MoE layer (times its sigmoid gate, if any), or None;
        x [T, H] -> [T, H]."""
        c = self.config
        if not c.shared_expert_intermediate_size:
            return None
        gate, up, down = (self.t[n] for n in mlp_tensor_names(shared_expert_prefix(c, layer)))
        out = swiglu(x, gate, up, down)
        if c.shared_expert_gate:
            out = out * torch.sigmoid(F.linear(x, self.t[shared_expert_gate_name(c, layer)]))
        return out

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, K] int64, router weights [T, K] float32)."""
        c = self.config
        names = router_tensor_names(c, layer)
        bias = self.t[names["bias"]] if "bias" in names else None
        logits = F.linear(x, self.t[names["weight"]], bias).to(torch.float32)  # [T, E]
        if c.router_type == "softmax_topk":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights
        # sigmoid_grouped (DeepSeek-V3): the bias steers selection only, weights use raw scores.
        scores = torch.sigmoid(logits)
        choice = scores + self.t[names["selection_bias"]].to(torch.float32)
        num_tokens = x.shape[0]
        per_group = c.num_experts // c.n_group
        group_scores = (
            choice.view(num_tokens, c.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        )  # [T, n_group]
        top_groups = torch.topk(group_scores, c.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(num_tokens, c.num_experts)
        ids = torch.topk(choice.masked_fill(expert_mask == 0, float("-inf")), c.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head; h [..., H] -> [..., V] float32."""
        x = rms_norm(h, self.t[FINAL_NORM], self.config.rms_norm_eps)
        head = self.t[EMBED] if self.config.tie_word_embeddings else self.t[LM_HEAD]
        return F.linear(x, head).to(torch.float32)
