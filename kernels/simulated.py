"""A simulated accelerator: the reference expert computation, stretched to a modelled device time.

``simulated:EXPERT_US:ENTRY_US`` computes what ``torch`` computes (the answers stay right), then
sleeps until the batch has taken ``EXPERT_US`` microseconds per distinct group it reads (an
expert's weights, read once) plus ``ENTRY_US`` per routed (token, expert) entry. A sleep holds no
core, so on a machine without GPUs n server processes have n times the device time, and a server's
busy fraction follows the tokens it is sent, as on a GPU, instead of the fixed cost of a step of a
tiny CPU model. It is for capacity tests (the autoscaling drills, ``benchmarks/autoscale_trace.py``)
and never for serving: it is slow on purpose.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eaas.kernels.reference import experts_forward_reference

NAME = "simulated"


def simulated_device(expert_s: float, entry_s: float) -> Any:
    """An ``experts_forward`` backend taking ``expert_s`` per distinct group plus ``entry_s`` per
    routed entry (seconds; at least its real compute time)."""

    def forward(
        x: torch.Tensor,  # [T, H]
        group_of: torch.Tensor,  # [T, K] int, -1 = none
        weight_of: torch.Tensor,  # [T, K]
        w13: torch.Tensor,
        w2: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor:  # [T, H]
        started = time.perf_counter()
        y = experts_forward_reference(x, group_of, weight_of, w13, w2, **kw)
        routed = group_of[group_of >= 0]  # [N]
        modelled = expert_s * torch.unique(routed).numel() + entry_s * routed.numel()
        time.sleep(max(0.0, modelled - (time.perf_counter() - started)))
        return y

    return forward


def from_arguments(arguments: str) -> Any:
    """The backend named ``simulated:<arguments>``: ``EXPERT_US:ENTRY_US``, two numbers >= 0."""
    usage = f"kernel backend '{NAME}:{arguments}': expected {NAME}:EXPERT_US:ENTRY_US (microseconds >= 0)"
    parts = arguments.split(":")
    try:
        expert_us, entry_us = (float(part) for part in parts)
    except ValueError:
        raise ValueError(usage) from None
    if not (0 <= expert_us < 1e7 and 0 <= entry_us < 1e7):
        raise ValueError(usage)
    return simulated_device(expert_us * 1e-6, entry_us * 1e-6)
