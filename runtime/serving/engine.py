"""``Engine``: continuous batching over a paged KV cache, one decoder step at a time.

    engine = Engine(decoder, EngineOptions(kv_cache_bytes=256 << 20))
    seq = engine.add(prompt_ids, SamplingParams(max_tokens=32, temperature=0.8, seed=1))
    while engine.has_work():
        for event in engine.step():   # tokens sampled this step, and sequences that finished
            ...

Blocks of computed prefixes are shared between sequences (prefix caching, ``blocks``): a new
sequence starts computing after the longest cached prefix of its tokens, and each step names the
blocks it filled.

Each step runs the scheduler's plan through the decoder as right-padded batches (prefill chunks
and decodes mixed): one batch, so every MoE layer sends one request per expert server for
everything running, or, with ``micro_batches`` m > 1, m micro-batches of about equal work
(``micro_batches``) pipelined layer by layer (``Decoder.hidden_micro_batches``): one's attention
runs while another's experts compute. A row's tokens do not depend on m.

A sequence whose prompt is fully through the model gets a token sampled; it finishes on
a stop token, at ``max_tokens``, or when aborted, and its blocks go back to the pool. A sequence
with a grammar (structured outputs, ``grammar``) samples only what its grammar allows and ends
with ``stop`` once the grammar can take nothing more. A failure tied to one sequence (its
sampling, its grammar's matcher, NaN logits in its row) finishes that sequence with ``error``; the
rest of the step goes on. A failed forward pass fails every sequence of its step. Not thread-safe:
one thread owns an engine (the service's worker).

Prompt log-probabilities (``SamplingParams.prompt_logprobs``) come from the same pass: for a row
that asks for them, the step keeps the hidden states of its whole chunk and scores each prompt
position of it (``sampling.score``) into ``Sequence.prompt_logprobs``, chunk after chunk; other
rows keep the last-position logits only. Such a sequence never starts from cached blocks
(``scheduler``). ``max_tokens`` 0 ends a sequence with ``length`` once its prompt is through.

Legend: B = sequences in the step, S = longest chunk of the step, T = prompt positions scored at
once, H = hidden, V = vocabulary.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.decoder import Decoder, MicroBatch
from eaas.runtime.serving.blocks import BlockAllocator
from eaas.runtime.serving.grammar import allowed_tokens, first_line
from eaas.runtime.serving.micro_batches import AUTO, CHOICES, AutoMicroBatches, row_work, split_rows
from eaas.runtime.serving.paged_cache import KVPool, PagedView
from eaas.runtime.serving.sampling import Sampled, SamplingParams, new_generator, sample, score
from eaas.runtime.serving.scheduler import Scheduler, Sequence

log = logging.getLogger("eaas.client.engine")


@dataclass(frozen=True)
class EngineOptions:
    kv_cache_bytes: int = 256 << 20  # the paged pool's size; blocks = bytes / bytes per block
    block_size: int = 16  # positions per KV block
    max_batch_tokens: int = 2048  # new tokens per step (prefill chunks + decodes)
    max_seqs: int = 64  # sequences running at once
    prefix_caching: bool = True  # reuse the computed KV blocks of shared prefixes (``blocks``)
    # A step's rows cut into this many micro-batches, pipelined (``micro_batches``); "auto": measured.
    micro_batches: int | str = 1


class StepFailed(RuntimeError):
    """A step's forward pass failed; the sequences it cost were finished with reason ``error``.
    (A failure to sample a row finishes that row's sequence alone: ``Engine._sample``.)"""

    def __init__(self, seqs: list[Sequence], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.seqs = seqs
        self.cause = cause


@dataclass
class Event:
    seq: Sequence
    sampled: Sampled | None  # the token this step produced (None: finished without one)
    finished: bool


class Engine:
    def __init__(self, decoder: Decoder, options: EngineOptions | None = None) -> None:
        self.decoder = decoder
        self.options = o = options or EngineOptions()
        if o.micro_batches not in (*CHOICES, AUTO):
            raise ValueError(f"micro_batches: must be one of {[*CHOICES, AUTO]}, got {o.micro_batches!r}")
        self.auto = AutoMicroBatches() if o.micro_batches == AUTO else None
        config = decoder.config
        num_blocks = self.pool_blocks(config, o, decoder.side.dtype)
        self.pool = KVPool(config, num_blocks, o.block_size, dtype=decoder.side.dtype)
        self.allocator = BlockAllocator(num_blocks, o.block_size, o.prefix_caching)
        self.scheduler = Scheduler(self.allocator, o.max_batch_tokens, o.max_seqs)
        self._ids = itertools.count()
        self._generators: dict[int, torch.Generator] = {}
        self._counts: dict[int, torch.Tensor] = {}
        self.last_step_sequences = 0  # sequences in the most recent step

    @staticmethod
    def pool_blocks(config: MoEConfig, options: EngineOptions, dtype: torch.dtype) -> int:
        """The KV blocks ``options.kv_cache_bytes`` holds (ValueError: not one)."""
        per_block = KVPool.bytes_per_block(config, options.block_size, dtype)
        num_blocks = options.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={options.kv_cache_bytes} holds no block of {per_block} bytes")
        return num_blocks

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + new tokens) the pool can hold at all."""
        return min(
            self.allocator.num_blocks * self.allocator.block_size, self.decoder.config.max_position_embeddings
        )

    def add(self, prompt: list[int], params: SamplingParams, matcher: Any = None) -> Sequence:
        """Queues ``prompt``; ``matcher`` (``Grammars.matcher``) constrains what it generates."""
        if not prompt:
            raise ValueError("prompt: must not be empty")
        vocab = self.decoder.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_sequence_tokens:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"{self.max_sequence_tokens} positions this server's KV cache can give one sequence"
            )
        seq = Sequence(next(self._ids), list(prompt), params, matcher=matcher)
        self._generators[seq.id] = new_generator(params)
        self._counts[seq.id] = torch.zeros(vocab, dtype=torch.int64)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq.status != "finished":
            self._finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.allocator.used_fraction

    def step(self) -> list[Event]:
        plan = self.scheduler.schedule()
        self.last_step_sequences = len(plan)
        if not plan:
            return []
        hidden_size = self.decoder.config.hidden_size
        work = [row_work(want, seq.num_computed + want, hidden_size) for seq, want in plan]
        count = self.auto.count(len(plan)) if self.auto is not None else int(self.options.micro_batches)
        groups = split_rows(work, count)
        started = time.monotonic()
        try:
            hiddens = self.decoder.hidden_micro_batches([self._micro_batch(plan, rows) for rows in groups])
            with torch.inference_mode():
                parts = []
                for rows, hidden in zip(groups, hiddens, strict=True):  # hidden [B_i, S_i, H]
                    last = torch.tensor([plan[row][1] - 1 for row in rows])
                    parts.append(self.decoder.side.logits(hidden[torch.arange(len(rows)), last]))  # [B_i, V]
                    for i, row in enumerate(rows):  # prompt positions' logits from the same pass
                        if self._to_score(*plan[row]):
                            self._score_prompt(plan[row][0], plan[row][1], hidden[i])
                order = torch.tensor([row for rows in groups for row in rows])
                logits = torch.cat(parts)[order.argsort()]  # [B, V] in the plan's row order
        except Exception as exc:  # the sequences of this step cannot go on; the others can
            for seq, _ in plan:
                self._finish(seq, "error")
            raise StepFailed([seq for seq, _ in plan], exc) from exc
        if self.auto is not None:
            self._observe(len(groups), len(plan), time.monotonic() - started)
        ready = []
        finished: list[Event] = []
        for row, (seq, want) in enumerate(plan):
            seq.num_computed += want
            if self.allocator.uncommitted(seq.id, seq.num_computed):  # it filled a block: name it
                self.allocator.commit(seq.id, seq.tokens, seq.num_computed)
            if seq.pending == 0 and seq.params.max_tokens == 0:  # the prompt scored: all it asked
                self._finish(seq, "length")
                finished.append(Event(seq, None, True))
            elif seq.pending == 0:  # caught up: the row's logits predict its next token
                ready.append((row, seq))
        events = finished
        if not ready:
            return events
        for (_, seq), choice in self._sample(ready, logits, events):
            self._take(seq, choice, events)
        return events

    def _observe(self, count: int, rows: int, seconds: float) -> None:
        """Tells ``auto`` what a step took; logs the count it picks after its trials."""
        assert self.auto is not None
        trying = self.auto.trying
        self.auto.observe(count, rows, seconds)
        if trying and not self.auto.trying:
            measured = ", ".join(f"{m}: {1e3 * s:.2f}" for m, s in self.auto.last_pick.items())
            log.info("micro-batches auto: %d (ms per row of a step with %s)", self.auto.chosen, measured)

    def _micro_batch(self, plan: list[tuple[Sequence, int]], rows: list[int]) -> MicroBatch:
        """The decoder's input for ``rows`` of ``plan``: their chunks right-padded, their cache."""
        steps = max(plan[row][1] for row in rows)
        tokens = torch.zeros(len(rows), steps, dtype=torch.int64)  # [B_i, S_i]
        for i, row in enumerate(rows):
            seq, want = plan[row]
            tokens[i, :want] = torch.tensor(seq.tokens[seq.num_computed : seq.num_computed + want])
        view = PagedView(
            self.pool,
            [self.allocator.tables[plan[row][0].id] for row in rows],
            [plan[row][0].num_computed for row in rows],
            steps,
        )
        return MicroBatch(tokens, torch.tensor([plan[row][1] for row in rows], dtype=torch.int64), view)

    def _sample(
        self, ready: list[tuple[int, Sequence]], logits: torch.Tensor, events: list[Event]
    ) -> list[tuple[tuple[int, Sequence], Sampled]]:
        """One token for each ready row (``logits`` [B, V]), the rows sampled together. When that
        fails, each row is sampled alone (its generator as it was before the batch's attempt), so
        a failure tied to one row (its parameters, its grammar's matcher, NaN logits) fails that
        sequence only: it finishes with ``error`` and an event, and the other rows go on."""
        # Kept only where a failure would resample rows alone (a single row just fails).
        states = {seq.id: self._generators[seq.id].get_state() for _, seq in ready} if len(ready) > 1 else {}
        try:
            return self._sample_rows(ready, logits, events)
        except Exception as exc:
            if len(ready) == 1:
                self._fail(ready[0][1], f"sampling failed: {exc!r}", events)
                return []
        log.warning("sampling a step of %d sequences failed: each sampled alone", len(ready))
        sampled = []
        for row, seq in ready:
            if seq.status == "finished":  # its grammar allowed nothing (an event is out already)
                continue
            self._generators[seq.id].set_state(states[seq.id])
            try:
                sampled += self._sample_rows([(row, seq)], logits, events)
            except Exception as exc:
                self._fail(seq, f"sampling failed: {exc!r}", events)
        return sampled

    def _sample_rows(
        self, ready: list[tuple[int, Sequence]], logits: torch.Tensor, events: list[Event]
    ) -> list[tuple[tuple[int, Sequence], Sampled]]:
        ready, allowed = self._constrain(ready, events)
        if not ready:
            return []
        sampled = sample(
            logits[[row for row, _ in ready]],
            [seq.params for _, seq in ready],
            [self._generators[seq.id] for _, seq in ready],
            [self._counts[seq.id] for _, seq in ready],
            allowed,
        )
        return list(zip(ready, sampled, strict=True))

    def _take(self, seq: Sequence, choice: Sampled, events: list[Event]) -> None:
        """Appends the sampled token to ``seq`` (its grammar consumes it) and finishes ``seq`` where
        it ends."""
        seq.output.append(choice.token)
        self._counts[seq.id][choice.token] += 1
        reason = None
        if seq.matcher is not None:
            try:
                accepted = seq.matcher.consume_token(choice.token)
            except Exception as exc:  # the grammar engine failed on this sequence: it alone ends
                self._fail(seq, f"structured outputs: the grammar engine failed: {exc!r}", events, choice)
                return
            if not accepted:
                why = first_line(seq.matcher.get_error())
                reason, seq.error = (
                    "error",
                    f"structured outputs: the grammar refused token {choice.token}: {why}",
                )
            elif seq.matcher.is_stopped():
                reason = "stop"  # the grammar is complete (or the model ended where it may)
        if reason is None and choice.token in seq.params.stop_token_ids:
            reason = "stop"
        elif reason is None and len(seq.output) >= seq.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        events.append(Event(seq, choice, reason is not None))

    def _fail(self, seq: Sequence, error: str, events: list[Event], sampled: Sampled | None = None) -> None:
        """Finishes ``seq`` with ``error`` for a fault of the server (not of the request)."""
        seq.error, seq.server_fault = error, True
        self._finish(seq, "error")
        events.append(Event(seq, sampled, True))

    @staticmethod
    def _to_score(seq: Sequence, want: int) -> bool:
        """Whether this step's chunk of ``seq`` holds prompt positions still to score."""
        if seq.params.prompt_logprobs is None:
            return False
        return (
            seq.num_computed + want > len(seq.prompt_logprobs)
            and len(seq.prompt_logprobs) < len(seq.prompt) - 1
        )

    # Positions scored at once: bounds the [positions, V] log-softmax of a long prefill chunk.
    SCORE_POSITIONS = 256

    def _score_prompt(self, seq: Sequence, want: int, hidden: torch.Tensor) -> None:
        """Appends the prompt tokens this chunk predicts to ``seq.prompt_logprobs``; hidden [S, H]
        is the row's. Position p's logits predict token p + 1; a sequence recomputed after a
        preemption skips the positions it already has."""
        start = seq.num_computed
        first = len(seq.prompt_logprobs)  # the next position to score (it predicts token first + 1)
        end = min(start + want, len(seq.prompt) - 1)
        num_top = seq.params.prompt_logprobs or 0
        for lo in range(first, end, self.SCORE_POSITIONS):
            hi = min(lo + self.SCORE_POSITIONS, end)
            logits = self.decoder.side.logits(hidden[lo - start : hi - start])  # [T, V]
            following = torch.tensor(seq.prompt[lo + 1 : hi + 1], dtype=torch.int64)  # [T]
            seq.prompt_logprobs += score(logits, following, num_top)

    def _constrain(
        self, ready: list[tuple[int, Sequence]], events: list[Event]
    ) -> tuple[list[tuple[int, Sequence]], torch.Tensor | None]:
        """The rows to sample and their allowed tokens (None: no row has a grammar). A row whose
        grammar failed (a limit of the grammar engine) or allows nothing finishes with ``error``."""
        constrained = [i for i, (_, seq) in enumerate(ready) if seq.matcher is not None]
        if not constrained:
            return ready, None
        masks = allowed_tokens([ready[i][1].matcher for i in constrained], self.decoder.config.vocab_size)
        allowed = torch.ones(len(ready), masks.shape[1], dtype=torch.bool)
        allowed[constrained] = masks
        failed = [i for i in constrained if ready[i][1].matcher.is_error() or not allowed[i].any()]
        if not failed:
            return ready, allowed
        for i in failed:
            seq = ready[i][1]
            seq.error = (
                f"structured outputs: the grammar allows no next token after {len(seq.output)} tokens "
                f"({first_line(seq.matcher.get_error())})"
            )
            self._finish(seq, "error")
            events.append(Event(seq, None, True))
        keep = [i for i in range(len(ready)) if i not in set(failed)]
        return [ready[i] for i in keep], allowed[keep]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = "finished"
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._generators.pop(seq.id, None)
        self._counts.pop(seq.id, None)
