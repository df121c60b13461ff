"""GLM-4.5 / GLM-4.6 (glm4_moe): DeepSeek-style grouped sigmoid routing and shared experts over
GQA attention with q/k/v biases, optional q/k norm and rotary on part of each head."""

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
    fields = grouped_sigmoid_fields(source)
    rope = source.rope()
    if "partial_rotary_factor" not in (source.hf.get("rope_parameters") or {}) and not source.hf.get(
        "partial_rotary_factor"
    ):
        rope["partial_rotary_factor"] = 0.5  # transformers' Glm4MoeConfig default
    return {
        **fields,
        **rope,
        "qk_norm": source.get("use_qk_norm", default=False),
        "attention_bias": source.get("attention_bias", default=False),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **write_grouped_sigmoid(config),
        "use_qk_norm": config.qk_norm,
        "attention_bias": config.attention_bias,
        "num_nextn_predict_layers": 0,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(config, fail, router_type="sigmoid_grouped", attention="gqa")


SPEC = FamilySpec("glm4_moe", read, write, check)
