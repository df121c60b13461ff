"""Tensor names of each family in the Hugging Face checkpoint layout (as transformers writes them)."""

from __future__ import annotations

from eaas.runtime.model.config import MoEConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _moe_prefix(config: MoEConfig, layer: int) -> str:
    block = "block_sparse_moe" if config.family == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}"


def expert_tensor_names(config: MoEConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate [I, H], up [I, H], down [H, I]) tensor names of one routed expert."""
    prefix = f"{_moe_prefix(config, layer)}.experts.{expert}"
    if config.family == "mixtral":
        return f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def router_tensor_names(config: MoEConfig, layer: int) -> dict[str, str]:
    """``weight`` [E, H] and, for sigmoid routing, ``bias`` [E] (selection-only correction)."""
    names = {"weight": f"{_moe_prefix(config, layer)}.gate.weight"}
    if config.router_type == "sigmoid_grouped":
        names["bias"] = f"{_moe_prefix(config, layer)}.gate.e_score_correction_bias"
    return names


def mlp_tensor_names(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def attention_side_tensor_names(config: MoEConfig) -> list[str]:
    """Every tensor an attention client loads: all but the routed experts."""
    names = [EMBED, FINAL_NORM]
    if not config.tie_word_embeddings:
        names.append(LM_HEAD)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{proj}_proj.weight" for proj in ("q", "k", "v", "o")]
        if config.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        if not config.is_moe_layer(layer):
            names += mlp_tensor_names(f"{p}.mlp")
            continue
        names += router_tensor_names(config, layer).values()
        if config.shared_expert_intermediate_size:
            names += mlp_tensor_names(f"{p}.mlp.shared_experts")
    return names


def all_expert_tensor_names(config: MoEConfig) -> list[str]:
    return [
        name
        for layer in config.moe_layers
        for expert in range(config.num_experts)
        for name in expert_tensor_names(config, layer, expert)
    ]
