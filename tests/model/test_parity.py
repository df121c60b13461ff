"""Our reference model equals transformers' implementation, both ways round: checkpoints we write
load in transformers, and checkpoints transformers writes (``save_pretrained``) load here.

Tolerance: float32 throughout, |logit difference| <= 1e-4 (observed ~3e-6; MLA is computed in
its absorbed form here and expanded in transformers, so the sums run in another order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.model import (
    FAMILIES,
    CheckpointReader,
    MoEConfig,
    load_reference,
    preset,
    write_random_checkpoint,
)
from eaas.runtime.model.kv_cache import KVCache

transformers = pytest.importorskip("transformers")

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
PRESETS = [(family, "tiny") for family in FAMILIES] + [("deepseek_v3", "kimi-k2-tiny")]

# transformers configs written by hand (not through our mapping), as a user's checkpoint would be.
_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {
        **_SMALL,
        "intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 6,
    },
    "qwen3_moe": {
        **_SMALL,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        **_SMALL,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_key_value_heads": 2,
        "num_experts": 8,
    },
    "deepseek_v3": {
        **_SMALL,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 12,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    "glm4_moe": {
        **_SMALL,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "use_qk_norm": True,
        "attention_bias": True,
        "routed_scaling_factor": 1.5,
    },
    "gpt_oss": {
        **_SMALL,
        "intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 6,
        "sliding_window": 5,
        "swiglu_limit": 1.5,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order one (transformers' init is too small to make routing or logits differ)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if tensor.ndim == 1:
                tensor.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
            elif "embed_tokens" in name:
                tensor.copy_(noise)
            else:
                tensor.copy_(noise / tensor.shape[-1] ** 0.5)


def _transformers_checkpoint(family: str, directory: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(family, **HF_CONFIGS[family])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed=11)
    model.save_pretrained(directory)
    return model


def _compare(ours_dir: Path, theirs: torch.nn.Module) -> None:
    ours = load_reference(ours_dir)
    tokens = torch.randint(0, ours.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    logits = ours.forward(tokens, torch.full((3,), 11), ours.new_cache(3, 11), all_logits=True)
    with torch.no_grad():
        reference = theirs(tokens).logits
    assert reference.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("family", "name"), PRESETS)
def test_our_checkpoints_load_in_transformers_and_match(family: str, name: str, tmp_path: Path) -> None:
    directory = write_random_checkpoint(preset(family, name), tmp_path, seed=7)  # type: ignore[arg-type]
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert type(theirs).__name__ == ARCHITECTURES[family]
    assert not any(info.values()), f"transformers did not load every tensor exactly: {info}"
    _compare(directory, theirs.eval())


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_transformers_wrote_load_and_match(family: str, tmp_path: Path) -> None:
    theirs = _transformers_checkpoint(family, tmp_path)
    config = CheckpointReader(tmp_path).config
    assert (config.family, config.num_layers, config.top_k) == (family, 3, 2)
    _compare(tmp_path, theirs)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "gpt_oss"])
def test_greedy_generation_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    theirs = _transformers_checkpoint(family, tmp_path)
    ours = load_reference(tmp_path)
    prompts = [[5, 17, 200, 3, 9], [42, 1, 2, 3, 4]]
    generated, _ = ours.generate(prompts, max_new_tokens=8)
    with torch.no_grad():
        expected = theirs.generate(
            torch.tensor(prompts), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert [row[5:] for row in expected.tolist()] == generated


def test_mla_caches_the_latent_not_per_head_keys_and_values(tmp_path: Path) -> None:
    """DeepSeek-V3's cache: kv_lora_rank + qk_rope_head_dim numbers per token and layer."""
    config = preset("deepseek_v3", "deepseek-v3")
    cache = KVCache(
        config.model_copy(update={"num_layers": 2}), batch_size=1, max_len=4, dtype=torch.bfloat16
    )
    assert cache.bytes_per_token() == 2 * (512 + 64) * 2
    expanded = config.num_heads * (config.qk_head_dim + config.v_head_dim)  # per-head K and V, per layer
    assert expanded / (512 + 64) > 70  # what caching the latent saves
    gqa = KVCache(preset("mixtral"), batch_size=1, max_len=4)
    assert gqa.bytes_per_token() == 3 * 2 * 2 * 16 * 4


def test_family_constraints_hold_for_transformers_configs() -> None:
    """Every hand-written transformers config above maps to a valid MoEConfig of its family."""
    for family, fields in HF_CONFIGS.items():
        hf = transformers.AutoConfig.for_model(family, **fields).to_dict()
        assert MoEConfig.from_hf_config(hf).family == family
