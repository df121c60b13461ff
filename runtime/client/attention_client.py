"""``AttentionClient``: the reference ``Decoder`` with its MoE layers served by remote expert servers.

    with AttentionClient(checkpoint, placement, {0: "http://127.0.0.1:8001", ...}) as client:
        tokens, logits = client.generate(prompts, max_new_tokens=16)

It loads only the attention side of the checkpoint (embeddings, attention, router, shared
expert, LM head); the routed experts live on the servers. Its output equals the monolithic
reference (``load_reference``) up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from eaas.runtime.client.remote_experts import ClientOptions, RemoteExperts
from eaas.runtime.model import AttentionSide, CheckpointReader, Decoder
from eaas.runtime.placement import Placement


class AttentionClient:
    def __init__(
        self,
        checkpoint: str | Path,
        placement: Placement,
        servers: Mapping[int, str],
        options: ClientOptions | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        reader = CheckpointReader(checkpoint)
        self.config = reader.config
        self.experts = RemoteExperts(self.config, placement, servers, options)
        self.decoder = Decoder(AttentionSide.from_checkpoint(reader, dtype=dtype), self.experts)

    def connect(self, require_all: bool = True) -> AttentionClient:
        self.experts.connect(require_all=require_all)
        return self

    def close(self) -> None:
        self.experts.close()

    def __enter__(self) -> AttentionClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Greedy generation (see ``Decoder.generate``): token ids per prompt, logits [steps, B, V]."""
        return self.decoder.generate(prompts, max_new_tokens)
