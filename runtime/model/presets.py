"""Named ``MoEConfig`` presets: ``tiny`` shapes for CPU tests and the published shapes.

The published shapes are configs only (nobody here loads those weights); ``deepseek_v3`` uses
standard GQA attention until MLA is implemented.
"""

from __future__ import annotations

from typing import Any

from eaas.runtime.model.config import Family, MoEConfig

_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "num_experts": 8,
    "top_k": 2,
    "expert_intermediate_size": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}

PRESETS: dict[Family, dict[str, dict[str, Any]]] = {
    "mixtral": {
        "tiny": {**_TINY_COMMON},
        "mixtral-8x7b": {
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 32000,
            "num_experts": 8,
            "top_k": 2,
            "expert_intermediate_size": 14336,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 32768,
        },
        "mixtral-8x22b": {
            "hidden_size": 6144,
            "num_layers": 56,
            "num_heads": 48,
            "num_kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 32768,
            "num_experts": 8,
            "top_k": 2,
            "expert_intermediate_size": 16384,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 65536,
        },
    },
    "qwen3_moe": {
        "tiny": {**_TINY_COMMON, "num_experts": 16, "top_k": 4, "qk_norm": True, "norm_topk_prob": True},
        "qwen3-30b-a3b": {
            "hidden_size": 2048,
            "num_layers": 48,
            "num_heads": 32,
            "num_kv_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "num_experts": 128,
            "top_k": 8,
            "expert_intermediate_size": 768,
            "qk_norm": True,
            "norm_topk_prob": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        },
        "qwen3-235b-a22b": {
            "hidden_size": 4096,
            "num_layers": 94,
            "num_heads": 64,
            "num_kv_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "num_experts": 128,
            "top_k": 8,
            "expert_intermediate_size": 1536,
            "qk_norm": True,
            "norm_topk_prob": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        },
    },
    "deepseek_v3": {
        "tiny": {
            **_TINY_COMMON,
            "num_experts": 16,
            "top_k": 4,
            "shared_expert_intermediate_size": 32,
            "num_dense_layers": 1,
            "dense_intermediate_size": 96,
            "router_type": "sigmoid_grouped",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
        },
        "deepseek-v3": {
            "hidden_size": 7168,
            "num_layers": 61,
            "num_heads": 128,
            "num_kv_heads": 128,
            "head_dim": 128,
            "vocab_size": 129280,
            "num_experts": 256,
            "top_k": 8,
            "expert_intermediate_size": 2048,
            "shared_expert_intermediate_size": 2048,
            "num_dense_layers": 3,
            "dense_intermediate_size": 18432,
            "router_type": "sigmoid_grouped",
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 163840,
        },
    },
}


def preset_names(family: Family) -> list[str]:
    return list(PRESETS[family])


def preset(family: Family, name: str = "tiny", **overrides: Any) -> MoEConfig:
    """The preset ``name`` of ``family`` with optional field overrides."""
    if family not in PRESETS:
        raise ValueError(f"family: must be one of {', '.join(PRESETS)}, got {family!r}")
    if name not in PRESETS[family]:
        raise ValueError(f"preset: {family} has {', '.join(PRESETS[family])}; got {name!r}")
    return MoEConfig(family=family, **{**PRESETS[family][name], **overrides})
