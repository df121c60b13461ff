"""The paged KV cache: one pool of blocks per layer, shared by every sequence, and the per-step
view the decoder reads and writes through block tables.

Legend: N = blocks in the pool, b = block size (positions), B = sequences in the step, h / D =
heads / dims of a cache row (``kv_cache.cache_rows``: K and V for GQA, the latent row for MLA).
"""

from __future__ import annotations

import torch

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.kv_cache import CacheBlocks, KVCacheFull, cache_numbers_per_token, cache_rows


class KVPool:
    """Keys (and values) [N + 1, h, b, D] per layer; block N is scratch that padded positions
    of a step may write to and nothing reads."""

    def __init__(
        self,
        config: MoEConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch = num_blocks
        (kh, kd), value_row = cache_rows(config)
        layers = range(config.num_layers)
        self.keys = [
            torch.zeros(num_blocks + 1, kh, block_size, kd, dtype=dtype, device=device) for _ in layers
        ]
        self.values: list[torch.Tensor | None] = [
            None
            if value_row is None
            else torch.zeros(
                num_blocks + 1, value_row[0], block_size, value_row[1], dtype=dtype, device=device
            )
            for _ in layers
        ]

    @staticmethod
    def bytes_per_block(config: MoEConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token = cache_numbers_per_token(config)
        return per_token * block_size * config.num_layers * torch.empty((), dtype=dtype).element_size()


class PagedView:
    """One step's cache (the ``Cache`` protocol): sequence b's position p lives in block
    ``tables[b, p // b]`` at offset ``p % b``; ``lengths`` [B] positions already cached.

    The tables and lengths live on the pool's device; what the host must know (the longest row,
    for ``check_room``) comes from the lists the view is built from, so a step never waits on
    the device to learn it."""

    def __init__(self, pool: KVPool, tables: list[list[int]], lengths: list[int], steps: int) -> None:
        self.pool = pool
        size = pool.block_size
        device = pool.keys[0].device
        width = max(-(-(length + steps) // size) for length in lengths)  # blocks a row may touch
        self.capacity = width * size
        padded = [table[:width] + [pool.scratch] * (width - len(table[:width])) for table in tables]
        self.tables = torch.tensor(padded, dtype=torch.int64, device=device)  # [B, width]
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self._longest = max(lengths)  # host copy of lengths.max()

    def check_room(self, num_positions: int) -> None:
        needed = self._longest + num_positions
        if needed > self.capacity:
            raise KVCacheFull(
                f"sequence length {needed} exceeds the blocks given to this step ({self.capacity})"
            )

    def _locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.pool.block_size
        return self.tables.gather(1, positions // size), positions % size  # [B, S] each

    def write(
        self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None
    ) -> None:
        """keys (values) [B, S, h, D] at positions [B, S]."""
        blocks, offsets = self._locate(positions)
        self.pool.keys[layer][blocks, :, offsets] = keys
        pool_values = self.pool.values[layer]
        if pool_values is not None:
            if values is None:
                raise ValueError("this cache holds values: write needs them")
            pool_values[blocks, :, offsets] = values

    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions [0, total) of every row: [B, h, total, D]."""
        blocks = self.tables[:, : -(-total // self.pool.block_size)]  # [B, n]

        def gather(pool: torch.Tensor) -> torch.Tensor:
            rows = pool[blocks]  # [B, n, h, b, D]
            batch, n, heads, size, dim = rows.shape
            return rows.transpose(1, 2).reshape(batch, heads, n * size, dim)[:, :, :total]

        pool_values = self.pool.values[layer]
        return gather(self.pool.keys[layer]), None if pool_values is None else gather(pool_values)

    def blocks(self, layer: int) -> CacheBlocks:
        """The layer's whole pool and this step's tables: attention reads the blocks in place."""
        return CacheBlocks(self.pool.keys[layer], self.pool.values[layer], self.tables)

    def advance(self, num_new: torch.Tensor) -> None:
        self.lengths += num_new.to(self.lengths.device, non_blocking=True)
