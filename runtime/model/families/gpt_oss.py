"""gpt-oss (20b, 120b): GQA attention with biases, per-head attention sinks and a sliding window
on alternate layers, YaRN; a biased router (top-k, then softmax over the chosen logits); biased
experts with the clamped SwiGLU, stored fused per layer (MXFP4 in the published checkpoints,
dequantised on load)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eaas.runtime.model.families.base import FEATURES, Fail, FamilySpec, HFConfig, require

if TYPE_CHECKING:
    from eaas.runtime.model.config import MoEConfig


def read(source: HFConfig) -> dict[str, Any]:
    num_layers = source.need("num_hidden_layers")
    layer_types = source.get("layer_types", default=["sliding_attention", "full_attention"] * num_layers)
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config.json (gpt_oss): layer_types {unknown} are not supported")
    sliding = tuple(i for i, kind in enumerate(layer_types[:num_layers]) if kind == "sliding_attention")
    window = source.get("sliding_window", default=0) if sliding else 0
    return {
        "num_experts": source.need("num_local_experts", "num_experts"),
        "expert_intermediate_size": source.need("intermediate_size"),
        # Top-k of the logits then a softmax over them equals softmax, top-k, renormalise.
        "norm_topk_prob": True,
        "router_bias": True,
        "expert_bias": True,
        "expert_activation": "clamped_swiglu",
        "swiglu_alpha": source.get("swiglu_alpha", default=1.702),
        "swiglu_limit": source.get("swiglu_limit", default=7.0),
        "attention_bias": source.get("attention_bias", default=True),
        "attention_output_bias": source.get("attention_bias", default=True),
        "attention_sinks": True,
        "sliding_window": window,
        "sliding_window_layers": sliding if window else (),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    sliding = set(config.sliding_window_layers)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": config.expert_intermediate_size,
        "num_local_experts": config.num_experts,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window or None,
        "layer_types": [
            "sliding_attention" if layer in sliding else "full_attention"
            for layer in range(config.num_layers)
        ],
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(
        config,
        fail,
        router_type="softmax_topk",
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        expert_activation="clamped_swiglu",
        attention="gqa",
        qk_norm=False,
        attention_sinks=True,
        attention_output_bias=config.attention_bias,
    )
    if config.num_dense_layers or config.shared_expert_intermediate_size:
        fail("family", "gpt_oss has no dense layers and no shared expert")


SPEC = FamilySpec(
    "gpt_oss",
    read,
    write,
    check,
    router_leaf="router",
    features=frozenset(FEATURES),
    fused_experts=True,
)
