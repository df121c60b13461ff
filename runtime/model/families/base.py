"""What a model family module provides, and the config.json reading every family shares.

A family is one ``FamilySpec``: how its ``config.json`` maps to ``MoEConfig`` fields (both
ways), which constraints it puts on them, and how its MoE block names its tensors. Attention
variants (``gqa``, ``mla``) and everything else are shared code (``attention.py``,
``naming.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eaas.runtime.model.rope_scaling import YarnScaling

if TYPE_CHECKING:
    from eaas.runtime.model.config import MoEConfig

Fail = Callable[[str, str], None]  # fail(field, message) raises

# Features only some architectures have: name -> whether ``config`` uses it.
FEATURES: dict[str, Callable[[MoEConfig], bool]] = {
    "router_bias": lambda c: c.router_bias,
    "expert_bias": lambda c: c.expert_bias,
    "clamped_swiglu": lambda c: c.expert_activation == "clamped_swiglu",
    "attention_sinks": lambda c: c.attention_sinks,
    "sliding_window": lambda c: bool(c.sliding_window),
    "attention_output_bias": lambda c: c.attention_output_bias,
}


def check_features(config: MoEConfig, spec: FamilySpec, fail: Fail) -> None:
    for feature, used in FEATURES.items():
        if used(config) and feature not in spec.features:
            fail(feature, f"family {config.family} has no {feature}")


@dataclass(frozen=True)
class FamilySpec:
    """One model family: config mapping, constraints and MoE tensor names."""

    name: str
    read: Callable[[HFConfig], dict[str, Any]]
    """config.json -> the family's ``MoEConfig`` fields (beyond ``HFConfig.common()``)."""
    write: Callable[[MoEConfig], dict[str, Any]]
    """``MoEConfig`` -> the family's config.json keys (beyond ``write_common``)."""
    check: Callable[[MoEConfig, Fail], None]
    """Raises (through ``fail``) on field values the family's architecture does not have."""
    moe_block: str = "mlp"
    """Module name of the MoE block under ``model.layers.N`` (``block_sparse_moe`` for mixtral)."""
    expert_leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Names of an expert's gate, up and down projections."""
    shared_block: str = "shared_experts"
    """Module name of the shared expert under the MoE block (``shared_expert`` for qwen2_moe)."""
    router_leaf: str = "gate"
    """Module name of the router under the MoE block (``router`` for gpt_oss)."""
    features: frozenset[str] = frozenset()
    """Optional features the architecture has (see ``FEATURES``); a config using another is refused."""
    fused_experts: bool = False
    """Experts stored as one tensor per layer (gpt_oss: ``experts.gate_up_proj`` [E, H, 2I] with
    gate and up in alternating columns, ``experts.down_proj`` [E, I, H], and their biases)."""


