"""Mixtral: softmax top-k routing over ``block_sparse_moe`` experts (w1/w3/w2), GQA attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eaas.runtime.model.families.base import Fail, FamilySpec, HFConfig, require

if TYPE_CHECKING:
    from eaas.runtime.model.config import MoEConfig


def read(source: HFConfig) -> dict[str, Any]:
    source.refuse("sliding_window", None, "sliding-window attention is not implemented")
    return {
        "num_experts": source.need("num_local_experts", "num_experts"),
        "expert_intermediate_size": source.need("intermediate_size"),
    }


def write(config: MoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": config.expert_intermediate_size,
        "num_local_experts": config.num_experts,
        "sliding_window": None,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0,
    }


def check(config: MoEConfig, fail: Fail) -> None:
    require(config, fail, router_type="softmax_topk", attention="gqa", qk_norm=False, attention_bias=False)
    if config.num_dense_layers or config.shared_expert_intermediate_size:
        fail("family", "mixtral has no dense layers and no shared expert")


SPEC = FamilySpec(
    "mixtral", read, write, check, moe_block="block_sparse_moe", expert_leaves=("w1", "w3", "w2")
)
