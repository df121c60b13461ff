"""Shared fixtures: tiny random checkpoints, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaas.runtime.model import FAMILIES, preset, write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of a tiny random checkpoint (sharded, so the index path is exercised)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        family: write_random_checkpoint(preset(family), root / family, seed=7, max_shard_bytes=256 * 1024)
        for family in FAMILIES
    }
