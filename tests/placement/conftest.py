"""Fixtures for the placement tests (helpers live in placement_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from placement_helpers import domain_servers, trace_load

from eaas.runtime.placement import Placement, round_robin


@pytest.fixture
def small() -> tuple[Placement, np.ndarray]:
    """4 layers x 16 experts on 8 servers (2 domains), R=2, 50% spare slots, skewed load."""
    servers = domain_servers(8, capacity=24, num_domains=2)
    placement = round_robin([3, 4, 5, 6], 16, servers, replication=2)
    return placement, trace_load(4, 16, seed=3)