class HFConfig:
    """A ``config.json`` dict with the lookups every family needs.

    Published checkpoints and transformers versions spell some fields differently
    (``num_experts`` / ``num_local_experts``; ``rope_theta`` + ``rope_scaling`` /
    ``rope_parameters``): ``need`` and ``get`` take every accepted spelling, first one wins.
    """

    def __init__(self, hf: dict[str, Any]) -> None:
        self.hf = hf
        self.model_type = hf.get("model_type")

    def need(self, *keys: str) -> Any:
        for key in keys:
            if self.hf.get(key) is not None:
                return self.hf[key]
        spelled = " or ".join(repr(k) for k in keys)
        raise ValueError(f"config.json ({self.model_type}): missing field {spelled}")

    def get(self, *keys: str, default: Any = None) -> Any:
        for key in keys:
            if self.hf.get(key) is not None:
                return self.hf[key]
        return default

    def rope(self) -> dict[str, Any]:
        """``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor`` from either layout."""
        params = dict(self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {})
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        theta = params.pop("rope_theta", None) or self.hf.get("rope_theta") or 10000.0
        partial = params.pop("partial_rotary_factor", None) or self.hf.get("partial_rotary_factor") or 1.0
        if kind == "default":
            scaling = None
        elif kind == "yarn":
            params.setdefault(
                "original_max_position_embeddings", self.hf.get("original_max_position_embeddings")
            )
            known = set(YarnScaling.model_fields)
            scaling = YarnScaling(**{k: v for k, v in params.items() if k in known and v is not None})
        else:
            raise ValueError(
                f"config.json ({self.model_type}): rope type {kind!r} is not supported (default, yarn)"
            )
        return {"rope_theta": float(theta), "rope_scaling": scaling, "partial_rotary_factor": float(partial)}

    def leading_dense_layers(self) -> int:
        """Qwen-style ``mlp_only_layers``: only a leading run of dense layers is supported."""
        dense = list(self.hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))) or self.hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "mlp_only_layers/decoder_sparse_step: only leading dense layers are supported "
                f"(got mlp_only_layers={dense}, decoder_sparse_step={self.hf.get('decoder_sparse_step')})"
            )
        return len(dense)

    def refuse(self, key: str, supported: Any, what: str) -> None:
        """Raises when ``key`` is set to something other than ``supported``."""
        value = self.hf.get(key)
        if value is not None and value != supported:
            raise ValueError(f"config.json ({self.model_type}): {key}={value!r} is not supported ({what})")

    def common(self) -> dict[str, Any]:
        """The fields every family spells the same way."""
        num_heads = self.need("num_attention_heads")
        return {
            "hidden_size": self.need("hidden_size"),
            "num_layers": self.need("num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": self.get("num_key_value_heads", default=num_heads),
            "head_dim": self.get("head_dim", default=self.need("hidden_size") // num_heads),
            "vocab_size": self.need("vocab_size"),
            "top_k": self.need("num_experts_per_tok"),
            "rms_norm_eps": self.get("rms_norm_eps", default=1e-6),
            "max_position_embeddings": self.get("max_position_embeddings", default=4096),
            "tie_word_embeddings": self.get("tie_word_embeddings", default=False),
            **self.rope(),
        }


def write_common(config: MoEConfig) -> dict[str, Any]:
    """The config.json keys every family spells the same way (transformers 5.x layout)."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope.update(rope_type="yarn", **config.rope_scaling.model_dump(exclude_none=True))
    if config.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "num_experts_per_tok": config.top_k,
        "rope_parameters": rope,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }


def grouped_sigmoid_fields(source: HFConfig) -> dict[str, Any]:
    """DeepSeek-style MoE fields (deepseek_v3, glm4_moe): dense first layers, grouped sigmoid
    routing with a selection bias, routed scaling, shared experts."""
    source.refuse("scoring_func", "sigmoid", "sigmoid routing only")
    source.refuse("topk_method", "noaux_tc", "noaux_tc routing only")
    source.refuse("moe_layer_freq", 1, "every layer after the dense ones is MoE")
    expert_intermediate = source.need("moe_intermediate_size")
    num_dense = source.get("first_k_dense_replace", default=0)
    shared = source.get("shared_expert_intermediate_size")
    if shared is None:
        shared = source.get("n_shared_experts", default=0) * expert_intermediate
    return {
        "num_experts": source.need("n_routed_experts", "num_local_experts"),
        "expert_intermediate_size": expert_intermediate,
        "shared_expert_intermediate_size": shared,
        "num_dense_layers": num_dense,
        "dense_intermediate_size": source.get("intermediate_size", default=0) if num_dense else 0,
        "router_type": "sigmoid_grouped",
        "n_group": source.get("n_group", default=1),
        "topk_group": source.get("topk_group", default=1),
        "routed_scaling_factor": source.get("routed_scaling_factor", default=1.0),
        "norm_topk_prob": source.get("norm_topk_prob", default=True),
    }


def write_grouped_sigmoid(config: MoEConfig) -> dict[str, Any]:
    inter = config.expert_intermediate_size
    if config.shared_expert_intermediate_size % inter:
        raise ValueError(
            f"shared_expert_intermediate_size: must be a multiple of expert_intermediate_size={inter} "
            f"for {config.family} (n_shared_experts), got {config.shared_expert_intermediate_size}"
        )
    return {
        "intermediate_size": config.dense_intermediate_size or inter,
        "moe_intermediate_size": inter,
        "n_routed_experts": config.num_experts,
        "n_shared_experts": config.shared_expert_intermediate_size // inter,
        "first_k_dense_replace": config.num_dense_layers,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.norm_topk_prob,
    }


def qwen_moe_fields(source: HFConfig) -> dict[str, Any]:
    """The MoE fields Qwen2-MoE and Qwen3-MoE share: experts, leading dense layers, routing norm."""
    source.refuse("use_sliding_window", False, "sliding-window attention is not implemented")
    num_dense = source.leading_dense_layers()
    return {
        # transformers 5.x writes num_local_experts; published Qwen configs say num_experts.
        "num_experts": source.need("num_experts", "num_local_experts"),
        "expert_intermediate_size": source.need("moe_intermediate_size"),
        "num_dense_layers": num_dense,
        "dense_intermediate_size": source.get("intermediate_size", default=0) if num_dense else 0,
        "norm_topk_prob": source.get("norm_topk_prob", default=False),
    }


def write_qwen_moe(config: MoEConfig) -> dict[str, Any]:
    return {
        "intermediate_size": config.dense_intermediate_size or config.expert_intermediate_size,
        "moe_intermediate_size": config.expert_intermediate_size,
        "num_experts": config.num_experts,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.num_dense_layers)),
        "use_sliding_window": False,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def require(config: MoEConfig, fail: Fail, **expected: Any) -> None:
    """``fail`` for the first field whose value is not the family's ``expected`` one."""
    for field, value in expected.items():
        if getattr(config, field) != value:
            fail(field, f"family {config.family} requires {field}={value!r}, got {getattr(config, field)!r}")
