"""Expert servers can keep DeepSeek's block-scaled FP8 experts as stored (``--dtype fp8``) and
compute on them with the triton (interpreted here) and torch backends: the disaggregated model
then equals the reference on the dequantised weights, within bfloat16's tolerance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from datapath_helpers import generate_concurrently, in_process_servers, urls

if not torch.cuda.is_available():  # the triton backend on CPU: before its modules are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from eaas.runtime.model import CheckpointReader, ExpertStack, load_reference, preset, write_random_checkpoint
from eaas.runtime.placement import round_robin
from eaas.runtime.server.restack import restack


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        preset("deepseek_v3"), tmp_path_factory.mktemp("fp8"), seed=4, fp8_block=(16, 16)
    )


def test_fp8_stack_equals_the_dequantised_stack(fp8_checkpoint: Path) -> None:
    reader = CheckpointReader(fp8_checkpoint)
    config = reader.config
    layer = config.moe_layers[0]
    pairs = [(layer, e) for e in range(0, config.num_experts, 2)]
    kept = ExpertStack.load(reader, pairs, keep_fp8=True)
    exact = ExpertStack.load(reader, pairs, dtype=torch.float32)
    assert kept.w13.dtype == torch.float8_e4m3fn and kept.scales is not None
    assert kept.scales.w13.shape == (len(pairs), 2 * 32 // 16, 64 // 16)
    assert kept.nbytes < exact.nbytes / 3  # 1 byte a weight (+ scales) against 4
    assert kept.compute_dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20, config.hidden_size, generator=generator)
    ids = torch.randint(0, config.num_experts, (20, config.top_k), generator=generator)
    weights = torch.rand(20, config.top_k, generator=generator)
    expected = exact.forward(x, exact.groups_for(layer, ids), weights)
    for backend in ("torch", "triton"):
        y = kept.forward(x.to(torch.bfloat16), kept.groups_for(layer, ids), weights, backend)
        torch.testing.assert_close(y.float(), expected, rtol=5e-2, atol=5e-2)
    moved, loaded = restack(kept, reader, [*pairs[1:], (layer, 1)])  # placement change keeps FP8
    assert loaded == 1 and moved.w13.dtype == torch.float8_e4m3fn and moved.scales is not None
    torch.testing.assert_close(moved.scales.w13[1], kept.scales.w13[1])  # (layer, 2) in both


# Triton's interpreter patches triton.language globally while a kernel runs, so interpreted kernels
# cannot run in two server threads of one process at once: one server for triton here.
@pytest.mark.parametrize(("backend", "num_servers"), [("torch", 2), ("triton", 1)])
def test_fp8_servers_serve_the_model(fp8_checkpoint: Path, backend: str, num_servers: int) -> None:
    config = CheckpointReader(fp8_checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, num_servers, replication=1)
    prompts = [[1, 5, 9, 200], [7, 7, 3]]
    reference = load_reference(fp8_checkpoint, dtype=torch.float32)
    _, want = reference.generate(prompts, 4)
    with in_process_servers(fp8_checkpoint, placement, dtype="fp8", kernel_backend=backend) as servers:
        assert all(s.info()["dtype"] == "float8_e4m3fn" for s in servers.values())
        [(_, logits)] = generate_concurrently(fp8_checkpoint, placement, urls(servers), ["shm"], prompts, 4)
    # bf16 activations against the fp32 reference: the same model, rounded.
    torch.testing.assert_close(logits[0], want[0], rtol=5e-2, atol=1e-1)


def test_keeping_fp8_is_refused_where_it_cannot_work(
    tmp_path: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    reader = CheckpointReader(tiny_checkpoints["deepseek_v3"])
    with pytest.raises(ValueError, match="keeping experts in FP8 needs an FP8 checkpoint"):
        ExpertStack.load(reader, [(1, 0)], keep_fp8=True)
    odd = write_random_checkpoint(preset("deepseek_v3"), tmp_path / "odd", fp8_block=(24, 16))
    with pytest.raises(
        ValueError, match=r"expert_intermediate_size=32 to be a multiple of the FP8 block rows \(24\)"
    ):
        ExpertStack.load(CheckpointReader(odd), [(1, 0)], keep_fp8=True)
