"""Random checkpoints in the HF layout; loading reads only what is asked for."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaas.runtime.model import CheckpointError, CheckpointReader, ExpertStack, preset, write_random_checkpoint
from eaas.runtime.model.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_fp8_blocks, quantize_fp8_blocks
from eaas.runtime.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from eaas.runtime.model.naming import expert_parts, expert_tensor_names, tensor_shapes
from eaas.runtime.model.reference import load_reference


def test_sharded_checkpoint_has_index_and_every_tensor(tiny_checkpoints: dict[str, Path]) -> None:
    for family, directory in tiny_checkpoints.items():
        reader = CheckpointReader(directory)
        shapes = tensor_shapes(reader.config)
        assert set(reader.names()) == set(shapes)
        assert len(set(reader.weight_map.values())) > 1, "tiny checkpoints are written sharded"
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in shapes.values())
        name = expert_parts(reader.config, reader.config.moe_layers[0], 3)[1].name
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json \(qwen3_moe\): missing field"):
        CheckpointReader(tmp_path)


def test_checkpoint_files_follow_the_umask(tmp_path: Path) -> None:
    """Shards are written as readable as config.json (safetensors alone writes them 0600, which a
    pod running as another user than the writer cannot read)."""
    old = os.umask(0o022)
    try:
        out = write_random_checkpoint(preset("mixtral"), tmp_path / "c", max_shard_bytes=256 * 1024)
        os.umask(0o027)
        group_only = write_random_checkpoint(preset("mixtral"), tmp_path / "g")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o644}, modes
    assert {f.stat().st_mode & 0o777 for f in group_only.iterdir()} == {0o640}


@contextlib.contextmanager
def as_other_user(uid: int = 65532) -> Iterator[None]:
    """Runs the block as another user: root drops its effective uid (and gid) for it, so file
    permissions apply; anyone else already is another user than root."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors.index.json", "shard"])
def test_an_unreadable_file_is_named_with_the_reason_and_the_users(victim: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:  # not under pytest's 0700 tmp root
        root = Path(scratch)
        root.chmod(0o755)
        out = write_random_checkpoint(preset("mixtral"), root / "c")
        name = next(f.name for f in out.glob("*.safetensors")) if victim == "shard" else victim
        (out / name).chmod(0o600 if os.geteuid() == 0 else 0o000)
        with as_other_user(), pytest.raises(CheckpointError) as caught:
            reader = CheckpointReader(out)
            reader.load(reader.names()[:1])
    message = str(caught.value)
    assert f"{name}: cannot be read (Permission denied; this process runs as uid" in message
    assert "the file is mode 0" in message and "owner uid" in message


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _rewrite(directory: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Replaces tensor ``name`` in its shard by ``change(tensor)``; returns the shard's file name."""
    shard = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(directory / shard))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    return str(shard)


def test_mis_shaped_mis_typed_and_truncated_tensors_are_named(
    tmp_path: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    config = CheckpointReader(tiny_checkpoints["deepseek_v3"]).config
    layer = config.moe_layers[0]
    down = expert_tensor_names(config, layer, 2)[2]
    directory = _copy(tiny_checkpoints["deepseek_v3"], tmp_path / "shape")
    shard = _rewrite(directory, down, lambda t: t[:, :-1])
    expected = (config.hidden_size, config.expert_intermediate_size)
    with pytest.raises(CheckpointError) as info:
        ExpertStack.load(CheckpointReader(directory), [(layer, 2)])
    message = str(info.value)
    assert all(part in message for part in (shard, down, str(expected), "(64, 31)")), message

    kv_b = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    directory = _copy(tiny_checkpoints["deepseek_v3"], tmp_path / "dtype")
    _rewrite(directory, kv_b, lambda t: t.to(torch.int32))
    with pytest.raises(
        CheckpointError, match=rf"tensor {kv_b} is I32; readable dtypes are F32, BF16, F16, F8_E4M3"
    ):
        load_reference(directory)

    directory = _copy(tiny_checkpoints["deepseek_v3"], tmp_path / "truncated")
    shard_path = directory / CheckpointReader(directory).weight_map[kv_b]
    shard_path.write_bytes(shard_path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard_path.name}: not a readable safetensors file"):
        load_reference(directory)


def test_fp8_round_trip_is_within_half_an_fp8_step() -> None:
    weight = torch.randn(40, 72, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 72)
    quantized, scale_inv = quantize_fp8_blocks(weight, (16, 32))
    assert quantized.dtype == FP8_DTYPE and scale_inv.shape == (3, 3)  # partial tiles at both edges
    restored = dequantize_fp8_blocks(quantized, scale_inv, (16, 32), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each tile's scale-normalised value.
    tile_max = scale_inv.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :72] * 448
    assert ((restored - weight).abs() <= tile_max * 2**-4 + 1e-6).all()
    with pytest.raises(ValueError, match=r"scale_inv shape \(3, 2\) does not match"):
        dequantize_fp8_blocks(quantized, scale_inv[:, :2], (16, 32), torch.float32)


def test_fp8_checkpoints_load_dequantised(tmp_path: Path) -> None:
    """DeepSeek's FP8 conventions (weight_scale_inv, quantization_config) at tiny size: loading
    dequantises to exactly what the per-block formula gives, and the model runs on it."""
    config = preset("deepseek_v3")
    directory = write_random_checkpoint(config, tmp_path / "fp8", seed=5, fp8_block=(16, 16))
    reader = CheckpointReader(directory)
    assert reader.fp8_block == (16, 16)
    kv_b = f"model.layers.{config.moe_layers[0]}.self_attn.kv_b_proj.weight"
    raw = load_file(str(directory / reader.weight_map[kv_b]))
    assert raw[kv_b].dtype == FP8_DTYPE
    assert kv_b + SCALE_SUFFIX in reader.weight_map
    assert "model.embed_tokens.weight" + SCALE_SUFFIX not in reader.weight_map
    loaded = reader.load([kv_b], dtype=torch.float32)[kv_b]
    scale = reader.load([kv_b + SCALE_SUFFIX])[kv_b + SCALE_SUFFIX]
    torch.testing.assert_close(loaded, dequantize_fp8_blocks(raw[kv_b], scale, (16, 16), torch.float32))
    assert reader.load([kv_b])[kv_b].dtype == torch.float32  # the dtype config.json declares
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "torch_dtype": "bfloat16"}))
    assert CheckpointReader(directory).load([kv_b])[kv_b].dtype == torch.bfloat16
    dense = write_random_checkpoint(config, tmp_path / "dense", seed=5)
    ours = load_reference(directory, dtype=torch.float32)
    reference = load_reference(dense)
    generated, _ = ours.generate([[1, 2, 3]], 4)
    assert len(generated[0]) == 4
    quantised_expert = ours.experts.stack.w2  # type: ignore[attr-defined]
    exact_expert = reference.experts.stack.w2  # type: ignore[attr-defined]
    assert 0 < (quantised_expert - exact_expert).abs().max() < 0.1 * exact_expert.abs().max()

    broken = _copy(directory, tmp_path / "no-scale")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = broken / index["weight_map"].pop(kv_b + SCALE_SUFFIX)
    index_path.write_text(json.dumps(index))
    tensors = load_file(str(shard))
    del tensors[kv_b + SCALE_SUFFIX]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {kv_b} has no {kv_b}_scale_inv"):
        CheckpointReader(broken).load([kv_b])
    unlabelled = _copy(directory, tmp_path / "no-config")
    hf = json.loads((unlabelled / "config.json").read_text())
    del hf["quantization_config"]
    (unlabelled / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"is FP8 but config\.json has no fp8 quantization_config"):
        CheckpointReader(unlabelled).load([kv_b])


