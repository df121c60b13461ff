"""Per-(layer, expert) token counts: what the operator's placement planner consumes.

They travel through the JSON stats endpoint, not Prometheus labels (one series per expert would
explode Prometheus's series count).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


class LoadCounter:
    """Tokens routed to each (layer, expert) of this server since start. Shapes: L layers, E experts."""

    def __init__(self, num_layers: int, num_experts: int, device: str | torch.device = "cpu") -> None:
        self._tokens = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._lock = threading.Lock()
        self.started_at = time.time()

    def add(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Counts one token for every id >= 0 in ``expert_ids`` [T, K] of ``layer`` (no host sync)."""
        ids = expert_ids.reshape(-1).to(device=self._tokens.device, dtype=torch.int64)
        valid = (ids >= 0).to(torch.int64)
        with self._lock:
            self._tokens[layer].index_add_(0, ids.clamp(min=0), valid)

    def total(self) -> int:
        """(token, expert) entries counted since start, over every layer and expert."""
        with self._lock:
            return int(self._tokens.sum())

    def snapshot(self) -> torch.Tensor:
        """A copy of the counts [L, E] (in host memory)."""
        with self._lock:
            return self._tokens.to("cpu", copy=True)

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
