"""Random checkpoints in the HF layout; loading reads only what is asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaas.runtime.model import CheckpointError, CheckpointReader, ExpertStack, preset, write_random_checkpoint
from eaas.runtime.model.checkpoint import tensor_shapes
from eaas.runtime.model.naming import expert_tensor_names


def test_sharded_checkpoint_has_index_and_every_tensor(tiny_checkpoints: dict[str, Path]) -> None:
    for family, directory in tiny_checkpoints.items():
        reader = CheckpointReader(directory)
        shapes = tensor_shapes(reader.config)
        assert set(reader.names()) == set(shapes)
        assert len(set(reader.weight_map.values())) > 1, "tiny checkpoints are written sharded"
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in shapes.values())
        name = expert_tensor_names(reader.config, reader.config.moe_layers[0], 3)[2]
        assert tuple(reader.load([name])[name].shape) == shapes[name], family


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = write_random_checkpoint(preset("mixtral"), tmp_path / "a", seed=3)
    b = write_random_checkpoint(preset("mixtral"), tmp_path / "b", seed=3)
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    for name in ra.names():
        assert torch.equal(ra.load([name])[name], rb.load([name])[name])


def test_expert_subset_loads_only_its_shards(tiny_checkpoints: dict[str, Path], monkeypatch) -> None:
    reader = CheckpointReader(tiny_checkpoints["qwen3_moe"])
    opened: list[str] = []
    import eaas.runtime.model.checkpoint as checkpoint_module

    real_safe_open = checkpoint_module.safe_open

    def counting_safe_open(path: str, **kwargs):
        opened.append(Path(path).name)
        return real_safe_open(path, **kwargs)

    monkeypatch.setattr(checkpoint_module, "safe_open", counting_safe_open)
    stack = ExpertStack.load(reader, [(1, 2), (1, 5)])
    needed = {
        reader.weight_map[n] for pair in [(1, 2), (1, 5)] for n in expert_tensor_names(reader.config, *pair)
    }
    assert set(opened) == needed
    assert len(needed) < len(set(reader.weight_map.values()))
    assert stack.w13.shape == (2, 2 * reader.config.expert_intermediate_size, reader.config.hidden_size)
    assert stack.group_table[1, 5] == 1 and stack.group_table[1, 3] == -1


def test_bad_checkpoints_give_clear_errors(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        CheckpointReader(tmp_path)
    reader = CheckpointReader(tiny_checkpoints["mixtral"])
    with pytest.raises(CheckpointError, match="tensors not in checkpoint: nope"):
        reader.load(["nope"])
    with pytest.raises(ValueError, match=r"\(layer=0, expert=99\) is not a routed expert"):
        ExpertStack.load(reader, [(0, 99)])
