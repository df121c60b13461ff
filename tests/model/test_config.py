"""MoEConfig validation names the field; config.json round-trips for every family and preset."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eaas.runtime.model import FAMILIES, MoEConfig, preset, preset_names


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_validates_and_round_trips_through_config_json(family: str) -> None:
    for name in preset_names(family):  # type: ignore[arg-type]
        config = preset(family, name)  # type: ignore[arg-type]
        assert MoEConfig.from_hf_config(config.to_hf_config()) == config


def test_published_shapes() -> None:
    ds = preset("deepseek_v3", "deepseek-v3")
    assert (ds.num_experts, ds.top_k, ds.num_dense_layers, len(ds.moe_layers)) == (256, 8, 3, 58)
    assert (ds.attention, ds.kv_lora_rank, ds.qk_head_dim, ds.rotary_dim) == ("mla", 512, 192, 64)
    kimi = preset("deepseek_v3", "kimi-k2")
    assert (kimi.num_experts, kimi.n_group, kimi.num_heads) == (384, 1, 64)
    qwen = preset("qwen3_moe", "qwen3-30b-a3b")
    assert (qwen.hidden_size, qwen.expert_intermediate_size, qwen.num_experts) == (2048, 768, 128)


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"top_k": 9}, "top_k", "[1, num_experts=8]"),
        ({"num_kv_heads": 3}, "num_kv_heads", "must divide num_heads=4"),
        ({"num_dense_layers": 3}, "num_dense_layers", "[0, num_layers=3)"),
        ({"hidden_size": 0}, "hidden_size", "greater than or equal to 1"),
        ({"router_type": "sigmoid_grouped"}, "router_type", "'softmax_topk'"),
    ],
)
def test_invalid_mixtral_configs_name_the_field_and_range(overrides: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValidationError) as info:
        preset("mixtral", "tiny", **overrides)
    message = str(info.value)
    assert field in message
    assert allowed in message


def test_grouped_routing_constraints() -> None:
    with pytest.raises(ValidationError, match="n_group: must divide num_experts=16"):
        preset("deepseek_v3", "tiny", n_group=3)
    with pytest.raises(ValidationError, match=r"topk_group: must be in \[1, n_group=4\]"):
        preset("deepseek_v3", "tiny", topk_group=5)
    with pytest.raises(ValidationError, match="top_k: must be <= topk_group"):
        preset("deepseek_v3", "tiny", top_k=9, topk_group=2)


def test_unknown_fields_and_families_are_rejected() -> None:
    with pytest.raises(ValidationError, match="num_expert"):
        MoEConfig(**{**preset("mixtral").model_dump(), "num_expert": 4})
    with pytest.raises(
        ValueError, match="model_type: must be one of mixtral, qwen3_moe, qwen2_moe, deepseek_v3, glm4_moe"
    ):
        MoEConfig.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="missing field 'num_local_experts'"):
        hf = preset("mixtral").to_hf_config()
        del hf["num_local_experts"]
        MoEConfig.from_hf_config(hf)


def test_every_published_spelling_is_accepted() -> None:
    """transformers 5.x and the published configs spell some fields differently."""
    qwen = preset("qwen3_moe").to_hf_config()
    qwen["num_local_experts"] = qwen.pop("num_experts")  # transformers 5.x writes this
    assert MoEConfig.from_hf_config(qwen) == preset("qwen3_moe")

    ds = preset("deepseek_v3", "deepseek-v3")
    hf = ds.to_hf_config()
    rope = hf.pop("rope_parameters")  # DeepSeek-V3's published config.json: rope_theta + rope_scaling
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"}
    assert MoEConfig.from_hf_config(hf) == ds

    kimi = preset("deepseek_v3", "kimi-k2-tiny").to_hf_config()
    assert kimi["q_lora_rank"] is None  # no q compression is spelled null
    assert MoEConfig.from_hf_config(kimi).q_lora_rank == 0


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}},
            "rope type 'longrope'",
        ),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": None},
            "missing field 'shared_expert_intermediate_size'",
        ),
        ("deepseek_v3", {"kv_lora_rank": None}, "missing field 'kv_lora_rank'"),
    ],
)
def test_unsupported_configs_are_refused_by_name(family: str, change: dict, message: str) -> None:
    hf = {**preset(family).to_hf_config(), **change}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_hf_config(hf)


def test_attention_fields_must_fit_the_variant() -> None:
    with pytest.raises(ValidationError, match="kv_lora_rank: must be > 0 for attention='mla'"):
        preset("deepseek_v3", kv_lora_rank=0)
    with pytest.raises(ValidationError, match="qk_rope_head_dim: is an MLA field"):
        preset("mixtral", qk_rope_head_dim=8)
    with pytest.raises(ValidationError, match="family deepseek_v3 requires attention='mla'"):
        MoEConfig(
            **{
                **preset("deepseek_v3").model_dump(),
                "attention": "gqa",
                "kv_lora_rank": 0,
                "q_lora_rank": 0,
                "qk_nope_head_dim": 0,
                "qk_rope_head_dim": 0,
                "v_head_dim": 0,
            }
        )
    with pytest.raises(ValidationError, match="partial_rotary_factor: head_dim"):
        preset("glm4_moe", partial_rotary_factor=0.1)
