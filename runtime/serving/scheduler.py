"""Iteration-level scheduling (the Orca / vLLM idea): which sequences run in the next decoder
step, and how many of their tokens (pure; no model, no threads).

Every step has a budget of ``max_batch_tokens`` new tokens over at most ``max_seqs`` sequences:

1. Running sequences first, oldest first: a decoding one takes 1 token, one still in its prompt
   takes the next chunk that fits the budget (chunked prefill, mixed with the decodes). A
   sequence whose next tokens need a KV block when none is free preempts the newest running
   sequence (its blocks are freed and it goes back to the front of the queue, to be recomputed
   from its tokens when it is admitted again), or itself if it is the newest.
2. Then waiting sequences, first come first served, while budget, sequence slots and free blocks
   last (admission control: a new sequence never preempts a running one). A sequence admitted
   with nothing computed first takes the cached blocks its tokens start with (prefix caching,
   ``blocks.BlockAllocator.match``): those positions are not computed again. A sequence that asks
   for its prompt's log-probabilities takes none (as vLLM): every prompt position goes through the
   model, which is where they come from.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from eaas.runtime.serving.blocks import BlockAllocator
from eaas.runtime.serving.sampling import SamplingParams, Scored

Status = Literal["waiting", "running", "finished"]


@dataclass(eq=False)
class Sequence:
    """One prompt being completed."""

    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the KV cache
    status: Status = "waiting"
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    arrival: float = field(default_factory=time.monotonic)
    matcher: Any = None  # structured outputs: the grammar's matcher (llguidance), fed each new token
    error: str | None = None  # why it finished with "error"
    # params.prompt_logprobs: prompt tokens 1, 2, ... scored so far (token 0 has nothing before it)
    prompt_logprobs: list[Scored] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet through the model (prompt chunks, or the last sampled token)."""
        return len(self.prompt) + len(self.output) - self.num_computed


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch_tokens: int, max_seqs: int) -> None:
        if max_batch_tokens < 1 or max_seqs < 1:
            raise ValueError(
                f"max_batch_tokens and max_seqs must be >= 1, got {max_batch_tokens}, {max_seqs}"
            )
        self.allocator = allocator
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drops ``seq`` (finished or aborted) and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, new tokens) pairs, each sequence's KV blocks allocated."""
        plan: list[tuple[Sequence, int]] = []
        budget = self.max_batch_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an older sequence in this loop
                continue
            want = min(seq.pending, budget)
            if not self._make_room(seq, seq.num_computed + want):
                continue
            self.allocator.grow(seq.id, seq.num_computed + want)
            plan.append((seq, want))
            budget -= want
        while self.waiting and budget and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            matched = (
                seq.num_computed == 0
                and not self.allocator.tables.get(seq.id)
                and seq.params.prompt_logprobs is None
            )
            if matched:  # the computed blocks its tokens start with (prefix caching)
                seq.num_computed = self.allocator.match(seq.id, seq.tokens)
            want = min(seq.pending, budget)
            if not self.allocator.can_hold(seq.id, seq.num_computed + want):
                if matched:  # not admitted: its hits go back (and are counted again next time)
                    self.allocator.release(seq.id)
                    self.allocator.queries -= len(seq.tokens)
                    self.allocator.hits -= seq.num_computed
                    seq.num_computed = 0
                break
            self.waiting.popleft()
            self.allocator.grow(seq.id, seq.num_computed + want)
            seq.status = "running"
            self.running.append(seq)
            plan.append((seq, want))
            budget -= want
        return plan

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempts the newest running sequences until ``seq`` can hold ``num_tokens``; False if
        ``seq`` itself had to go."""
        while not self.allocator.can_hold(seq.id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.id)
        seq.num_computed = 0  # recomputed from its tokens when admitted again
        seq.status = "waiting"
        self.waiting.appendleft(seq)
        self.preemptions += 1
