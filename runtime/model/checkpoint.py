"""Checkpoints in the Hugging Face layout: ``config.json`` + sharded ``*.safetensors`` + index.

``write_random_checkpoint`` makes a random model of any ``MoEConfig``; ``CheckpointReader`` loads
only the tensors asked for (an expert server reads just its experts).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.naming import all_expert_tensor_names, attention_side_tensor_names

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or inconsistent."""


def tensor_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor of ``config``'s checkpoint."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for name in attention_side_tensor_names(config) + all_expert_tensor_names(config):
        leaf = name.rsplit(".", 2)[-2]  # e.g. q_proj, w1, input_layernorm
        if name.endswith(("layernorm.weight", "model.norm.weight")):
            shapes[name] = (h,)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (d,)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            shapes[name] = (config.vocab_size, h)
        elif leaf == "q_proj":
            shapes[name] = (config.num_heads * d, h)
        elif leaf in ("k_proj", "v_proj"):
            shapes[name] = (config.num_kv_heads * d, h)
        elif leaf == "o_proj":
            shapes[name] = (h, config.num_heads * d)
        elif name.endswith("gate.weight"):
            shapes[name] = (config.num_experts, h)
        elif name.endswith("e_score_correction_bias"):
            shapes[name] = (config.num_experts,)
        else:  # an FFN projection: routed expert, shared expert or dense MLP
            inter = _ffn_intermediate(config, name)
            shapes[name] = (h, inter) if leaf in ("down_proj", "w2") else (inter, h)
    return shapes


def _ffn_intermediate(config: MoEConfig, name: str) -> int:
    if ".experts." in name:
        return config.expert_intermediate_size
    if ".shared_experts." in name:
        return config.shared_expert_intermediate_size
    return config.dense_intermediate_size


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random weights that keep activations of order one (so routing and logits are not flat)."""
    if len(shape) == 1:
        if name.endswith("e_score_correction_bias"):
            return 0.1 * torch.randn(shape, generator=generator)
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)  # norm weights
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / math.sqrt(shape[1])


def write_random_checkpoint(
    config: MoEConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Writes a random checkpoint of ``config`` to ``out_dir`` and returns the directory."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = DTYPES[dtype]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, shape in tensor_shapes(config).items():
        tensor = random_tensor(name, shape, generator).to(torch_dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
        total_bytes += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    hf = config.to_hf_config()
    hf["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


class CheckpointReader:
    """Reads ``config.json`` and any subset of tensors of a Hugging Face-layout checkpoint."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: not found (is this a checkpoint directory?)")
        try:
            self.config = MoEConfig.from_hf_config(json.loads(config_path.read_text()))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from exc
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from exc
            return dict(weight_map)
        single = self.directory / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(f"{self.directory}: neither {INDEX_FILE} nor model.safetensors found")
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single.name)

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def load(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Loads ``names`` (opening only the shards that hold them), optionally cast to ``dtype``."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
            raise CheckpointError(f"{self.directory}: tensors not in checkpoint: {shown}")
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_shard[self.weight_map[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for shard, shard_names in sorted(by_shard.items()):
            path = self.directory / shard
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in the index is missing")
            with safe_open(str(path), framework="pt") as f:
                for name in shard_names:
                    tensor = f.get_tensor(name)
                    tensors[name] = tensor if dtype is None else tensor.to(dtype)
        return tensors
