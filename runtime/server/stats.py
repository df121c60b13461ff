"""Per-(layer, expert) token counts: what the operator's placement planner consumes.

They travel through the JSON stats endpoint, not Prometheus labels (one series per expert would
explode Prometheus; CONVENTIONS.md, "Metrics").
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


class LoadCounter:
    """Tokens routed to each (layer, expert) of this server since start. Shapes: L layers, E experts."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self._tokens = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self._lock = threading.Lock()
        self.started_at = time.time()

    def add(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Counts one token for every id >= 0 in ``expert_ids`` [T, K] of ``layer``."""
        ids = expert_ids.reshape(-1).to(torch.int64)
        ids = ids[ids >= 0]
        if ids.numel():
            counts = torch.bincount(ids, minlength=self._tokens.shape[1])
            with self._lock:
                self._tokens[layer] += counts

    def snapshot(self) -> torch.Tensor:
        """A copy of the counts [L, E]."""
        with self._lock:
            return self._tokens.clone()

    def to_json(self, layers: list[int]) -> dict[str, Any]:
        """``{"layers": [...], "tokens": [[per expert] per layer], ...}``, rows in ``layers`` order."""
        tokens = self.snapshot()
        return {
            "since_unix_s": self.started_at,
            "layers": layers,
            "num_experts": int(tokens.shape[1]),
            "tokens": tokens[layers].tolist(),
            "total_tokens": int(tokens.sum()),
        }
