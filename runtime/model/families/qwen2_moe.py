"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k routing, a shared expert scaled by a
sigmoid gate, GQA attention with q/k/v biases."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eaas.runtime.model.families.base import (
    Fail,
    FamilySpec,
    HFConfig,
    qwen_moe_fields,
    require,
    write_qwen_moe,
)

if TYPE_CHECKING:
    from eaas.runtime.model.config import MoEConfig


def read(source: HFConfig) -> dict[str, Any]:
    shared = source.need("shared_expert_intermediate_size")
    return {
        **qwen_moe_fields(source),
        "shared_expert_intermediate_size": shared,
        "shared_expert_gate": bool(shared),
        # Published Qwen1.5/Qwen2 MoE configs have no qkv_bias key and always use the biases.
        "attention_bias": source.get("qkv_bias", default=True),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **write_qwen_moe(config),
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "qkv_bias": config.attention_bias,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(
        config,
        fail,
        router_type="softmax_topk",
        attention="gqa",
        qk_norm=False,
        shared_expert_gate=bool(config.shared_expert_intermediate_size),
    )


SPEC = FamilySpec("qwen2_moe", read, write, check, shared_block="shared_expert")
