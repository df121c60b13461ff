"""The decoder loop shared by the monolithic reference and the attention client.

``Decoder`` runs the attention side and hands each MoE layer's routed-expert work to a
``MoEExecutor``: in-process experts for the reference, remote expert servers for EaaS.
Legend: B = batch, S = new tokens per sequence, T = valid tokens, H = hidden, K = top-k, V = vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from eaas.runtime.model.attention_side import AttentionSide
from eaas.runtime.model.kv_cache import Cache, KVCache


class MoEExecutor(Protocol):
    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert output [T, H] for x [T, H], expert ids [T, K], router weights [T, K]."""
        ...


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
        batch, steps = tokens.shape
        if batch == 0 or steps == 0:
            raise ValueError("forward needs at least one sequence and one token")
        if int(num_new.min()) < 1 or int(num_new.max()) > steps:
            raise ValueError(f"num_new must be in [1, {steps}] for every sequence")
        cache.check_room(steps)
        valid = torch.arange(steps) < num_new[:, None]  # [B, S]
        h = self.side.embed(tokens)  # [B, S, H]
        for layer in range(self.config.num_layers):
            h = self.side.attention(layer, h, cache)
            x = self.side.ffn_norm(layer, h)[valid]  # [T, H]
            h[valid] += self.ffn(layer, x)
        cache.advance(num_new)
        return h

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The FFN half of ``layer`` for valid tokens x [T, H] -> [T, H]."""
        if not self.config.is_moe_layer(layer):
            return self.side.dense_ffn(layer, x)
        expert_ids, weights = self.side.route(layer, x)
        y = self.experts(layer, x, expert_ids, weights)
        shared = self.side.shared_expert(layer, x)
        return y if shared is None else y + shared

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
