"""A per-sequence KV cache: every sequence of the batch advances at its own position.

GQA caches keys and values [B, kv_heads, max_len, D]. MLA caches one row per token: the
normalised ``kv_lora_rank`` latent followed by the ``qk_rope_head_dim`` rotary key,
[B, 1, max_len, r + rope] (576 numbers a token a layer for DeepSeek-V3, against 32768 for
full K/V); its values are the latent part of the same rows, so ``values`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eaas.runtime.model.config import MoEConfig


@dataclass(frozen=True)
class CacheBlocks:
    """One layer of a cache as attention reads it in place (``eaas.kernels.paged_attention``):
    sequence i's position p is at ``keys[tables[i, p // b], :, p % b]`` (b = ``keys.shape[2]``);
    with ``tables`` None, sequence i's positions are block i (a contiguous cache)."""

    keys: torch.Tensor  # [P, h, b, Dk]
    values: torch.Tensor | None  # [P, h, b, Dv]; None: MLA's values are the keys' latent dims
    tables: torch.Tensor | None  # [B, W] int64 on the cache's device


class Cache(Protocol):
    """What attention and the decoder need from a KV cache: the contiguous ``KVCache`` here, or a
    paged view (``runtime/serving/paged_cache.py``). ``read`` gathers positions into a new tensor
    (the reference attention); ``blocks`` hands out the storage to read in place."""

    lengths: torch.Tensor  # [B] positions cached so far

    def check_room(self, num_positions: int) -> None: ...
    def write(
        self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None
    ) -> None: ...
    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def blocks(self, layer: int) -> CacheBlocks: ...
    def advance(self, num_new: torch.Tensor) -> None: ...


class KVCacheFull(RuntimeError):
    """A sequence would grow past the cache's ``max_len``."""


def cache_rows(config: MoEConfig) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(heads, dim) of the keys and of the values (None for MLA) one token adds per layer."""
    if config.attention == "mla":
        return (1, config.kv_lora_rank + config.qk_rope_head_dim), None
    return (config.num_kv_heads, config.head_dim), (config.num_kv_heads, config.head_dim)


def cache_numbers_per_token(config: MoEConfig) -> int:
    """Numbers one token adds to the cache in one layer (K and V, or MLA's latent row)."""
    (kh, kd), value_row = cache_rows(config)
    return kh * kd + (value_row[0] * value_row[1] if value_row else 0)


class KVCache:
    """``keys[layer]`` and ``values[layer]`` (None for MLA), ``lengths`` [B] tokens cached so far."""

    def __init__(
        self,
        config: MoEConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_len = max_len
        self.numbers_per_token = cache_numbers_per_token(config)
        layers = range(config.num_layers)
        (kh, kd), value_row = cache_rows(config)
        self.keys = [torch.zeros(batch_size, kh, max_len, kd, dtype=dtype, device=device) for _ in layers]
        self.values: list[torch.Tensor | None] = [
            None
            if value_row is None
            else torch.zeros(batch_size, value_row[0], max_len, value_row[1], dtype=dtype, device=device)
            for _ in layers
        ]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.bound = max_len  # positions the current step may reach (``check_room`` narrows it)

    def check_room(self, num_positions: int) -> None:
        """Raises unless every sequence can take ``num_positions`` more positions."""
        needed = int(self.lengths.max()) + num_positions
        if needed > self.max_len:
            raise KVCacheFull(
                f"sequence length {needed} exceeds the KV cache capacity max_len={self.max_len}"
            )
        self.bound = needed

    def write(
        self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None
    ) -> None:
        """Stores keys (and values) [B, S, heads, D] at ``positions`` [B, S]."""
        index = positions[:, None, :, None].expand(-1, keys.shape[2], -1, keys.shape[3])  # [B, heads, S, D]
        self.keys[layer].scatter_(2, index, keys.transpose(1, 2))
        cached_values = self.values[layer]
        if cached_values is not None:
            if values is None:
                raise ValueError("this cache holds values: write needs them")
            cached_values.scatter_(2, index, values.transpose(1, 2))

    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys (and values; None for MLA) of positions [0, total): [B, heads, total, D]."""
        values = self.values[layer]
        return self.keys[layer][:, :, :total], None if values is None else values[:, :, :total]

    def blocks(self, layer: int) -> CacheBlocks:
        """Each sequence's positions [0, bound) as one block: views, no copy."""
        values = self.values[layer]
        bound = self.bound
        return CacheBlocks(
            self.keys[layer][:, :, :bound], None if values is None else values[:, :, :bound], None
        )

    def advance(self, num_new: torch.Tensor) -> None:
        self.lengths += num_new

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers."""
        return self.numbers_per_token * len(self.keys) * self.keys[0].element_size()
