"""A per-sequence KV cache: every sequence of the batch advances at its own position.

GQA caches keys and values [B, kv_heads, max_len, D]. MLA caches one row per token: the
normalised ``kv_lora_rank`` latent followed by the ``qk_rope_head_dim`` rotary key,
[B, 1, max_len, r + rope] (576 numbers a token a layer for DeepSeek-V3, against 32768 for
full K/V); its values are the latent part of the same rows, so ``values`` is None.
"""

from __future__ import annotations

import torch

from eaas.runtime.model.config import MoEConfig


class KVCacheFull(RuntimeError):
    """A sequence would grow past the cache's ``max_len``."""


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
        layers = range(config.num_layers)
        self.values: list[torch.Tensor | None]
        if config.attention == "mla":
            row = config.kv_lora_rank + config.qk_rope_head_dim
            self.keys = [torch.zeros(batch_size, 1, max_len, row, dtype=dtype, device=device) for _ in layers]
            self.values = [None for _ in layers]
        else:
            shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def check_room(self, num_positions: int) -> None:
        """Raises unless every sequence can take ``num_positions`` more positions."""
        needed = int(self.lengths.max()) + num_positions
        if needed > self.max_len:
            raise KVCacheFull(
                f"sequence length {needed} exceeds the KV cache capacity max_len={self.max_len}"
            )

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

    def advance(self, num_new: torch.Tensor) -> None:
        self.lengths += num_new

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers."""
        total = 0
        for keys, values in zip(self.keys, self.values, strict=True):
            for part in (keys, values):
                if part is not None:
                    total += part.shape[1] * part.shape[3] * part.element_size()
        return total
