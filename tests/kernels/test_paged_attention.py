"""``paged_attention`` (torch and triton backends) equals dense attention over the gathered cache:
GQA with sinks and sliding windows, MLA's shared latent rows, prefill, decode and mixed steps,
shuffled block tables and the contiguous (table-less) cache. Triton runs under
TRITON_INTERPRET=1 on CPU (conftest), so its shapes stay tiny and float32/float16."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from eaas.kernels.paged_attention import BACKEND_NAMES, get_backend, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    q: torch.Tensor  # [B, S, Hq, Dk]
    key_pool: torch.Tensor  # [P, Hk, b, Dk]
    value_pool: torch.Tensor | None  # [P, Hk, b, Dv]
    tables: torch.Tensor  # [B, W]
    positions: torch.Tensor  # [B, S]
    value_dim: int


def make_case(
    lengths: list[int],  # positions cached before the step, per row
    steps: int,
    heads: int,
    kv_heads: int,
    key_dim: int,
    value_dim: int,
    block_size: int,
    shared_values: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-(length + steps) // block_size) for length in lengths)
    num_blocks = len(lengths) * width + 3  # spare blocks: tables are a shuffled subset
    order = torch.randperm(num_blocks, generator=generator)[: len(lengths) * width]
    tables = order.view(len(lengths), width)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    key_pool = randn(num_blocks, kv_heads, block_size, key_dim)
    value_pool = None if shared_values else randn(num_blocks, kv_heads, block_size, value_dim)
    positions = torch.tensor(lengths)[:, None] + torch.arange(steps)
    q = randn(len(lengths), steps, heads, key_dim)
    return Case(q, key_pool, value_pool, tables.to(DEVICE), positions.to(DEVICE), value_dim)


def dense_reference(
    case: Case, scale: float, window: int = 0, sinks: torch.Tensor | None = None
) -> torch.Tensor:  # [B, S, Hq, Dv] float32
    """The gathered cache, K/V repeated per group and the full float32 score matrix."""
    q = case.q.float()
    batch, steps, heads, _ = q.shape
    blocks = case.key_pool.float()[case.tables]  # [B, W, Hk, b, Dk]
    keys = blocks.transpose(1, 2).flatten(2, 3)  # [B, Hk, L, Dk]
    if case.value_pool is None:
        values = keys[..., : case.value_dim]
    else:
        values = case.value_pool.float()[case.tables].transpose(1, 2).flatten(2, 3)
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * scale  # [B, Hq, S, L]
    key_positions = torch.arange(keys.shape[2], device=q.device)
    visible = key_positions <= case.positions[:, None, :, None]
    if window:
        visible &= key_positions > case.positions[:, None, :, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(batch, heads, steps, 1)
        probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ values).transpose(1, 2)


def run(
    case: Case, backend: str, scale: float = 0.3, window: int = 0, sinks: torch.Tensor | None = None
) -> None:
    out = paged_attention(
        case.q,
        case.key_pool,
        case.value_pool,
        case.tables,
        case.positions,
        scale=scale,
        value_dim=case.value_dim,
        window=window,
        sinks=sinks,
        backend=backend,
    )
    assert out.shape == (*case.q.shape[:3], case.value_dim)
    assert out.dtype == case.q.dtype
    tolerance = 1e-5 if case.q.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        out.float(), dense_reference(case, scale, window, sinks), rtol=tolerance, atol=tolerance
    )


# (lengths cached before the step, new tokens): decode, prefill, and a mixed step whose rows are
# at different positions (right-padded queries included).
STEPS = {"decode": ([37, 5, 16, 0], 1), "prefill": ([0, 0], 7), "mixed": ([13, 0, 30], 4)}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("window", "with_sinks"), [(0, False), (6, False), (0, True), (6, True)])
def test_torch_gqa(step: str, window: int, with_sinks: bool) -> None:
    lengths, steps = STEPS[step]
    case = make_case(lengths, steps, heads=6, kv_heads=2, key_dim=8, value_dim=8, block_size=4)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(1)).to(DEVICE) if with_sinks else None
    run(case, "torch", window=window, sinks=sinks)


@pytest.mark.parametrize("chunk_positions", [1, 4, 12, 1000])
def test_torch_chunks_of_any_size_agree(chunk_positions: int) -> None:
    """Chunk boundaries inside, on and past the blocks give the same attention."""
    case = make_case([41, 9], 3, heads=4, kv_heads=1, key_dim=8, value_dim=8, block_size=4, seed=2)
    out = get_backend("torch", case.q.device)
    result = out(
        case.q,
        case.key_pool,
        case.value_pool,
        case.tables,
        case.positions,
        scale=0.3,
        value_dim=8,
        window=5,
    )
    from eaas.kernels.paged_attention import paged_attention_torch

    chunked = paged_attention_torch(
        case.q,
        case.key_pool,
        case.value_pool,
        case.tables,
        case.positions,
        scale=0.3,
        value_dim=8,
        window=5,
        chunk_positions=chunk_positions,
    )
    torch.testing.assert_close(chunked, result, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.float(), dense_reference(case, 0.3, 5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", STEPS)
def test_torch_mla_latent_rows(step: str) -> None:
    """One cached head for every query head; values are the rows' first ``value_dim`` dims."""
    lengths, steps = STEPS[step]
    case = make_case(
        lengths, steps, heads=4, kv_heads=1, key_dim=12, value_dim=8, block_size=4, shared_values=True
    )
    run(case, "torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_contiguous_cache_without_tables(backend: str) -> None:
    """``block_tables`` None: row i's positions are block i (the contiguous ``KVCache``), here 40
    positions: the Triton kernel walks them in tiles with a ragged last one."""
    case = make_case([20, 3], 2, heads=4, kv_heads=2, key_dim=16, value_dim=16, block_size=40)
    contiguous_keys = case.key_pool[case.tables[:, 0]]  # [B, Hk, 32, D]: one block per row
    assert case.value_pool is not None
    contiguous_values = case.value_pool[case.tables[:, 0]]
    out = paged_attention(
        case.q,
        contiguous_keys,
        contiguous_values,
        None,
        case.positions,
        scale=0.3,
        value_dim=16,
        backend=backend,
    )
    torch.testing.assert_close(out.float(), dense_reference(case, 0.3), rtol=1e-5, atol=1e-5)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="available: " + ", ".join(BACKEND_NAMES)):
        get_backend("cudnn", torch.device("cpu"))


