"""Decode attention over the paged KV cache: read in place vs today's gather, against the floor.

Part 1, one layer's decode attention (batch 16, one new token a row, the rows' block tables
shuffled through the pool as a long-running server's are), at 1k, 4k and 8k cached positions:

- ``reference``: today's path, the attention oracle (``--attention reference``):
  ``PagedView.read`` gathers every row's cache into a new tensor, K/V are repeated per query
  group, and the scores are one float32 [B, N, 1, L] matrix;
- ``paged``: ``eaas.kernels.paged_attention`` (the ``auto`` backend: chunked online softmax in
  torch on CPU, the Triton kernel on CUDA), reading the pool through the tables;
- ``floor``: ``scaled_dot_product_attention`` on a contiguous cache holding the same tokens, no
  gather at all; GQA's G query heads of one cached head (MLA's 128 heads of its one latent row)
  go in as G queries, so SDPA expands nothing either.

Shapes: GQA as Qwen3-30B-A3B (32 query heads, 4 cached heads, head dim 128); MLA as DeepSeek-V3
(128 heads over one latent row of 512 + 64 rotary dims, values the 512 latent dims). Today's path
is skipped where its copies would pass ``--max-reference-gib``.

Part 2, end to end: decode tokens/s of a random model with Qwen3-30B-A3B's attention and expert
shapes (``E2E_OVERRIDES``: fewer layers, experts and vocabulary so it fits in memory here), batch
16 at 2k cached positions, through the engine's paged cache (``PagedView``), with each attention
path. The cache holds random K/V (prefill is not what is measured).

Targets: paged <= 1.2x the floor for every decode case; end-to-end paged >= 3x reference.
Times are medians after a warm-up; CPU results on a shared machine move with its load.

On a CPU shared with other work, ``--threads 1`` avoids the thread barriers of an oversubscribed
machine (each of the paged path's many small operations waits for the slowest thread).

Usage: python benchmarks/attention.py [--quick] [--json-out PATH] [--dtype float32|bfloat16|float16]
    [--threads N] [--repeats N]
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from _common import emit, median_seconds, parser, target

from eaas.kernels.paged_attention import paged_attention
from eaas.runtime.model import load_reference, preset, write_random_checkpoint
from eaas.runtime.model.attention import _causal_softmax
from eaas.runtime.serving.paged_cache import KVPool, PagedView

BATCH = 16
BLOCK_SIZE = 16
SHAPES = {  # query heads, cached heads, key dim, value dim (value = first dims of the key for MLA)
    "gqa": (32, 4, 128, 128),
    "mla": (128, 1, 576, 512),
}
E2E_CONTEXT = 2048
EXPERT_BACKEND = "grouped_mm"  # the in-process experts: torch._grouped_mm (its CPU fallback here)
E2E_OVERRIDES = {"num_layers": 2, "num_experts": 32, "vocab_size": 8192}  # Qwen3-30B-A3B otherwise
QUICK_OVERRIDES = {"num_layers": 1, "num_experts": 8, "vocab_size": 2048}


class Case:
    """A pool holding ``length`` positions for each of ``BATCH`` rows, in shuffled blocks."""

    def __init__(self, kind: str, length: int, dtype: torch.dtype, seed: int = 0) -> None:
        heads, kv_heads, key_dim, value_dim = SHAPES[kind]
        self.kind, self.length, self.value_dim = kind, length, value_dim
        generator = torch.Generator().manual_seed(seed)
        per_row = length // BLOCK_SIZE
        num_blocks = BATCH * per_row
        self.keys = torch.randn(num_blocks + 1, kv_heads, BLOCK_SIZE, key_dim, generator=generator).to(dtype)
        self.values = (
            None
            if kind == "mla"
            else torch.randn(num_blocks + 1, kv_heads, BLOCK_SIZE, value_dim, generator=generator).to(dtype)
        )
        order = list(range(num_blocks))
        random.Random(seed).shuffle(order)
        self.tables = [order[row * per_row : (row + 1) * per_row] for row in range(BATCH)]
        self.q = torch.randn(BATCH, 1, heads, key_dim, generator=generator).to(dtype)
        self.positions = torch.full((BATCH, 1), length - 1, dtype=torch.int64)
        self.scale = key_dim**-0.5
        self.view = self._view()
        contiguous = self.view.read(0, length)  # [B, Hk, L, D] each: the floor's cache
        self.floor_keys = contiguous[0].contiguous()
        self.floor_values = (
            self.floor_keys[..., :value_dim] if contiguous[1] is None else contiguous[1].contiguous()
        )

    def _view(self) -> PagedView:
        pool = KVPool.__new__(KVPool)
        pool.block_size, pool.scratch = BLOCK_SIZE, len(self.keys) - 1
        pool.keys, pool.values = [self.keys], [self.values]
        return PagedView(pool, self.tables, [self.length - 1] * BATCH, 1)

    def reference(self) -> torch.Tensor:  # the math of attention.gqa's / mla's reference path
        keys, values = self.view.read(0, self.length)
        if values is None:  # MLA: every head reads the gathered latent rows [B, L, r + R]
            rows = keys[:, 0]
            scores = torch.einsum("bsnc,blc->bnsl", self.q, rows) * self.scale  # [B, N, 1, L]
            probs = _causal_softmax(scores, self.positions, self.q.dtype)
            return torch.einsum("bnsl,blr->bsnr", probs, rows[..., : self.value_dim])
        group = self.q.shape[2] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = self.q.transpose(1, 2) @ keys.transpose(-1, -2) * self.scale  # [B, N, 1, L]
        return _causal_softmax(scores, self.positions, self.q.dtype) @ values

    def paged(self) -> torch.Tensor:  # [B, 1, N, Dv]
        blocks = self.view.blocks(0)
        return paged_attention(
            self.q,
            blocks.keys,
            blocks.values,
            blocks.tables,
            self.positions,
            scale=self.scale,
            value_dim=self.value_dim,
        )

    def floor(self) -> torch.Tensor:  # [B, Hk, G, Dv]
        batch, _, heads, key_dim = self.q.shape
        kv_heads = self.floor_keys.shape[1]
        grouped = self.q.view(batch, kv_heads, heads // kv_heads, key_dim)  # G queries per cached head
        return F.scaled_dot_product_attention(grouped, self.floor_keys, self.floor_values, scale=self.scale)

    def reference_bytes(self) -> int:
        """What today's path allocates: the gathered cache, its per-group copies and the scores."""
        heads, kv_heads, key_dim, value_dim = SHAPES[self.kind]
        element = self.keys.element_size()
        gathered = kv_heads * (key_dim + (value_dim if self.values is not None else 0)) * element
        repeated = heads * (key_dim + value_dim) * element if self.values is not None else 0
        return BATCH * self.length * (gathered + repeated + heads * 4)


