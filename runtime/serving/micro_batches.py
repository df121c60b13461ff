"""Cutting a step's rows into micro-batches of about equal work (``Engine`` pipelines them).

A row's work is its new tokens through every linear layer and the experts, plus attention over
its context for each of them; rows are dealt to the micro-batch with the least work so far, the
heaviest first (LPT), so a long prefill chunk sits alone while decodes fill the others. A row is
never cut: a micro-batch of one prefill chunk can outweigh the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

CHOICES = (1, 2, 3)  # micro-batches a step may be cut into ("auto" picks one of them)


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