# Triton: block size, head dim and the padded group are 16 (tl.dot's smallest tile on a GPU).
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize(("window", "with_sinks"), [(0, False), (20, True)])
def test_triton_gqa(step: str, window: int, with_sinks: bool) -> None:
    lengths, steps = {"decode": ([37, 5, 16], 1), "mixed": ([21, 0], 3)}[step]
    case = make_case(lengths, steps, heads=4, kv_heads=2, key_dim=16, value_dim=16, block_size=16, seed=3)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1)).to(DEVICE) if with_sinks else None
    run(case, "triton", window=window, sinks=sinks)


def test_triton_mla_latent_rows() -> None:
    """Key dims not a power of two (MLA's 512 + 64 in small: 24 + 8), values the first 24."""
    case = make_case(
        [19, 2],
        1,
        heads=4,
        kv_heads=1,
        key_dim=32 - 8,
        value_dim=16,
        block_size=16,
        shared_values=True,
        seed=4,
    )
    run(case, "triton")


def test_triton_float16() -> None:
    case = make_case(
        [30], 1, heads=2, kv_heads=1, key_dim=16, value_dim=16, block_size=16, dtype=torch.float16
    )
    run(case, "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 is wrong in the interpreter)")
@pytest.mark.parametrize("shape", ["qwen3_gqa", "deepseek_mla"])
def test_triton_bfloat16_at_model_shapes(shape: str) -> None:
    """The compiled kernel at the served shapes: Qwen3-30B-A3B's GQA (G = 8, D = 128) with a
    window and sinks, DeepSeek-V3's MLA (128 heads over a 576-dim latent row, values 512)."""
    if shape == "qwen3_gqa":
        case = make_case([700, 33, 0, 1500], 1, 32, 4, 128, 128, 16, dtype=torch.bfloat16, seed=5)
        sinks = torch.randn(32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        window = 128
    else:
        case = make_case([700, 33], 2, 128, 1, 576, 512, 16, shared_values=True, dtype=torch.bfloat16, seed=6)
        sinks, window = None, 0
    scale = case.q.shape[-1] ** -0.5
    out = paged_attention(
        case.q, case.key_pool, case.value_pool, case.tables, case.positions,
        scale=scale, value_dim=case.value_dim, window=window, sinks=sinks, backend="triton",
    )  # fmt: skip
    expected = dense_reference(case, scale, window, sinks)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
