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
    with pytest.raises(ValueError, match="model_type: must be one of mixtral, qwen3_moe, deepseek_v3"):
        MoEConfig.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="missing field 'num_local_experts'"):
        hf = preset("mixtral").to_hf_config()
        del hf["num_local_experts"]
        MoEConfig.from_hf_config(hf)
