"""The placement ConfigMap fits at users' scale: committed and pending placements of DeepSeek-V3
(58 MoE layers x 256 experts) and Kimi-K2 (60 x 384) at R = 2, 3, 4 on 64 and 320 expert servers,
planned by the operator's planner, with room to spare under the API server's 1 MiB."""

from __future__ import annotations

import pytest

from eaas.operator import planning
from eaas.runtime.model.presets import preset
from eaas.runtime.placement import stored

MARGIN = 2  # the stored placements take at most half of what a ConfigMap holds


@pytest.mark.slow
@pytest.mark.parametrize("num_servers", [64, 320])
@pytest.mark.parametrize("replication", [2, 3, 4])
@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_committed_and_pending_placements_fit_with_margin(
    model: str, replication: int, num_servers: int
) -> None:
    config = preset("deepseek_v3", model)
    shape = planning.PoolShape(tuple(config.moe_layers), config.num_experts, replication)
    servers = {n: f"node-{n // 8}" for n in range(num_servers)}  # 8 GPUs a node
    names = {n: f"{model}-experts-{n}" for n in range(num_servers)}
    committed = planning.initial(shape, servers, names)
    # The first change: a server joins (pending = committed + server S, its share taken from the others).
    pending = planning.add_server(committed, shape, num_servers, f"{model}-experts-{num_servers}", "node-new")
    binary = stored.config_map_data(committed, pending)
    size = sum(len(stored.pack(p)) for p in (committed, pending))
    assert size * MARGIN <= stored.CONFIG_MAP_LIMIT_BYTES, f"{size} bytes"
    assert len(committed.to_json()) + len(pending.to_json()) > size * 4  # what the JSON took
    assert stored.read_config_map({"binaryData": binary}) == (committed, pending)
