"""Tensor names and shapes of each family in the Hugging Face checkpoint layout (as
transformers writes them). ``tensor_shapes`` is the one list: checkpoints are written from it
and every loaded tensor is checked against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.families import family_spec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

Shape = tuple[int, ...]


def moe_prefix(config: MoEConfig, layer: int) -> str:
    return f"model.layers.{layer}.{family_spec(config.family).moe_block}"


ExpertRole = Literal["gate", "up", "down", "gate_up_columns", "down_rows", "gate_up_bias", "down_bias"]


@dataclass(frozen=True)
class ExpertPart:
    """Where one piece of a routed expert is stored.

    ``index`` is the expert's position along dim 0 of a per-layer tensor (fused storage), None
    for a tensor of its own. Roles: ``gate``/``up`` [I, H], ``down`` [H, I] (one tensor per
    expert); ``gate_up_columns`` [H, 2I] with gate and up in alternating columns, ``down_rows``
    [I, H], ``gate_up_bias`` [2I] alternating, ``down_bias`` [H] (gpt-oss's fused layout).
    """

    name: str
    role: ExpertRole
    index: int | None = None


def expert_parts(config: MoEConfig, layer: int, expert: int) -> list[ExpertPart]:
    """Every stored piece of routed expert ``expert`` of ``layer``."""
    if family_spec(config.family).fused_experts:
        prefix = f"{moe_prefix(config, layer)}.experts"
        parts = [
            ExpertPart(f"{prefix}.gate_up_proj", "gate_up_columns", expert),
            ExpertPart(f"{prefix}.down_proj", "down_rows", expert),
        ]
        if config.expert_bias:
            parts += [
                ExpertPart(f"{prefix}.gate_up_proj_bias", "gate_up_bias", expert),
                ExpertPart(f"{prefix}.down_proj_bias", "down_bias", expert),
            ]
        return parts
    gate, up, down = expert_tensor_names(config, layer, expert)
    return [ExpertPart(gate, "gate"), ExpertPart(up, "up"), ExpertPart(down, "down")]


def expert_numel(config: MoEConfig) -> int:
    """Numbers in one routed expert (weights and biases)."""
    h, i = config.hidden_size, config.expert_intermediate_size
    return 3 * h * i + (2 * i + h if config.expert_bias else 0)


def expert_tensor_names(config: MoEConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate [I, H], up [I, H], down [H, I]) tensor names of one routed expert stored on its own
    (every family but the fused ones; see ``expert_parts``)."""
    if family_spec(config.family).fused_experts:
        raise ValueError(f"{config.family} stores experts fused per layer; use expert_parts")
    prefix = f"{moe_prefix(config, layer)}.experts.{expert}"
    gate, up, down = family_spec(config.family).expert_leaves
    return f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight", f"{prefix}.{down}.weight"


def router_tensor_names(config: MoEConfig, layer: int) -> dict[str, str]:
    """``weight`` [E, H]; for sigmoid routing ``selection_bias`` [E] (steers the choice only);
    with ``router_bias`` ``bias`` [E] (added to the logits)."""
    router = f"{moe_prefix(config, layer)}.{family_spec(config.family).router_leaf}"
    names = {"weight": f"{router}.weight"}
    if config.router_type == "sigmoid_grouped":
        names["selection_bias"] = f"{router}.e_score_correction_bias"
    if config.router_bias:
        names["bias"] = f"{router}.bias"
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
    if config.attention_output_bias:
        shapes[f"{p}.o_proj.bias"] = (h,)
    if config.attention_sinks:
        shapes[f"{p}.sinks"] = (heads,)
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
        for kind in ("selection_bias", "bias"):
            if kind in router:
                shapes[router[kind]] = (config.num_experts,)
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


def fused_expert_shapes(config: MoEConfig, layer: int) -> dict[str, Shape]:
    """The per-layer expert tensors of a fused family (gpt_oss)."""
    prefix = f"{moe_prefix(config, layer)}.experts"
    e, h, i = config.num_experts, config.hidden_size, config.expert_intermediate_size
    shapes: dict[str, Shape] = {f"{prefix}.gate_up_proj": (e, h, 2 * i), f"{prefix}.down_proj": (e, i, h)}
    if config.expert_bias:
        shapes.update({f"{prefix}.gate_up_proj_bias": (e, 2 * i), f"{prefix}.down_proj_bias": (e, h)})
    return shapes


def tensor_shapes(config: MoEConfig) -> dict[str, Shape]:
    """Name -> shape of every tensor of ``config``'s checkpoint."""
    shapes = attention_side_tensor_shapes(config)
    fused = family_spec(config.family).fused_experts
    for layer in config.moe_layers:
        if fused:
            shapes.update(fused_expert_shapes(config, layer))
            continue
        for expert in range(config.num_experts):
            shapes.update(expert_tensor_shapes(config, layer, expert))
    return shapes


def attention_side_tensor_names(config: MoEConfig) -> list[str]:
    return list(attention_side_tensor_shapes(config))


def all_expert_tensor_names(config: MoEConfig) -> list[str]:
    """Every stored tensor that holds routed-expert weights."""
    return sorted(set(tensor_shapes(config)) - set(attention_side_tensor_shapes(config)))
