"""A local EaaS run: expert-server processes, attention clients, optional SIGKILL mid-generation.

``run_local`` is what ``eaas local`` (and ``make demo``) executes; it returns everything the CLI
prints, so tests can check it without parsing text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaas.runtime.client import AttentionClient, ClientOptions, FailoverEvent
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import MoEExecutor
from eaas.runtime.model.decoder import start_experts
from eaas.runtime.placement import Placement

DEMO_PROMPTS = (
    "Experts as a service",
    "Mixture of experts models route each token",
    "Kubernetes schedules pods",
    "An expert server is stateless",
    "Attention keeps the KV cache",
    "Failover resends the share",
    "Scale one GPU at a time",
    "Shared memory slots",
)


class StepHook:
    """Wraps a ``MoEExecutor`` and calls ``on_step(step)`` when a forward pass reaches its first MoE layer."""

    def __init__(self, inner: MoEExecutor, first_moe_layer: int, on_step: Callable[[int], None]) -> None:
        self.inner = inner
        self.first_moe_layer = first_moe_layer
        self.on_step = on_step
        self.step = -1

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if layer == self.first_moe_layer:
            self.step += 1
            self.on_step(self.step)
        return self.inner(layer, x, expert_ids, weights)

    def submit(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """The same, for micro-batches (one call per micro-batch reaching the layer)."""
        if layer == self.first_moe_layer:
            self.step += 1
            self.on_step(self.step)
        return start_experts(self.inner, layer, x, expert_ids, weights)

    @staticmethod
    def wait(ticket: Callable[[], torch.Tensor]) -> torch.Tensor:
        return ticket()


@dataclass
class KillPlan:
    """SIGKILL server ``ordinal`` when the first client reaches decode step ``after_steps``."""

    after_steps: int
    ordinal: int
    done_at: float | None = None
    pid: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ClientRun:
    prompts: list[list[int]]
    tokens: list[list[int]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    seconds: float = 0.0
    events: list[FailoverEvent] = field(default_factory=list)
    error: BaseException | None = None


def run_clients(
    checkpoint: Path,
    placement: Placement,
    cluster: LocalCluster,
    prompt_batches: Sequence[list[list[int]]],
    max_new_tokens: int,
    options: ClientOptions,
    kill: KillPlan | None = None,
    timeout_s: float = 600.0,
) -> list[ClientRun]:
    """One attention client per prompt batch, all generating at once (threads)."""
    runs = [ClientRun(batch) for batch in prompt_batches]
    clients = [AttentionClient(checkpoint, placement, cluster.urls, options) for _ in runs]
    first_moe = clients[0].config.moe_layers[0]

    def maybe_kill(step: int) -> None:
        if kill is None or step != kill.after_steps:
            return
        with kill.lock:
            if kill.done_at is None:
                kill.pid = cluster.servers[kill.ordinal].pid
                cluster.kill(kill.ordinal)
                kill.done_at = time.time()

    def work(client: AttentionClient, run: ClientRun) -> None:
        try:
            client.decoder.experts = StepHook(client.experts, first_moe, maybe_kill)
            start = time.perf_counter()
            run.tokens, run.logits = client.generate(run.prompts, max_new_tokens)
            run.seconds = time.perf_counter() - start
            run.events = list(client.experts.events)
        except BaseException as exc:  # reported by the caller
            run.error = exc

    try:
        for client in clients:
            client.connect()
        threads = [
            threading.Thread(target=work, args=pair, daemon=True) for pair in zip(clients, runs, strict=True)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            raise TimeoutError(f"generation did not finish within {timeout_s:.0f} s")
    finally:
        for client in clients:
            client.close()
    return runs
