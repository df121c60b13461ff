"""One server step's compute: validated requests (possibly of different layers) → one expert call.

Every request's ids are already mapped to hosted groups, and groups are unique over layers, so
requests of different layers share one ``experts_forward`` call: concatenate tokens, pad top-k,
compute, split. Legend: T = tokens of a request, N = tokens of the batch, K = top-k, H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaas.runtime.model import ExpertStack
from eaas.runtime.transport import Request


@dataclass
class Job:
    """A validated request and views of its payload."""

    request: Request
    x: torch.Tensor  # [T, H], request dtype (aliases the slot)
    groups: torch.Tensor  # [T, K] int64 hosted group per entry, -1 = skip
    weights: torch.Tensor  # [T, K] float32
    expert_ids: torch.Tensor  # [T, K] int32 (for load statistics)


def compute_batch(jobs: list[Job], stack: ExpertStack, backend: str) -> list[torch.Tensor]:
    """The weighted expert sum of every job: a list of y [T, H] in each job's dtype (new tensors)."""
    if not jobs:
        return []
    compute_dtype = stack.compute_dtype
    if len(jobs) == 1:
        job = jobs[0]
        y = stack.forward(job.x.to(compute_dtype), job.groups, job.weights, backend)
        return [y.to(job.x.dtype)]
    top_k = max(job.groups.shape[1] for job in jobs)
    x = torch.cat([job.x.to(compute_dtype) for job in jobs])  # [N, H]
    groups = torch.cat([_pad(job.groups, top_k, -1) for job in jobs])  # [N, K]
    weights = torch.cat([_pad(job.weights, top_k, 0.0) for job in jobs])  # [N, K]
    y = stack.forward(x, groups, weights, backend)  # [N, H]
    sizes = [job.x.shape[0] for job in jobs]
    return [part.to(job.x.dtype) for part, job in zip(torch.split(y, sizes), jobs, strict=True)]


def _pad(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """[T, k] -> [T, width] padded with ``value``."""
    if t.shape[1] == width:
        return t
    out = torch.full((t.shape[0], width), value, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out