def test_mxfp4_dequantisation_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    values = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(2)) * 3  # [E, out, in]
    blocks, scales = quantize_mxfp4(values)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)
    # e2m1 steps are at most 2 apart (4 to 6): each value is within 1.0 x its block scale.
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((ours - values).abs() <= scale * 1.0 + 1e-6).all()
    with pytest.raises(
        ValueError, match=r"MXFP4 blocks \[3, 40, 2, 16\] and scales \[3, 40, 1\] do not match"
    ):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


def test_mxfp4_expert_checkpoints_load_dequantised(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    """gpt-oss's published layout: fused experts as ``<name>_blocks`` / ``<name>_scales``."""
    config = CheckpointReader(tiny_checkpoints["gpt_oss"]).config
    directory = _copy(tiny_checkpoints["gpt_oss"], tmp_path / "mxfp4")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dequantised: dict[str, torch.Tensor] = {}
    for layer in config.moe_layers:
        for leaf in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{leaf}"
            shard = index["weight_map"].pop(name)
            tensors = load_file(str(directory / shard))
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # stored [E, out, in / 32, 16]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantised[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
            save_file(tensors, str(directory / shard), metadata={"format": "pt"})
            index["weight_map"][name + "_blocks"] = index["weight_map"][name + "_scales"] = shard
    index_path.write_text(json.dumps(index))
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (directory / "config.json").write_text(json.dumps(hf))

    reader = CheckpointReader(directory)
    layer = config.moe_layers[0]
    stack = ExpertStack.load(reader, [(layer, 1), (layer, 4)], dtype=torch.float32)
    gate_up = dequantised[f"model.layers.{layer}.mlp.experts.gate_up_proj"][4]  # [H, 2I], alternating
    torch.testing.assert_close(stack.w13[1, : config.expert_intermediate_size], gate_up[:, 0::2].T)
    torch.testing.assert_close(stack.w13[1, config.expert_intermediate_size :], gate_up[:, 1::2].T)
    down = dequantised[f"model.layers.{layer}.mlp.experts.down_proj"][1]  # [I, H]
    torch.testing.assert_close(stack.w2[0], down.T)
    assert ExpertStack.load(reader, [(layer, 1)]).w13.dtype == torch.float32  # what config.json declares
    generated, _ = load_reference(directory, dtype=torch.float32).generate([[1, 2, 3]], 3)
    assert len(generated[0]) == 3
