"""The paged KV cache's block allocator: fixed-size blocks of ``block_size`` token positions
handed to sequences as they grow and returned when they finish or are preempted, with automatic
prefix caching (pure).

Prefix caching: a *full* block whose keys and values are computed (``commit``) is named by a hash
chained over every token up to its end, so the name says the whole prefix, not only the block's
own tokens. A sequence admitted with nothing computed (``match``) takes the longest run of
named blocks its tokens start with: shared by reference count, their positions are not computed
again. The last token of a sequence is always computed, for its logits. A block whose last
holder lets go keeps its name and its contents until the block is needed for something else:
free blocks are handed out least recently freed first, unnamed ones before named ones, and a
sequence's blocks are freed from its last to its first (a prefix shared by many outlives the
tails). A preempted sequence finds its own blocks again when it is admitted anew, if nothing
took them meanwhile. Names are 128-bit BLAKE2b digests: a collision, which would serve one
prompt another's cache, is not a practical risk.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

ROOT = b"eaas-prefix-v1"  # the chain's start (a change of the block layout changes it)


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its tokens after the name of the block before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


class BlockAllocator:
    """``num_blocks`` blocks; ``tables[seq]`` lists a sequence's blocks in position order."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Free blocks, the next to hand out first (low ids first at the start).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.refs = [0] * num_blocks  # holders of each block
        self.tables: dict[int, list[int]] = {}
        self.names: dict[int, list[bytes]] = {}  # seq -> the names of its computed full blocks
        self.named: dict[bytes, int] = {}  # name -> the block holding that prefix
        self.name_of: dict[int, bytes] = {}  # block -> its name
        # Counters (Prometheus counters: they never go down), counted by ``admitted`` once a
        # sequence's admission holds, never for a lookup that is undone.
        self.queries = 0  # tokens of admitted sequences looked up in the cache
        self.hits = 0  # ... of which were found computed

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
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            name = self.name_of.pop(block, None)
            if name is not None:  # its prefix is evicted: the block gets new contents
                del self.named[name]
            self.refs[block] = 1
            table.append(block)

    def match(self, seq: int, tokens: list[int]) -> int:
        """Gives ``seq`` (holding no block yet) the computed blocks its ``tokens`` start with;
        returns how many positions they hold (a multiple of the block size, below ``len(tokens)``).
        Counted in ``queries`` and ``hits`` only when the sequence is ``admitted``."""
        assert not self.tables.get(seq), f"sequence {seq} already holds blocks"
        table: list[int] = []
        names: list[bytes] = []
        if self.prefix_caching:
            parent = ROOT
            size = self.block_size
            for start in range(0, (len(tokens) - 1) // size * size, size):  # the last token is computed
                name = chain_hash(parent, tokens[start : start + size])
                block = self.named.get(name)
                if block is None:
                    break
                if self.refs[block] == 0:
                    del self.free[block]
                self.refs[block] += 1
                table.append(block)
                names.append(name)
                parent = name
        self.tables[seq] = table
        self.names[seq] = names
        return len(table) * self.block_size

    def admitted(self, num_tokens: int, num_hits: int) -> None:
        """Counts the lookup (``match``) of a sequence whose admission holds: ``num_tokens`` looked
        up, ``num_hits`` of them found computed."""
        self.queries += num_tokens
        self.hits += num_hits

    def uncommitted(self, seq: int, num_computed: int) -> bool:
        """Whether ``seq`` has full computed blocks not yet named (``commit`` has work)."""
        return self.prefix_caching and num_computed // self.block_size > len(self.names.get(seq, ()))

    def commit(self, seq: int, tokens: list[int], num_computed: int) -> None:
        """Names the full blocks of ``seq`` whose positions are now computed (``tokens`` holds at
        least ``num_computed`` tokens). A prefix another block already holds keeps that block."""
        if not self.prefix_caching:
            return
        names = self.names.setdefault(seq, [])
        table = self.tables.get(seq, [])
        size = self.block_size
        for index in range(len(names), min(num_computed // size, len(table))):
            parent = names[-1] if names else ROOT
            name = chain_hash(parent, tokens[index * size : (index + 1) * size])
            names.append(name)
            block = table[index]
            if name not in self.named and block not in self.name_of:
                self.named[name] = block
                self.name_of[block] = name

    def release(self, seq: int) -> None:
        """Lets go of ``seq``'s blocks, its last first; a block nobody holds any more is free (and
        keeps its prefix until it is handed out again)."""
        self.names.pop(seq, None)
        for block in reversed(self.tables.pop(seq, [])):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
                if block not in self.name_of:  # nothing to keep: handed out before named blocks
                    self.free.move_to_end(block, last=False)

    @property
    def used_fraction(self) -> float:
        """Blocks held by a sequence (free blocks that keep a prefix count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self.named)
