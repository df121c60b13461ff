"""The monolithic reference model: attention side + every expert in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from eaas.runtime.model.attention_side import AttentionSide
from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.decoder import Decoder
from eaas.runtime.model.expert_side import LocalExperts


def load_reference(
    checkpoint: str | Path, dtype: torch.dtype | None = None, backend: str = "torch", attention: str = "paged"
) -> Decoder:
    """A ``Decoder`` with all experts local: the model every distributed path must equal.
    ``attention``: ``paged`` (in place) or ``reference`` (``attention.PATHS``)."""
    reader = CheckpointReader(checkpoint)
    side = AttentionSide.from_checkpoint(reader, dtype=dtype, attention=attention)
    return Decoder(side, LocalExperts.from_checkpoint(reader, dtype=dtype, backend=backend))
