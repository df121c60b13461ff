"""The paged KV cache's block allocator: fixed-size blocks of ``block_size`` token positions
handed to sequences as they grow and returned when they finish or are preempted (pure)."""

from __future__ import annotations


class BlockAllocator:
    """``num_blocks`` blocks; ``tables[seq]`` lists a sequence's blocks in position order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, seq: int, num_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``num_tokens`` positions."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq, ())))

    def can_hold(self, seq: int, num_tokens: int) -> bool:
        return self.missing(seq, num_tokens) <= len(self.free)

    def grow(self, seq: int, num_tokens: int) -> None:
        """Gives ``seq`` blocks for ``num_tokens`` positions; raises when too few are free."""
        need = self.missing(seq, num_tokens)
        if need > len(self.free):
            raise MemoryError(f"KV cache: sequence {seq} needs {need} more blocks, {len(self.free)} free")
        table = self.tables.setdefault(seq, [])
        table.extend(self.free.pop() for _ in range(need))

    def release(self, seq: int) -> None:
        self.free.extend(reversed(self.tables.pop(seq, [])))

    @property
    def used_fraction(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks
