"""The decoder loop shared by the monolithic reference and the attention client.

``Decoder`` runs the attention side and hands each MoE layer's routed-expert work to a
``MoEExecutor``: in-process experts for the reference, remote expert servers for EaaS.

Micro-batches (``hidden_micro_batches``): a step's batch cut into m independent batches, each
with its own cache, run layer by layer in turn on this one thread. An executor that can start an
exchange and return (``submit``/``wait``, as ``RemoteExperts`` does) computes micro-batch i's
experts of layer l while micro-batch i + 1 runs attention of layer l; each row's numbers are the
ones an unsplit batch gives it. An executor without ``submit`` is called where ``submit`` would be.
Legend: B = batch, S = new tokens per sequence, T = valid tokens, H = hidden, K = top-k, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from eaas.runtime.model.attention_side import AttentionSide
from eaas.runtime.model.kv_cache import Cache, KVCache


class MoEExecutor(Protocol):
    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert output [T, H] for x [T, H], expert ids [T, K], router weights [T, K]."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: its rows' new tokens and the cache of those rows."""

    tokens: torch.Tensor  # [B, S] int64, right-padded
    num_new: torch.Tensor  # [B] valid tokens per row (>= 1)
    cache: Cache


def start_experts(
    experts: MoEExecutor, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """Starts ``experts`` on one layer's x [T, H] (expert ids [T, K], router weights [T, K]);
    returns what gives the routed output [T, H]. An executor with ``submit``/``wait`` computes
    while the caller goes on; any other is called now."""
    submit = getattr(experts, "submit", None)
    if submit is None:
        y = experts(layer, x, expert_ids, weights)
        return lambda: y
    ticket = submit(layer, x, expert_ids, weights)
    wait: Callable[[Any], torch.Tensor] = experts.wait  # type: ignore[attr-defined]
    return lambda: wait(ticket)


class Decoder:
    """Forward passes and greedy generation over an attention side and a MoE executor."""

    def __init__(self, side: AttentionSide, experts: MoEExecutor) -> None:
        self.side = side
        self.config = side.config
        self.experts = experts

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.config, batch_size, max_len, dtype=self.side.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, S] int64, right-padded
        num_new: torch.Tensor,  # [B] valid tokens per row (>= 1)
        cache: Cache,
        all_logits: bool = False,
    ) -> torch.Tensor:  # [B, V] logits of each row's last valid token, or [B, S, V]
        h = self.hidden(tokens, num_new, cache)  # [B, S, H]
        if all_logits:
            return self.side.logits(h)
        return self.side.logits(h[torch.arange(tokens.shape[0]), num_new - 1])

    @torch.inference_mode()
    def hidden(
        self,
        tokens: torch.Tensor,  # [B, S] int64, right-padded
        num_new: torch.Tensor,  # [B] valid tokens per row (>= 1)
        cache: Cache,
    ) -> torch.Tensor:  # [B, S, H] the last layer's output (``side.logits`` turns it into logits)
        """The forward pass up to the final norm: callers that need the logits of more positions
        than each row's last (prompt log-probabilities) take them from here."""
        return self.hidden_micro_batches([MicroBatch(tokens, num_new, cache)])[0]

    @torch.inference_mode()
    def hidden_micro_batches(self, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """``hidden`` of each micro-batch ([B_i, S_i, H] each), the micro-batches pipelined: at
        every layer each runs its attention and starts its experts, then the next one does while
        they compute; a micro-batch's expert answer is taken just before its next layer."""
        states = []
        for batch in batches:
            tokens, num_new = batch.tokens, batch.num_new
            rows, steps = tokens.shape
            if rows == 0 or steps == 0:
                raise ValueError("forward needs at least one sequence and one token")
            if int(num_new.min()) < 1 or int(num_new.max()) > steps:
                raise ValueError(f"num_new must be in [1, {steps}] for every sequence")
            batch.cache.check_room(steps)
            valid = torch.arange(steps) < num_new[:, None]  # [B, S]
            states.append((self.side.embed(tokens), valid))  # [B, S, H]
        pending: list[Callable[[], torch.Tensor] | None] = [None] * len(batches)
        for layer in range(self.config.num_layers):
            for i, (batch, (h, valid)) in enumerate(zip(batches, states, strict=True)):
                finish = pending[i]
                if finish is not None:  # the previous layer's FFN of this micro-batch
                    h[valid] += finish()
                h = self.side.attention(layer, h, batch.cache)
                states[i] = (h, valid)
                pending[i] = self.start_ffn(layer, self.side.ffn_norm(layer, h)[valid])  # x [T, H]
        for (h, valid), finish, batch in zip(states, pending, batches, strict=True):
            assert finish is not None
            h[valid] += finish()
            batch.cache.advance(batch.num_new)
        return [h for h, _ in states]

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The FFN half of ``layer`` for valid tokens x [T, H] -> [T, H]."""
        return self.start_ffn(layer, x)()

    def start_ffn(self, layer: int, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts the FFN half of ``layer`` for valid tokens x [T, H]: the routed experts are
        started first, the shared expert computed while they run; the result gives [T, H]."""
        if not self.config.is_moe_layer(layer):
            y = self.side.dense_ffn(layer, x)
            return lambda: y
        expert_ids, weights = self.side.route(layer, x)
        routed = start_experts(self.experts, layer, x, expert_ids, weights)
        shared = self.side.shared_expert(layer, x)
        return routed if shared is None else lambda: routed() + shared

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Greedy generation for a batch of prompts.

        Returns the generated token ids of each prompt and the logits of every step
        [steps, B, V] (step 0 is the prefill), so callers can compare runs exactly.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        cache = self.new_cache(batch, longest + max_new_tokens)
        tokens = torch.zeros(batch, longest, dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
        num_new = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        step_logits = []
        generated: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            logits = self.forward(tokens, num_new, cache)  # [B, V]
            step_logits.append(logits)
            next_tokens = logits.argmax(dim=-1)  # [B]
            for row, token in enumerate(next_tokens.tolist()):
                generated[row].append(token)
            if step + 1 < max_new_tokens:
                tokens = next_tokens[:, None]
                num_new = torch.ones(batch, dtype=torch.int64)
        return generated, torch.stack(step_logits)
