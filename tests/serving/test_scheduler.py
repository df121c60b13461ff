"""The continuous-batching scheduler and the block allocator, without a model."""

from __future__ import annotations

import pytest

from eaas.runtime.serving.blocks import BlockAllocator
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Scheduler, Sequence


def seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run(scheduler: Scheduler, plan: list[tuple[Sequence, int]], sample: bool = True) -> None:
    """What the engine does after a step: the chunk is cached; caught-up sequences get a token."""
    for s, want in plan:
        s.num_computed += want
        if sample and s.pending == 0:
            s.output.append(7)


def test_allocator_hands_out_and_takes_back_blocks() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    allocator.grow(0, 5)
    assert allocator.tables[0] == [0, 1] and allocator.missing(0, 8) == 0 and allocator.missing(0, 9) == 1
    assert not allocator.can_hold(1, 13)
    with pytest.raises(MemoryError, match="sequence 1 needs 4 more blocks, 2 free"):
        allocator.grow(1, 13)
    allocator.release(0)
    assert allocator.used_fraction == 0 and allocator.can_hold(1, 16)


def test_budget_chunks_prefill_and_mixes_it_with_decodes() -> None:
    scheduler = Scheduler(BlockAllocator(64, 4), max_batch_tokens=10, max_seqs=8)
    a, b = seq(0, 6), seq(1, 25)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert [(s.id, n) for s, n in plan] == [(0, 6), (1, 4)]  # b's prompt is chunked
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert [(s.id, n) for s, n in plan] == [(0, 1), (1, 9)]  # a decodes while b prefills
    assert sum(n for _, n in plan) <= 10


def test_admission_is_fifo_and_bounded_by_slots_and_blocks() -> None:
    scheduler = Scheduler(BlockAllocator(3, 4), max_batch_tokens=100, max_seqs=2)
    for i in range(4):
        scheduler.add(seq(i, 4))
    plan = scheduler.schedule()
    assert [s.id for s, _ in plan] == [0, 1]  # two slots
    assert [s.id for s in scheduler.waiting] == [2, 3]
    run(scheduler, plan)
    scheduler.remove(plan[0][0])  # sequence 0 finishes: a slot and a block come back
    plan = scheduler.schedule()
    assert [s.id for s, _ in plan] == [1, 2]


def test_a_full_cache_preempts_the_newest_and_recomputes_it_later() -> None:
    scheduler = Scheduler(BlockAllocator(4, 4), max_batch_tokens=100, max_seqs=8)
    old, new = seq(0, 8), seq(1, 8)
    scheduler.add(old)
    scheduler.add(new)
    run(scheduler, scheduler.schedule())  # both prefilled: 2 + 2 blocks, all used
    assert old.pending == new.pending == 1 and not scheduler.allocator.free
    plan = scheduler.schedule()  # old needs a third block for position 8: new is preempted
    assert [(s.id, n) for s, n in plan] == [(0, 1)]
    assert scheduler.preemptions == 1 and new.status == "waiting" and new.num_computed == 0
    assert list(scheduler.waiting) == [new] and new.output == [7]  # its token is kept, recomputed
    run(scheduler, plan)
    scheduler.remove(old)
    plan = scheduler.schedule()
    assert [(s.id, n) for s, n in plan] == [(1, 9)]  # prompt + the token it had: recomputed at once


def test_the_newest_sequence_preempts_itself() -> None:
    scheduler = Scheduler(BlockAllocator(3, 4), max_batch_tokens=100, max_seqs=8)
    a, b = seq(0, 2), seq(1, 8)
    scheduler.add(a)
    scheduler.add(b)
    run(scheduler, scheduler.schedule())  # a: 1 block, b: 2 blocks, none free
    plan = scheduler.schedule()  # a's position 2 fits its block; b's position 8 needs a new one
    assert [(s.id, n) for s, n in plan] == [(0, 1)]
    assert b.status == "waiting" and scheduler.preemptions == 1 and scheduler.allocator.tables.get(1) is None


def test_admission_never_preempts() -> None:
    scheduler = Scheduler(BlockAllocator(2, 4), max_batch_tokens=100, max_seqs=8)
    a = seq(0, 4)
    scheduler.add(a)
    run(scheduler, scheduler.schedule())
    b = seq(1, 4)
    scheduler.add(b)
    run(scheduler, scheduler.schedule())  # a takes the last block for position 4; b must wait
    assert [s.id for s in scheduler.running] == [0] and list(scheduler.waiting) == [b]