def decode_attention(
    lengths: list[int], dtype: torch.dtype, repeats: int, max_reference_gib: float
) -> list[dict]:
    rows = []
    print(
        f"{'shape':<5} {'L':>6} {'floor ms':>9} {'paged ms':>9} {'ref ms':>9} "
        f"{'paged/floor':>12} {'ref/floor':>10}"
    )
    for kind in SHAPES:
        for length in lengths:
            case = Case(kind, length, dtype)
            expected = case.floor().reshape(BATCH, -1)
            error = (case.paged().reshape(BATCH, -1).float() - expected.float()).abs().max().item()
            floor = median_seconds(case.floor, repeats)
            paged = median_seconds(case.paged, repeats)
            reference = None
            if case.reference_bytes() <= max_reference_gib * 2**30:
                reference = median_seconds(case.reference, max(1, repeats // 2))
            row: dict[str, Any] = {
                "shape": kind,
                "cached_positions": length,
                "floor_ms": floor * 1e3,
                "paged_ms": paged * 1e3,
                "reference_ms": None if reference is None else reference * 1e3,
                "paged_vs_floor": paged / floor,
                "reference_vs_floor": None if reference is None else reference / floor,
                "max_abs_error_vs_floor": error,
            }
            rows.append(row)
            ref_ms = "skipped" if reference is None else f"{reference * 1e3:9.2f}"
            ref_ratio = "-" if reference is None else f"{reference / floor:10.2f}x"
            print(
                f"{kind:<5} {length:>6} {floor * 1e3:9.2f} {paged * 1e3:9.2f} {ref_ms:>9} "
                f"{paged / floor:11.2f}x {ref_ratio:>10}",
                flush=True,
            )
            del case
    return rows


def end_to_end(context: int, steps: int, dtype: torch.dtype, overrides: dict[str, int]) -> dict[str, Any]:
    """Decode tokens/s of each attention path over the same paged cache of ``context`` positions."""
    config = preset("qwen3_moe", "qwen3-30b-a3b", **overrides)
    with tempfile.TemporaryDirectory() as directory:
        write_random_checkpoint(config, directory, seed=1)
        decoders = {
            path: load_reference(directory, dtype=dtype, attention=path) for path in ("reference", "paged")
        }
    per_row = -(-(context + steps + 1) // BLOCK_SIZE)
    pool = KVPool(config, BATCH * per_row, BLOCK_SIZE, dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    for keys, values in zip(pool.keys, pool.values, strict=True):
        keys.copy_(torch.randn(keys.shape, generator=generator))
        if values is not None:
            values.copy_(torch.randn(values.shape, generator=generator))
    order = list(range(BATCH * per_row))
    random.Random(3).shuffle(order)
    tables = [order[row * per_row : (row + 1) * per_row] for row in range(BATCH)]
    tokens = torch.randint(0, config.vocab_size, (BATCH, 1), generator=generator)
    result: dict[str, Any] = {"context": context, "batch": BATCH, "layers": config.num_layers, "steps": steps}
    for path, decoder in decoders.items():
        decoder.forward(
            tokens, torch.ones(BATCH, dtype=torch.int64), PagedView(pool, tables, [context] * BATCH, 1)
        )
        start = time.perf_counter()
        for step in range(steps):
            view = PagedView(pool, tables, [context + step] * BATCH, 1)
            decoder.forward(tokens, torch.ones(BATCH, dtype=torch.int64), view)
        result[f"{path}_tokens_per_s"] = BATCH * steps / (time.perf_counter() - start)
    result["speedup"] = result["paged_tokens_per_s"] / result["reference_tokens_per_s"]
    print(
        f"end to end, {config.num_layers} layers, batch {BATCH} at {context} positions: "
        f"reference {result['reference_tokens_per_s']:.1f} tok/s, "
        f"paged {result['paged_tokens_per_s']:.1f} tok/s, "
        f"{result['speedup']:.2f}x",
        flush=True,
    )
    return result


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    p.add_argument("--max-reference-gib", type=float, default=4.0, help="skip today's path above this")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = [1024] if args.quick else [1024, 4096, 8192]
    repeats = 3 if args.quick else args.repeats
    decode = decode_attention(lengths, dtype, repeats, args.max_reference_gib)
    if args.quick:
        e2e = end_to_end(512, 2, dtype, QUICK_OVERRIDES)
    else:
        e2e = end_to_end(E2E_CONTEXT, 4, dtype, E2E_OVERRIDES)
    targets = {
        f"decode_{row['shape']}_{row['cached_positions']}_paged_vs_floor": target(
            row["paged_vs_floor"], 1.2, False
        )
        for row in decode
    }
    targets["e2e_decode_speedup"] = target(e2e["speedup"], 3.0)
    emit("attention", [*decode, {"end_to_end": e2e}], targets, args.json_out)


if __name__ == "__main__":
    main()
