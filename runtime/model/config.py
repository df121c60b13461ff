"""``MoEConfig``: the one model configuration every part of EaaS imports.

It reads and writes the Hugging Face ``config.json`` of each supported family through that
family's module (``families/``), so a checkpoint written by ``eaas model init`` loads in
``transformers`` and a checkpoint ``transformers`` wrote (or a published config) loads here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eaas.runtime.model.families import HFConfig, family_spec, write_common
from eaas.runtime.model.families.base import check_features
from eaas.runtime.model.rope_scaling import YarnScaling

Family = Literal["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]
RouterType = Literal["softmax_topk", "sigmoid_grouped"]
AttentionKind = Literal["gqa", "mla"]
ExpertActivation = Literal["silu", "clamped_swiglu"]
FAMILIES: tuple[Family, ...] = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


class MoEConfig(BaseModel):
    """Shape, attention and routing of a decoder-only MoE model.

    Layers ``[0, num_dense_layers)`` use a dense SwiGLU FFN of ``dense_intermediate_size``;
    the others are MoE layers with ``num_experts`` routed experts (``expert_intermediate_size``
    each), ``top_k`` of them per token, plus an optional always-on shared expert (optionally
    scaled by a sigmoid gate, as in qwen2_moe). Experts may carry biases and use the clamped
    SwiGLU of gpt-oss (``expert_activation``); the router may carry a bias.

    Attention is ``gqa`` (``num_heads`` query heads over ``num_kv_heads`` key/value heads of
    ``head_dim``, optional q/k norm and q/k/v biases, rotary on the first
    ``partial_rotary_factor`` of each head, optional per-head attention sinks and a sliding
    window on ``sliding_window_layers``) or ``mla`` (Multi-head Latent Attention: low-rank
    q and kv projections, a ``kv_lora_rank`` latent plus one ``qk_rope_head_dim`` rotary key per
    token in the KV cache).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Family
    hidden_size: int = Field(ge=1, le=65536)
    num_layers: int = Field(ge=1, le=1024)
    num_heads: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=1024)
    head_dim: int = Field(ge=1, le=1024)
    vocab_size: int = Field(ge=1, le=4_194_304)
    num_experts: int = Field(ge=1, le=4096)
    top_k: int = Field(ge=1, le=64)
    expert_intermediate_size: int = Field(ge=1, le=131072)
    shared_expert_intermediate_size: int = Field(default=0, ge=0, le=131072)
    shared_expert_gate: bool = False
    num_dense_layers: int = Field(default=0, ge=0)
    dense_intermediate_size: int = Field(default=0, ge=0, le=262144)
    router_type: RouterType = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = Field(default=1, ge=1)
    topk_group: int = Field(default=1, ge=1)
    routed_scaling_factor: float = Field(default=1.0, gt=0.0)
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: ExpertActivation = "silu"
    swiglu_alpha: float = Field(default=1.702, gt=0.0)
    swiglu_limit: float = Field(default=7.0, gt=0.0)
    attention: AttentionKind = "gqa"
    qk_norm: bool = False
    attention_bias: bool = False
    attention_output_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = Field(default=0, ge=0)
    sliding_window_layers: tuple[int, ...] = ()
    partial_rotary_factor: float = Field(default=1.0, gt=0.0, le=1.0)
    q_lora_rank: int = Field(default=0, ge=0, le=65536)
    kv_lora_rank: int = Field(default=0, ge=0, le=65536)
    qk_nope_head_dim: int = Field(default=0, ge=0, le=1024)
    qk_rope_head_dim: int = Field(default=0, ge=0, le=1024)
    v_head_dim: int = Field(default=0, ge=0, le=1024)
    rope_interleave: bool = False
    rope_theta: float = Field(default=10000.0, gt=0.0)
    rope_scaling: YarnScaling | None = None
    rms_norm_eps: float = Field(default=1e-6, gt=0.0, lt=1.0)
    max_position_embeddings: int = Field(default=4096, ge=1)
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _check_consistency(self) -> MoEConfig:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field}: {message}")

        if self.top_k > self.num_experts:
            fail("top_k", f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_heads % self.num_kv_heads:
            fail("num_kv_heads", f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        if self.num_dense_layers >= self.num_layers:
            fail(
                "num_dense_layers",
                f"must be in [0, num_layers={self.num_layers}) so at least one layer is MoE, "
                f"got {self.num_dense_layers}",
            )
        if self.num_dense_layers and not self.dense_intermediate_size:
            fail("dense_intermediate_size", "must be > 0 when num_dense_layers > 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            fail("shared_expert_gate", "needs a shared expert (shared_expert_intermediate_size > 0)")
        if self.router_type == "sigmoid_grouped":
            if self.num_experts % self.n_group:
                fail("n_group", f"must divide num_experts={self.num_experts}, got {self.n_group}")
            if self.topk_group > self.n_group:
                fail("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                fail("n_group", f"each group needs >= 2 experts (num_experts / n_group = {per_group})")
            if self.top_k > self.topk_group * per_group:
                fail(
                    "top_k",
                    f"must be <= topk_group * experts per group = {self.topk_group * per_group}, "
                    f"got {self.top_k}",
                )
        elif self.n_group != 1 or self.topk_group != 1:
            fail("n_group", "group-limited routing (n_group/topk_group) needs router_type='sigmoid_grouped'")
        if self.attention == "mla":
            for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if not getattr(self, field):
                    fail(field, "must be > 0 for attention='mla'")
            if self.qk_rope_head_dim % 2:
                fail("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
            if self.qk_norm or self.partial_rotary_factor != 1.0:
                fail("attention", "mla takes neither qk_norm nor partial_rotary_factor")
        else:
            for field in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            ):
                if getattr(self, field):
                    fail(field, "is an MLA field (attention='mla'); must be 0 for attention='gqa'")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                fail(
                    "partial_rotary_factor",
                    f"head_dim * partial_rotary_factor must be an even number >= 2, got {self.rotary_dim}",
                )
        if bool(self.sliding_window) != bool(self.sliding_window_layers):
            fail("sliding_window", "sliding_window > 0 and sliding_window_layers go together")
        bad_layers = [layer for layer in self.sliding_window_layers if not 0 <= layer < self.num_layers]
        if bad_layers:
            fail("sliding_window_layers", f"must be layer ids in [0, {self.num_layers}), got {bad_layers}")
        spec = family_spec(self.family)
        check_features(self, spec, fail)
        spec.check(self, fail)
        return self

    # --- derived -----------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        """Ids of the MoE layers, in order."""
        return list(range(self.num_dense_layers, self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_dense_layers <= layer < self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each query/key head that are rotated."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        """Query/key head size: ``head_dim`` (gqa) or nope + rope parts (mla)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    # --- Hugging Face config.json ------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of this family as transformers writes it (float32 weights)."""
        return {**write_common(self), **family_spec(self.family).write(self)}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoEConfig:
        """Reads a ``config.json`` of a supported family; errors name the missing field."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type: must be one of {', '.join(FAMILIES)}, got {model_type!r}")
        source = HFConfig(hf)
        return cls(family=model_type, **{**source.common(), **family_spec(model_type).read(source)})
