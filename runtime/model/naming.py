"""Tensor names and shapes of each family in the Hugging Face checkpoint layout (as
transformers writes them). ``tensor_shapes`` is the one list: checkpoints are written from it
and every loaded tensor is checked against it."""

from __future__ import annotations

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.families import family_spec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

Shape = tuple[int, ...]


def moe_prefix(config: MoEConfig, layer: int) -> str:
    return f"model.layers.{layer}.{family_spec(config.family).moe_block}"


def expert_tensor_names(config: MoEConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate [I, H], up [I, H], down [H, I]) tensor names of one routed expert."""
    prefix = f"{moe_prefix(config, layer)}.experts.{expert}"
    gate, up, down = family_spec(config.family).expert_leaves
    return f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight", f"{prefix}.{down}.weight"


def router_tensor_names(config: MoEConfig, layer: int) -> dict[str, str]:
    """``weight`` [E, H] and, for sigmoid routing, ``bias`` [E] (selection-only correction)."""
    names = {"weight": f"{moe_prefix(config, layer)}.gate.weight"}
    if config.router_type == "sigmoid_grouped":
        names["bias"] = f"{moe_prefix(config, layer)}.gate.e_score_correction_bias"
    return names


def mlp_tensor_names(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def shared_expert_prefix(config: MoEConfig, layer: int) -> str:
    return f"{moe_prefix(config, layer)}.{family_spec(config.family).shared_block}"


def shared_expert_gate_name(config: MoEConfig, layer: int) -> str:
    """The [1, H] sigmoid gate of the shared expert (qwen2_moe)."""
    return f"{moe_prefix(config, layer)}.shared_expert_gate.weight"


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    gate, up, down = mlp_tensor_names(prefix)
    return {gate: (inter, hidden), up: (inter, hidden), down: (hidden, inter)}


def attention_tensor_shapes(config: MoEConfig, layer: int) -> dict[str, Shape]:
    """The attention projections and norms of ``layer`` (gqa or mla)."""
    p = f"model.layers.{layer}.self_attn"
    h, heads = config.hidden_size, config.num_heads
    if config.attention == "mla":
        q_out = heads * config.qk_head_dim
        shapes: dict[str, Shape] = {}
        if config.q_lora_rank:
            shapes[f"{p}.q_a_proj.weight"] = (config.q_lora_rank, h)
            shapes[f"{p}.q_a_layernorm.weight"] = (config.q_lora_rank,)
            shapes[f"{p}.q_b_proj.weight"] = (q_out, config.q_lora_rank)
        else:
            shapes[f"{p}.q_proj.weight"] = (q_out, h)
        shapes[f"{p}.kv_a_proj_with_mqa.weight"] = (config.kv_lora_rank + config.qk_rope_head_dim, h)
        shapes[f"{p}.kv_a_layernorm.weight"] = (config.kv_lora_rank,)
        shapes[f"{p}.kv_b_proj.weight"] = (
            heads * (config.qk_nope_head_dim + config.v_head_dim),
            config.kv_lora_rank,
        )
        shapes[f"{p}.o_proj.weight"] = (h, heads * config.v_head_dim)
        return shapes
    d, kv = config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        f"{p}.q_proj.weight": (heads * d, h),
        f"{p}.k_proj.weight": (kv, h),
        f"{p}.v_proj.weight": (kv, h),
        f"{p}.o_proj.weight": (h, heads * d),
    }
    if config.attention_bias:
        shapes.update(
            {f"{p}.q_proj.bias": (heads * d,), f"{p}.k_proj.bias": (kv,), f"{p}.v_proj.bias": (kv,)}
        )
    if config.qk_norm:
        shapes.update({f"{p}.q_norm.weight": (d,), f"{p}.k_norm.weight": (d,)})
    return shapes


def attention_side_tensor_shapes(config: MoEConfig) -> dict[str, Shape]:
    """Every tensor an attention client loads (all but the routed experts), with its shape."""
    h = config.hidden_size
    shapes: dict[str, Shape] = {EMBED: (config.vocab_size, h), FINAL_NORM: (h,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes.update(attention_tensor_shapes(config, layer))
        if not config.is_moe_layer(layer):
            shapes.update(_mlp_shapes(f"{p}.mlp", h, config.dense_intermediate_size))
            continue
        router = router_tensor_names(config, layer)
        shapes[router["weight"]] = (config.num_experts, h)
        if "bias" in router:
            shapes[router["bias"]] = (config.num_experts,)
        if config.shared_expert_intermediate_size:
            prefix = shared_expert_prefix(config, layer)
            shapes.update(_mlp_shapes(prefix, h, config.shared_expert_intermediate_size))
        if config.shared_expert_gate:
            shapes[shared_expert_gate_name(config, layer)] = (1, h)
    return shapes


def expert_tensor_shapes(config: MoEConfig, layer: int, expert: int) -> dict[str, Shape]:
    gate, up, down = expert_tensor_names(config, layer, expert)
    h, i = config.hidden_size, config.expert_intermediate_size
    return {gate: (i, h), up: (i, h), down: (h, i)}


def tensor_shapes(config: MoEConfig) -> dict[str, Shape]:
    """Name -> shape of every tensor of ``config``'s checkpoint."""
    shapes = attention_side_tensor_shapes(config)
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            shapes.update(expert_tensor_shapes(config, layer, expert))
    return shapes


def attention_side_tensor_names(config: MoEConfig) -> list[str]:
    return list(attention_side_tensor_shapes(config))


def all_expert_tensor_names(config: MoEConfig) -> list[str]:
    return [
        name
        for layer in config.moe_layers
        for expert in range(config.num_experts)
        for name in expert_tensor_names(config, layer, expert)
    ]
