"""Automatic prefix caching: blocks named by a hash chained over the whole prefix, shared by
reference count, evicted least recently used, correct through preemption; the outputs with the
cache equal those without it and those of each prompt alone."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from eaas.runtime.model import load_reference
from eaas.runtime.model.decoder import Decoder
from eaas.runtime.serving.blocks import BlockAllocator
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Scheduler, Sequence

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]  # 4.5 blocks of 4


def test_blocks_are_named_by_their_whole_prefix_and_shared() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert allocator.match(0, a) == 0
    allocator.grow(0, len(a))
    allocator.commit(0, a, len(a))  # two full blocks named, the third is partial
    assert allocator.cached_blocks == 2
    assert allocator.match(1, a) == 8 and allocator.tables[1] == allocator.tables[0][:2]
    assert allocator.refs[allocator.tables[0][0]] == 2
    # The same second block after another first block is another prefix: not shared.
    assert allocator.match(2, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    # A whole-block prompt leaves its last token to compute (its logits are needed).
    assert allocator.match(3, a[:8]) == 4
    assert allocator.queries == allocator.hits == 0  # counted when a sequence is admitted
    allocator.admitted(9, 8)
    assert allocator.queries == 9 and allocator.hits == 8
    for seq in (0, 1, 2, 3):
        allocator.release(seq)
    assert allocator.used_fraction == 0 and allocator.cached_blocks == 2  # free, but still cached


def test_free_blocks_go_unnamed_first_then_least_recently_freed_tails_first() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    allocator.match(0, tokens)
    allocator.grow(0, 6)
    allocator.commit(0, tokens, 6)
    allocator.release(0)  # blocks 0, 1, 2 named; freed 2, 1, 0
    assert list(allocator.free) == [3, 2, 1, 0]
    allocator.match(1, [7, 8, 9])
    allocator.grow(1, 3)  # takes the unnamed block 3, then block 2 (the old tail: evicted)
    assert allocator.tables[1] == [3, 2] and allocator.cached_blocks == 2
    assert allocator.match(2, tokens) == 4  # the head of the old prefix is still there


def test_the_cache_counters_never_go_down_while_an_admission_is_undone() -> None:
    """A waiting sequence takes its cached blocks, then finds too few free blocks for the rest and
    gives them back, step after step, until a running sequence finishes. Read after every call the
    scheduler makes to the allocator (where a Prometheus scrape may read them), its query and hit
    counters never go down; the lookup is counted once, when the sequence is admitted."""
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    scraped: list[tuple[int, int]] = []
    lookups: list[int] = []  # the sequences ``match`` was called for
    for name in ("match", "can_hold", "grow", "missing", "release", "commit", "uncommitted"):
        method = getattr(allocator, name)

        def scrape_around(*args: Any, _method: Any = method, _name: str = name) -> Any:
            if _name == "match":
                lookups.append(args[0])
            scraped.append((allocator.queries, allocator.hits))
            result = _method(*args)
            scraped.append((allocator.queries, allocator.hits))
            return result

        setattr(allocator, name, scrape_around)
    scheduler = Scheduler(allocator, max_batch_tokens=16, max_seqs=4)

    def step() -> list[Sequence]:
        plan = scheduler.schedule()
        for seq, want in plan:  # as the engine: the chunk computed, named; a token when caught up
            seq.num_computed += want
            allocator.commit(seq.id, seq.tokens, seq.num_computed)
            if seq.pending == 0:
                seq.output.append(99)
                if len(seq.output) >= seq.params.max_tokens:
                    scheduler.remove(seq)
        return [seq for seq, _ in plan]

    first = Sequence(0, [*SYSTEM[:8], 1], SamplingParams(max_tokens=1))
    scheduler.add(first)
    step()  # computed, named (2 full blocks), finished: its blocks stay cached
    running = Sequence(1, [5] * 11, SamplingParams(max_tokens=3))  # 3 blocks, a 4th once it decodes
    scheduler.add(running)
    step()
    waiting = Sequence(2, SYSTEM[:8] + [2] * 8, SamplingParams(max_tokens=1))  # 2 cached blocks of 4
    scheduler.add(waiting)
    for _ in range(10):
        if waiting.status != "waiting":
            break
        step()
    assert waiting.status == "running" and waiting.num_computed == 16
    assert lookups.count(waiting.id) > 1  # it took its cached blocks and gave them back, then was admitted
    assert all(a <= b for a, b in itertools.pairwise(scraped)), scraped
    assert (allocator.queries, allocator.hits) == (9 + 11 + 16, 0 + 0 + 8)


def test_without_prefix_caching_nothing_is_named() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=False)
    allocator.match(0, [1, 2, 3])
    allocator.grow(0, 3)
    allocator.commit(0, [1, 2, 3], 3)
    assert allocator.cached_blocks == 0 and allocator.match(1, [1, 2, 3]) == 0


def options(decoder: Decoder, blocks: int, caching: bool) -> EngineOptions:
    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    size = blocks * per_block
    return EngineOptions(size, block_size=4, max_batch_tokens=12, max_seqs=4, prefix_caching=caching)


def run(engine: Engine, prompts: list[list[int]], new_tokens: int, arrivals: list[int]) -> list[list[int]]:
    seqs: list = [None] * len(prompts)
    step = 0
    while step < 500:
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                seqs[i] = engine.add(prompts[i], SamplingParams(max_tokens=new_tokens))
        if step > max(arrivals) and not engine.has_work():
            break
        engine.step()
        step += 1
    return [s.output for s in seqs]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])  # GQA blocks and latent (MLA) blocks
@pytest.mark.parametrize("blocks", [64, 8], ids=["roomy", "preempting"])
def test_outputs_with_the_cache_equal_those_without_and_alone(
    family: str, blocks: int, tiny_checkpoints: dict[str, Path]
) -> None:
    decoder = load_reference(tiny_checkpoints[family])
    prompts = [[*SYSTEM, 40 + i, 41, 42 + i] for i in range(5)] + [SYSTEM[:9]]
    arrivals = [0, 3, 6, 9, 12, 15]  # later ones find the shared prefix computed
    cached = Engine(decoder, options(decoder, blocks, caching=True))
    with_cache = run(cached, prompts, 6, arrivals)
    plain = Engine(decoder, options(decoder, blocks, caching=False))
    without = run(plain, prompts, 6, arrivals)
    assert with_cache == without
    for prompt, output in zip(prompts, with_cache, strict=True):
        alone, _ = decoder.generate([prompt], 6)
        assert output == alone[0]
    hits, queries = cached.allocator.hits, cached.allocator.queries
    assert plain.allocator.hits == 0 and hits >= 4 * 16, (hits, queries)  # 4 blocks of SYSTEM, reused
    assert cached.allocator.used_fraction == 0  # every reference came back
    if blocks == 8:  # preempted sequences find their own blocks again (or recompute them)
        assert cached.scheduler.preemptions > 0 and plain.scheduler.preemptions > 0
