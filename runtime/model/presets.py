"""Named ``MoEConfig`` presets: ``tiny`` shapes for CPU tests and the published shapes.

The published shapes are configs only (nobody here loads those weights); they follow the
``config.json`` each model was published with.
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

# MLA at tiny size: a q latent, a kv latent, and unequal nope / rope / value head sizes; YaRN
# with a short original context so the frequency ramp is not trivial.
_TINY_MLA: dict[str, Any] = {
    "num_kv_heads": 4,
    "head_dim": 8,
    "attention": "mla",
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "rope_interleave": True,
    "rope_scaling": {
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}

_DEEPSEEK_MLA: dict[str, Any] = {
    "hidden_size": 7168,
    "num_layers": 61,
    "head_dim": 64,
    "attention": "mla",
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "top_k": 8,
    "expert_intermediate_size": 2048,
    "shared_expert_intermediate_size": 2048,
    "dense_intermediate_size": 18432,
    "router_type": "sigmoid_grouped",
}

_GPT_OSS: dict[str, Any] = {
    "router_bias": True,
    "expert_bias": True,
    "expert_activation": "clamped_swiglu",
    "attention_bias": True,
    "attention_output_bias": True,
    "attention_sinks": True,
}

_GPT_OSS_PUBLISHED: dict[str, Any] = {
    **_GPT_OSS,
    "hidden_size": 2880,
    "num_heads": 64,
    "num_kv_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "top_k": 4,
    "expert_intermediate_size": 2880,
    "sliding_window": 128,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
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
    "qwen2_moe": {
        "tiny": {
            **_TINY_COMMON,
            "num_experts": 12,
            "top_k": 4,
            "shared_expert_intermediate_size": 48,
            "shared_expert_gate": True,
            "attention_bias": True,
            "norm_topk_prob": False,
        },
        "qwen1.5-moe-a2.7b": {
            "hidden_size": 2048,
            "num_layers": 24,
            "num_heads": 16,
            "num_kv_heads": 16,
            "head_dim": 128,
            "vocab_size": 151936,
            "num_experts": 60,
            "top_k": 4,
            "expert_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "shared_expert_gate": True,
            "attention_bias": True,
            "norm_topk_prob": False,
            "rope_theta": 1e6,
            "max_position_embeddings": 8192,
        },
    },
    "deepseek_v3": {
        "tiny": {
            **_TINY_COMMON,
            **_TINY_MLA,
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
        # Kimi-K2's layout at tiny size: more experts, one group, no q compression.
        "kimi-k2-tiny": {
            **_TINY_COMMON,
            **_TINY_MLA,
            "q_lora_rank": 0,
            "num_experts": 24,
            "top_k": 4,
            "shared_expert_intermediate_size": 32,
            "num_dense_layers": 1,
            "dense_intermediate_size": 96,
            "router_type": "sigmoid_grouped",
            "routed_scaling_factor": 2.827,
            "rope_theta": 50000.0,
        },
        "deepseek-v3": {
            **_DEEPSEEK_MLA,
            "num_heads": 128,
            "num_kv_heads": 128,
            "vocab_size": 129280,
            "num_experts": 256,
            "num_dense_layers": 3,
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "max_position_embeddings": 163840,
        },
        "kimi-k2": {
            **_DEEPSEEK_MLA,
            "num_heads": 64,
            "num_kv_heads": 64,
            "vocab_size": 163840,
            "num_experts": 384,
            "num_dense_layers": 1,
            "routed_scaling_factor": 2.827,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "max_position_embeddings": 131072,
        },
    },
    "glm4_moe": {
        "tiny": {
            **_TINY_COMMON,
            "num_experts": 16,
            "top_k": 4,
            "shared_expert_intermediate_size": 32,
            "num_dense_layers": 1,
            "dense_intermediate_size": 96,
            "router_type": "sigmoid_grouped",
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "attention_bias": True,
            "qk_norm": True,
            "partial_rotary_factor": 0.5,
        },
        "glm-4.5-air": {
            "hidden_size": 4096,
            "num_layers": 46,
            "num_heads": 96,
            "num_kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 151552,
            "num_experts": 128,
            "top_k": 8,
            "expert_intermediate_size": 1408,
            "shared_expert_intermediate_size": 1408,
            "num_dense_layers": 1,
            "dense_intermediate_size": 10944,
            "router_type": "sigmoid_grouped",
            "routed_scaling_factor": 1.0,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
        },
    },
    "gpt_oss": {
        # A low swiglu_limit and a short window so the clamps and the window act at tiny size.
        "tiny": {
            **_TINY_COMMON,
            **_GPT_OSS,
            "swiglu_limit": 1.0,
            "sliding_window": 4,
            "sliding_window_layers": (0, 2),
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
        },
        "gpt-oss-20b": {
            **_GPT_OSS_PUBLISHED,
            "num_layers": 24,
            "num_experts": 32,
            "sliding_window_layers": tuple(range(0, 24, 2)),
        },
        "gpt-oss-120b": {
            **_GPT_OSS_PUBLISHED,
            "num_layers": 36,
            "num_experts": 128,
            "sliding_window_layers": tuple(range(0, 36, 2)),
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


def preset_of_spec(spec: str) -> MoEConfig:
    """The preset ``FAMILY/PRESET`` (``eaas serve --preset``'s form; ``FAMILY/`` is the tiny one)."""
    family, slash, name = spec.partition("/")
    if not slash:
        raise ValueError(
            f"FAMILY/PRESET is needed, e.g. mixtral/tiny (families: {', '.join(PRESETS)}; "
            f"`eaas model presets` lists the presets), got {spec!r}"
        )
    return preset(family, name or "tiny")  # type: ignore[arg-type]
