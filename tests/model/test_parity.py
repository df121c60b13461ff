"""Our reference model equals transformers' implementation loaded from the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaas.runtime.model import CheckpointReader, load_reference
from eaas.runtime.model.naming import expert_tensor_names, mlp_tensor_names, router_tensor_names

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_logits_equal_transformers(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints[family]
    ours = load_reference(directory)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected_class = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert type(theirs).__name__ == expected_class
    tokens = torch.randint(0, ours.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    logits = ours.forward(tokens, torch.full((3,), 11), ours.new_cache(3, 11), all_logits=True)
    with torch.no_grad():
        reference = theirs(tokens).logits
    assert logits.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_deepseek_v3_moe_block_equals_transformers(tiny_checkpoints: dict[str, Path]) -> None:
    """transformers' DeepSeek-V3 uses MLA attention, which we do not implement yet, so the whole
    model cannot match; its MoE block (grouped sigmoid router + experts + shared expert) must."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    reader = CheckpointReader(tiny_checkpoints["deepseek_v3"])
    config = reader.config
    decoder = load_reference(reader.directory)
    layer = config.moe_layers[0]
    hf_config = ds.DeepseekV3Config(
        hidden_size=config.hidden_size,
        moe_intermediate_size=config.expert_intermediate_size,
        n_routed_experts=config.num_experts,
        n_shared_experts=config.shared_expert_intermediate_size // config.expert_intermediate_size,
        num_experts_per_tok=config.top_k,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=config.norm_topk_prob,
    )
    block = ds.DeepseekV3MoE(hf_config).eval()
    router = router_tensor_names(config, layer)
    names = [n for e in range(config.num_experts) for n in expert_tensor_names(config, layer, e)]
    shared = mlp_tensor_names(f"model.layers.{layer}.mlp.shared_experts")
    t = reader.load([*router.values(), *names, *shared])
    with torch.no_grad():
        block.gate.weight.copy_(t[router["weight"]])
        block.gate.e_score_correction_bias.copy_(t[router["bias"]])
        for e in range(config.num_experts):
            gate, up, down = expert_tensor_names(config, layer, e)
            block.experts.gate_up_proj[e].copy_(torch.cat((t[gate], t[up])))
            block.experts.down_proj[e].copy_(t[down])
        block.shared_experts.gate_proj.weight.copy_(t[shared[0]])
        block.shared_experts.up_proj.weight.copy_(t[shared[1]])
        block.shared_experts.down_proj.weight.copy_(t[shared[2]])
        x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(decoder.ffn(layer, x), block(x[None])[0], rtol=1e-5, atol=1e-5)
