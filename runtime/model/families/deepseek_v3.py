"""DeepSeek-V3 / R1 (and Kimi-K2, which shares the architecture): Multi-head Latent Attention
with YaRN rotary scaling, dense first layers, grouped sigmoid routing with a selection bias,
routed scaling and shared experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eaas.runtime.model.families.base import (
    Fail,
    FamilySpec,
    HFConfig,
    grouped_sigmoid_fields,
    require,
    write_grouped_sigmoid,
)

if TYPE_CHECKING:
    from eaas.runtime.model.config import MoEConfig


def read(source: HFConfig) -> dict[str, Any]:
    source.refuse("attention_bias", False, "MLA without biases")
    rope_dim = source.need("qk_rope_head_dim")
    return {
        **grouped_sigmoid_fields(source),
        "attention": "mla",
        "num_kv_heads": source.need("num_attention_heads"),  # MLA: every head reads the latent
        "head_dim": rope_dim,  # as transformers sets it; MLA's sizes are the fields below
        "q_lora_rank": source.get("q_lora_rank", default=0),
        "kv_lora_rank": source.need("kv_lora_rank"),
        "qk_nope_head_dim": source.need("qk_nope_head_dim"),
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": source.need("v_head_dim"),
        "rope_interleave": source.get("rope_interleave", default=True),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **write_grouped_sigmoid(config),
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": config.q_lora_rank or None,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(config, fail, router_type="sigmoid_grouped", attention="mla", attention_bias=False)
    require(config, fail, num_kv_heads=config.num_heads, head_dim=config.qk_rope_head_dim)


SPEC = FamilySpec("deepseek_v3", read, write, check)
