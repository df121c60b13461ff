"""``MoEConfig``: the one model configuration every part of EaaS imports.

It reads and writes the Hugging Face ``config.json`` of each supported family, so a checkpoint
written by ``eaas model init`` loads in ``transformers`` and a published config loads here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["mixtral", "qwen3_moe", "deepseek_v3"]
RouterType = Literal["softmax_topk", "sigmoid_grouped"]
FAMILIES: tuple[Family, ...] = ("mixtral", "qwen3_moe", "deepseek_v3")


class MoEConfig(BaseModel):
    """Shape and routing of a decoder-only MoE model.

    Layers ``[0, num_dense_layers)`` use a dense SwiGLU FFN of ``dense_intermediate_size``;
    the others are MoE layers with ``num_experts`` routed experts (``expert_intermediate_size``
    each), ``top_k`` of them per token, plus an optional always-on shared expert.
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
    num_dense_layers: int = Field(default=0, ge=0)
    dense_intermediate_size: int = Field(default=0, ge=0, le=262144)
    router_type: RouterType = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = Field(default=1, ge=1)
    topk_group: int = Field(default=1, ge=1)
    routed_scaling_factor: float = Field(default=1.0, gt=0.0)
    qk_norm: bool = False
    rope_theta: float = Field(default=10000.0, gt=0.0)
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
        expected_router = "sigmoid_grouped" if self.family == "deepseek_v3" else "softmax_topk"
        if self.router_type != expected_router:
            fail("router_type", f"family {self.family} uses {expected_router!r}, got {self.router_type!r}")
        if self.qk_norm != (self.family == "qwen3_moe"):
            fail("qk_norm", f"family {self.family} requires qk_norm={self.family == 'qwen3_moe'}")
        if self.family == "mixtral" and (self.num_dense_layers or self.shared_expert_intermediate_size):
            fail("family", "mixtral has no dense layers and no shared expert")
        if self.family == "qwen3_moe" and self.shared_expert_intermediate_size:
            fail("shared_expert_intermediate_size", "qwen3_moe has no shared expert (must be 0)")
        return self

    # --- derived -----------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        """Ids of the MoE layers, in order."""
        return list(range(self.num_dense_layers, self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_dense_layers <= layer < self.num_layers

    # --- Hugging Face config.json ------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of this family as transformers writes it (float32 weights)."""
        common: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "num_experts_per_tok": self.top_k,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "attention_dropout": 0.0,
        }
        if self.family == "mixtral":
            return {
                **common,
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "intermediate_size": self.expert_intermediate_size,
                "num_local_experts": self.num_experts,
                "sliding_window": None,
                "router_aux_loss_coef": 0.0,
                "router_jitter_noise": 0.0,
            }
        if self.family == "qwen3_moe":
            return {
                **common,
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "intermediate_size": self.dense_intermediate_size or self.expert_intermediate_size,
                "moe_intermediate_size": self.expert_intermediate_size,
                "num_experts": self.num_experts,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(self.num_dense_layers)),
                "attention_bias": False,
                "use_sliding_window": False,
                "sliding_window": None,
                "router_aux_loss_coef": 0.0,
                "output_router_logits": False,
            }
        # deepseek_v3 with standard GQA attention (MLA is not implemented yet): the MoE part
        # follows DeepSeek-V3's names; "eaas_attention" marks the attention variant.
        return {
            **common,
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "eaas_attention": "gqa",
            "intermediate_size": self.dense_intermediate_size or self.expert_intermediate_size,
            "moe_intermediate_size": self.expert_intermediate_size,
            "n_routed_experts": self.num_experts,
            "n_shared_experts": 1 if self.shared_expert_intermediate_size else 0,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "first_k_dense_replace": self.num_dense_layers,
            "moe_layer_freq": 1,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoEConfig:
        """Reads a ``config.json`` of a supported family; errors name the missing field."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type: must be one of {', '.join(FAMILIES)}, got {model_type!r}")

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"config.json ({model_type}): missing field {key!r}")
            return hf[key]

        num_heads = need("num_attention_heads")
        common: dict[str, Any] = {
            "family": model_type,
            "hidden_size": need("hidden_size"),
            "num_layers": need("num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
            "head_dim": hf.get("head_dim") or need("hidden_size") // num_heads,
            "vocab_size": need("vocab_size"),
            "top_k": need("num_experts_per_tok"),
            "rope_theta": hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        }
        if model_type == "mixtral":
            return cls(
                **common,
                num_experts=need("num_local_experts"),
                expert_intermediate_size=need("intermediate_size"),
            )
        if model_type == "qwen3_moe":
            dense = list(hf.get("mlp_only_layers") or [])
            if dense != list(range(len(dense))) or hf.get("decoder_sparse_step", 1) != 1:
                raise ValueError(
                    "mlp_only_layers/decoder_sparse_step: only leading dense layers are supported "
                    f"(got mlp_only_layers={dense}, decoder_sparse_step={hf.get('decoder_sparse_step')})"
                )
            return cls(
                **common,
                num_experts=need("num_experts"),
                expert_intermediate_size=need("moe_intermediate_size"),
                num_dense_layers=len(dense),
                dense_intermediate_size=hf.get("intermediate_size", 0) if dense else 0,
                norm_topk_prob=hf.get("norm_topk_prob", False),
                qk_norm=True,
            )
        num_dense = hf.get("first_k_dense_replace", 0)
        shared = hf.get("shared_expert_intermediate_size")
        if shared is None:
            shared = hf.get("n_shared_experts", 0) * need("moe_intermediate_size")
        return cls(
            **common,
            num_experts=need("n_routed_experts"),
            expert_intermediate_size=need("moe_intermediate_size"),
            shared_expert_intermediate_size=shared,
            num_dense_layers=num_dense,
            dense_intermediate_size=hf.get("intermediate_size", 0) if num_dense else 0,
            router_type="sigmoid_grouped",
            n_group=hf.get("n_group", 1),
            topk_group=hf.get("topk_group", 1),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            norm_topk_prob=hf.get("norm_topk_prob", True),
        )
