"""One server step's compute: validated requests (possibly of different layers) → one expert call.

Every request's ids are already mapped to hosted groups, and groups are unique over layers, so
requests of different layers share one ``experts_forward`` call: concatenate tokens, pad top-k,
compute, split. Legend: T = tokens of a request, N = tokens of the batch, K = top-k, H = hidden.
"""

from __future__ import annotations

import time
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


def warm_up(stack: ExpertStack, backend: str, max_tokens: int | None = None) -> float:
    """Runs every hosted expert once, as a batch of one token each and as one decode-shaped token
    of top-k entries, so that the first real request finds the weights paged in (a checkpoint is
    memory-mapped), the backend's kernels compiled and the allocator warm, rather than stalling
    every client's step behind a server that has just joined (Triton on an H200 compiled for
    4.8 s on its first call: docs/benchmarks.md). With the ``triton`` backend on a GPU, also one
    batch of top-k-wide tokens per tile configuration the server can pick for up to ``max_tokens``
    tokens (each is a kernel of its own). Returns the seconds it took."""
    started = time.perf_counter()
    groups = len(stack.pairs)
    if groups == 0:
        return 0.0
    device = stack.w13.device
    hidden = stack.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    top_k = min(stack.config.top_k, groups)
    shapes = [
        torch.arange(groups).unsqueeze(1),  # [G, 1]: one token per expert
        torch.arange(top_k).unsqueeze(0),  # [1, K]: a decode step's token
    ]
    if backend == "triton" and device.type == "cuda" and max_tokens:  # n tokens of top-k entries each
        spread = torch.arange(top_k).unsqueeze(0)
        shapes += [(torch.arange(n).unsqueeze(1) + spread) % groups for n in _tile_buckets(stack, max_tokens)]
    with torch.no_grad():
        for group_of in shapes:
            tokens, k = group_of.shape
            x = (0.01 * torch.randn(tokens, hidden, generator=generator)).to(device, stack.compute_dtype)
            weights = torch.full((tokens, k), 1.0 / k, device=device)
            stack.forward(x, group_of.to(device), weights, backend)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _tile_buckets(stack: ExpertStack, max_tokens: int) -> list[int]:
    """A token count for each distinct (gate_up, down) tile configuration of the Triton backend
    for up to ``max_tokens`` tokens of this stack's shape on its GPU."""
    from eaas.kernels.configs import select_configs, token_buckets
    from eaas.kernels.triton_env import device_name

    name = device_name(stack.w13.device)
    hidden, inter = stack.w13.shape[2], stack.w13.shape[1] // 2
    seen, counts = set(), []
    for bucket in token_buckets(name, hidden, inter):
        configs = select_configs(name, hidden, inter, min(bucket, max_tokens))
        if configs not in seen:
            seen.add(configs)
            counts.append(min(bucket, max_tokens))
    return counts
