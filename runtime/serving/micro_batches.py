"""Cutting a step's rows into micro-batches of about equal work (``Engine`` pipelines them).

A row's work is its new tokens through every linear layer and the experts, plus attention over
its context for each of them; rows are dealt to the micro-batch with the least work so far, the
heaviest first (LPT), so a long prefill chunk sits alone while decodes fill the others. A row is
never cut: a micro-batch of one prefill chunk can outweigh the rest.

``AutoMicroBatches`` (``--micro-batches auto``) picks the count by measuring: it runs each count
for a few steps, keeps the one with the least time per token, and measures again now and then;
a count must beat 1 by more than ``margin`` to be kept, so auto is not slower than 1 by more than
the noise of its own trials.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

CHOICES = (1, 2, 3)  # micro-batches a step may be cut into ("auto" picks one of them)
AUTO = "auto"


def row_work(new_tokens: int, context: int, hidden_size: int) -> float:
    """Work of one row, in units of one token through the linear layers: those take about
    4 x hidden^2 multiply-adds per token (q, k, v, o), attention 2 x hidden per token and position
    it reads (q.k and the weighted v), so a position of context weighs 1 / (2 x hidden) of a token."""
    return new_tokens * (1.0 + context / (2.0 * hidden_size))


def split_rows(work: Sequence[float], micro_batches: int) -> list[list[int]]:
    """Row indices per micro-batch (each in row order, none empty; fewer than ``micro_batches``
    when there are fewer rows), balanced in ``work`` by largest-first greedy assignment."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches: must be >= 1, got {micro_batches}")
    count = min(micro_batches, len(work))
    if count <= 1:
        return [list(range(len(work)))] if work else []
    loads = [0.0] * count
    groups: list[list[int]] = [[] for _ in range(count)]
    for row in sorted(range(len(work)), key=lambda r: (-work[r], r)):
        lightest = min(range(count), key=lambda g: (loads[g], g))
        groups[lightest].append(row)
        loads[lightest] += work[row]
    return [sorted(group) for group in groups]


class AutoMicroBatches:
    """Picks the micro-batch count from measured step times (seconds per row of a step).

    Trials: each count in ``CHOICES`` for ``trial_steps`` steps with at least that many rows, in
    turns (3 only when 2 beat 1: a round trip that 2 cannot hide at all is one 3 cannot either);
    then the count with the least median seconds per row (1 unless another beats it by more than
    ``margin``) for ``keep_steps`` steps; then trials again (the load may have changed)."""

    def __init__(self, trial_steps: int = 6, keep_steps: int = 500, margin: float = 0.03) -> None:
        self.trial_steps = trial_steps
        self.keep_steps = keep_steps
        self.margin = margin
        self.chosen = 1
        self.per_row: dict[int, list[float]] = {m: [] for m in CHOICES}
        self._kept = 0
        self._skipped: set[int] = set()  # counts the trials leave out this time
        self.last_pick: dict[int, float] = {}  # count -> median seconds per row of the last trials

    @property
    def trying(self) -> bool:
        return any(
            len(samples) < self.trial_steps for m, samples in self.per_row.items() if m not in self._skipped
        )

    def count(self, rows: int) -> int:
        """The count for a step of ``rows`` rows."""
        if self.trying:
            for m in CHOICES:  # the first count short of samples that this step can give one
                if len(self.per_row[m]) < self.trial_steps and m <= rows and m not in self._skipped:
                    return m
        return min(self.chosen, max(rows, 1))

    def observe(self, count: int, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows cut into ``count`` micro-batches took ``seconds``."""
        if rows < 1:
            return
        if self.trying:
            if count <= rows and len(self.per_row[count]) < self.trial_steps:
                self.per_row[count].append(seconds / rows)
            tried_two = count == 2 and len(self.per_row[2]) == self.trial_steps == len(self.per_row[1])
            if tried_two and self._median(2) >= self._median(1) * (1 - self.margin):
                self._skipped = {m for m in CHOICES if m > 2}  # 2 did not beat 1
            if not self.trying:
                self._pick()
            return
        self._kept += 1
        if self._kept >= self.keep_steps:
            self.per_row = {m: [] for m in CHOICES}
            self._kept = 0
            self._skipped = set()

    def _median(self, count: int) -> float:
        return statistics.median(self.per_row[count])

    def _pick(self) -> None:
        medians = {m: self._median(m) for m in CHOICES if m not in self._skipped}
        best = min(medians, key=lambda m: medians[m])
        self.chosen = best if medians[best] < medians[1] * (1 - self.margin) else 1
        self.last_pick = medians
