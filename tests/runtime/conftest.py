"""Fixtures of the data-path tests: reference generations of the tiny checkpoints, computed once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_helpers import MAX_NEW_TOKENS, PROMPTS

from eaas.runtime.model import load_reference


@pytest.fixture(scope="session")
def reference_outputs(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    """family -> (tokens, logits) of the monolithic reference on ``PROMPTS``."""
    return {
        family: load_reference(path).generate(PROMPTS, MAX_NEW_TOKENS)
        for family, path in tiny_checkpoints.items()
    }
