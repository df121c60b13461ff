"""A per-sequence KV cache: every sequence of the batch advances at its own position."""

from __future__ import annotations

import torch

from eaas.runtime.model.config import MoEConfig


class KVCacheFull(RuntimeError):
    """A sequence would grow past the cache's ``max_len``."""


class KVCache:
    """Keys/values [B, kv_heads, max_len, D] per layer and ``lengths`` [B] tokens cached so far."""

    def __init__(
        self,
        config: MoEConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.max_len = max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def check_room(self, num_positions: int) -> None:
        """Raises unless every sequence can take ``num_positions`` more positions."""
        needed = int(self.lengths.max()) + num_positions
        if needed > self.max_len:
            raise KVCacheFull(
                f"sequence length {needed} exceeds the KV cache capacity max_len={self.max_len}"
            )

    def write(self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores keys/values [B, S, kv_heads, D] at ``positions`` [B, S]."""
        index = positions[:, None, :, None].expand(-1, keys.shape[2], -1, keys.shape[3])  # [B, kvh, S, D]
        self.keys[layer].scatter_(2, index, keys.transpose(1, 2))
        self.values[layer].scatter_(2, index, values.transpose(1, 2))

    def advance(self, num_new: torch.Tensor) -> None:
        self.lengths += num_new
