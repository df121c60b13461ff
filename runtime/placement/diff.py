"""Moves between two placements: which servers must load or drop which (layer, expert) weights.

Only a *load* moves bytes (a server fetches an expert's weights it did not have); an *unload* just
frees a slot. "Expert moves per rebalance" in the benchmarks is the number of loads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from eaas.runtime.placement.placement import LayerExpert, Placement, PlacementError


class Move(NamedTuple):
    """One (server ordinal, layer id, expert id) change."""

    server: int
    layer: int
    expert: int


@dataclass(frozen=True)
class PlacementDiff:
    """What changes from an old placement to a new one.

    loads: pairs a server hosts in the new placement but not in the old one (weights to fetch),
        sorted by (server, layer, expert). A server that is new has all its pairs here.
    unloads: pairs a server drops, sorted the same way (a removed server drops everything).
    added_servers / removed_servers: ordinals present in only one of the two placements.
    """

    loads: tuple[Move, ...]
    unloads: tuple[Move, ...]
    added_servers: tuple[int, ...]
    removed_servers: tuple[int, ...]

    @property
    def num_moves(self) -> int:
        """Number of expert loads (the movement count used throughout the benchmarks)."""
        return len(self.loads)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.unloads or self.added_servers or self.removed_servers)

    def loads_by_server(self) -> dict[int, list[LayerExpert]]:
        """ordinal → pairs it must load."""
        grouped: dict[int, list[LayerExpert]] = defaultdict(list)
        for move in self.loads:
            grouped[move.server].append((move.layer, move.expert))
        return dict(grouped)

    def unloads_by_server(self) -> dict[int, list[LayerExpert]]:
        """ordinal → pairs it may drop."""
        grouped: dict[int, list[LayerExpert]] = defaultdict(list)
        for move in self.unloads:
            grouped[move.server].append((move.layer, move.expert))
        return dict(grouped)

    def max_loads_per_server(self) -> int:
        """The largest number of loads any one server performs (what the movement time scales with)."""
        counts: dict[int, int] = defaultdict(int)
        for move in self.loads:
            counts[move.server] += 1
        return max(counts.values(), default=0)


def diff(old: Placement, new: Placement) -> PlacementDiff:
    """Moves from ``old`` to ``new``. Servers are matched by ordinal; both placements must describe
    the same model (same layer ids and number of experts)."""
    if old.layers != new.layers or old.num_experts != new.num_experts:
        raise PlacementError(
            "cannot diff placements of different models: layers/num_experts "
            f"{len(old.layers)}x{old.num_experts} vs {len(new.layers)}x{new.num_experts}"
        )
    loads: list[Move] = []
    unloads: list[Move] = []
    old_matrix = old.hosting_matrix()
    new_matrix = new.hosting_matrix()
    empty = np.zeros(old_matrix.shape[1:], dtype=bool)
    layers = old.layers
    old_ordinals, new_ordinals = set(old.ordinals), set(new.ordinals)
    for ordinal in sorted(old_ordinals | new_ordinals):
        before = old_matrix[old.server_index(ordinal)] if ordinal in old_ordinals else empty
        after = new_matrix[new.server_index(ordinal)] if ordinal in new_ordinals else empty
        for mask, target in ((after & ~before, loads), (before & ~after, unloads)):
            rows, experts = np.nonzero(mask)
            target.extend(
                Move(ordinal, layers[row], expert)
                for row, expert in zip(rows.tolist(), experts.tolist(), strict=True)
            )
    loads.sort()
    unloads.sort()
    return PlacementDiff(
        loads=tuple(loads),
        unloads=tuple(unloads),
        added_servers=tuple(sorted(new_ordinals - old_ordinals)),
        removed_servers=tuple(sorted(old_ordinals - new_ordinals)),
    )


def num_moves(old: Placement, new: Placement) -> int:
    """Number of expert loads from ``old`` to ``new`` (vectorised `diff(old, new).num_moves`)."""
    if old.layers != new.layers or old.num_experts != new.num_experts:
        raise PlacementError("cannot count moves between placements of different models")
    total = 0
    old_matrix = old.hosting_matrix()
    new_matrix = new.hosting_matrix()
    old_ordinals = set(old.ordinals)
    for column, ordinal in enumerate(new.ordinals):
        after = new_matrix[column]
        if ordinal in old_ordinals:
            total += int((after & ~old_matrix[old.server_index(ordinal)]).sum())
        else:
            total += int(after.sum())
    return total
