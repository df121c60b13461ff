"""Qwen3-MoE: softmax top-k routing, GQA attention with per-head q/k RMSNorm, no shared expert."""

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
    return {
        **qwen_moe_fields(source),
        "qk_norm": True,
        "attention_bias": source.get("attention_bias", default=False),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **write_qwen_moe(config),
        "attention_bias": config.attention_bias,
        "sliding_window": None,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(config, fail, router_type="softmax_topk", attention="gqa", qk_norm=True)
    if config.shared_expert_intermediate_size:
        fail("shared_expert_intermediate_size", "qwen3_moe has no shared expert (must be 0)")


SPEC = FamilySpec("qwen3_moe", read, write, check)
