"""Simple placements: round-robin with replication R (the launcher's default, and the unbalanced
starting point the planners improve on)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import numpy as np

from eaas.runtime.placement.placement import (
    LayerExpert,
    Placement,
    PlacementError,
    Server,
    check_feasible,
    domain_ids,
    required_spread,
)
from eaas.runtime.placement.spread import repair_spread


def round_robin(
    layers: int | Iterable[int],
    num_experts: int,
    servers: int | Iterable[Server],
    replication: int = 1,
    *,
    capacity: int | None = None,
    version: int = 0,
) -> Placement:
    """Deal every (layer, expert) to the servers in turn, ``replication`` times.

    Args:
        layers: the MoE layer ids, or an int ``n`` for ids ``0..n-1``.
        num_experts: experts per layer (E).
        servers: `Server` objects, or an int ``n`` for ordinals ``0..n-1`` with ``capacity`` slots
            each (default: just enough, ``ceil(R * L * E / n)``).
        replication: R, replicas per (layer, expert), on distinct servers and, where servers have
            failure domains, on distinct domains while there are domains left.
        capacity: slots per server when ``servers`` is an int; must be None otherwise.
        version: version of the returned placement.

    Entry ``g = layer_index * E + expert`` puts replica ``r`` on the ``(g + r)``-th server of an
    order that interleaves failure domains (so consecutive replicas land on different domains),
    skipping servers that are full or already host the pair.
    """
    layer_ids = list(range(layers)) if isinstance(layers, int) else list(layers)
    if isinstance(servers, int):
        if servers < 1:
            raise PlacementError(f"servers must be >= 1, got {servers}")
        if not isinstance(replication, int) or replication < 1:
            raise PlacementError(f"replication must be an int >= 1, got {replication!r}")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise PlacementError(f"num_experts must be an int >= 1, got {num_experts!r}")
        slots = (
            capacity
            if capacity is not None
            else math.ceil(replication * len(layer_ids) * num_experts / servers)
        )
        server_list = [Server(ordinal=i, capacity=slots) for i in range(servers)]
    else:
        if capacity is not None:
            raise PlacementError(
                "capacity= applies only when servers is a count; Server objects carry their own"
            )
        server_list = sorted(servers, key=lambda server: server.ordinal)
    # Validate the header (R <= S, total capacity) before dealing, for a clear error.
    check_feasible(len(layer_ids), num_experts, server_list, replication)
    order = _interleave_domains(server_list)
    keys = [server.domain if server.domain is not None else f"\0{server.ordinal}" for server in order]
    domain_names = list(dict.fromkeys(keys))  # in interleaved order
    domain_of = [domain_names.index(key) for key in keys]
    needed_domains = required_spread(server_list, len(layer_ids) * num_experts, replication)
    dealer = _Dealer([server.capacity for server in order], domain_of, len(domain_names))
    hosted: dict[int, list[LayerExpert]] = {server.ordinal: [] for server in order}
    for g in range(len(layer_ids) * num_experts):
        layer, expert = layer_ids[g // num_experts], g % num_experts
        for position in dealer.deal(g, replication, needed_domains):
            hosted[order[position].ordinal].append((layer, expert))
    if needed_domains > 1:
        # Uneven capacities can leave a domain full before every pair reached it: swap pairs
        # between servers until every pair covers enough domains.
        placement_servers = sorted(server_list, key=lambda server: server.ordinal)
        column = {server.ordinal: i for i, server in enumerate(placement_servers)}
        row = {layer: i for i, layer in enumerate(layer_ids)}
        matrix = np.zeros((len(placement_servers), len(layer_ids), num_experts), dtype=bool)
        for ordinal, pairs in hosted.items():
            for layer, expert in pairs:
                matrix[column[ordinal], row[layer], expert] = True
        ids, _ = domain_ids(placement_servers)
        repair_spread(matrix, np.zeros((len(layer_ids), num_experts)), ids, needed_domains)
        return Placement.from_matrix(layer_ids, num_experts, placement_servers, matrix, replication, version)
    return Placement(layer_ids, num_experts, server_list, hosted, replication=replication, version=version)


class _Dealer:
    """Picks servers for one pair's replicas: the server with the most free slots wins (so dealing
    never gets stuck while a solution exists); among those, the one that shares the fewest pairs
    with the servers already chosen for this pair, then the first in cyclic order from the pair's
    index. The first ``spread`` replicas go to distinct failure domains, the domain with the most
    free slots first (then the one sharing the fewest pairs with the domains already chosen).

    Without the sharing rule, equal servers fill in lockstep two at a time and every pair of one
    lands on the same other server: a failure then moves all of a server's load onto one
    partner. With it, a server's pairs have their other replicas on as many servers as there
    are, and a failure's load is spread over them."""

    def __init__(self, free: list[int], domain_of: list[int], num_domains: int) -> None:
        self.free = free
        self.domain_of = domain_of
        self.domain_free = [0] * num_domains
        for position, slots in enumerate(free):
            self.domain_free[domain_of[position]] += slots
        self.count = len(free)
        self.shared = [[0] * self.count for _ in range(self.count)]  # pairs two servers both host
        self.domain_shared = [[0] * num_domains for _ in range(num_domains)]  # the same per domain
        self.members: list[list[int]] = [[] for _ in range(num_domains)]  # positions, ascending
        for position, domain in enumerate(domain_of):
            self.members[domain].append(position)

    def deal(self, g: int, replication: int, spread: int) -> list[int]:
        chosen: list[int] = []
        covered: set[int] = set()
        for replica in range(replication):
            start = (g + replica) % self.count
            domain = self._domain(g + replica, covered) if replica < spread else None
            position = self._server(start, chosen, domain, covered)
            if position is None:
                raise PlacementError(
                    f"round_robin: no server has a free slot for replica {replica + 1} of pair {g}; "
                    "the capacities are too uneven"
                )
            for other in chosen:
                self.shared[other][position] += 1
                self.shared[position][other] += 1
                a, b = self.domain_of[other], self.domain_of[position]
                self.domain_shared[a][b] += 1
                self.domain_shared[b][a] += 1
            chosen.append(position)
            covered.add(self.domain_of[position])
            self.free[position] -= 1
            self.domain_free[self.domain_of[position]] -= 1
        return chosen

    def _domain(self, start: int, covered: set[int]) -> int | None:
        """The open domain not covered yet with the most free slots, then the fewest pairs shared
        with the covered domains, then the first in cyclic order from ``start``."""
        num_domains = len(self.domain_free)
        shared = self._shared_with([self.domain_shared[other] for other in covered], num_domains)
        best, best_free, best_shared = None, 0, 0
        for step in range(start, start + num_domains):
            domain = step % num_domains
            free = self.domain_free[domain]
            if free <= 0 or free < best_free or domain in covered:
                continue
            if best is None or free > best_free or shared[domain] < best_shared:
                best, best_free, best_shared = domain, free, shared[domain]
        return best

    def _server(self, start: int, chosen: list[int], domain: int | None, covered: set[int]) -> int | None:
        """The open server (in ``domain`` if given) with the most free slots, then outside the
        covered domains, then sharing the fewest pairs with ``chosen``, then the first in cyclic
        order from ``start``."""
        rows = [self.shared[other] for other in chosen]
        if domain is None:
            candidates: Iterable[int] = range(start, start + self.count)  # all, cyclic from start
            shared = self._shared_with(rows, self.count)
        else:  # only the domain's servers (a few of many), in the same cyclic order
            members = self.members[domain]
            first = bisect.bisect_left(members, start)
            candidates = members[first:] + members[:first]
            shared = None
        best, best_key = None, (0, False, 0)
        for step in candidates:
            position = step % self.count
            free = self.free[position]
            if free <= 0 or free < best_key[0] or position in chosen:
                continue
            pairs = shared[position] if shared is not None else sum(row[position] for row in rows)
            key = (free, self.domain_of[position] not in covered, -pairs)
            if best is None or key > best_key:
                best, best_key = position, key
        return best

    @staticmethod
    def _shared_with(rows: list[list[int]], size: int) -> list[int]:
        """Column sums of ``rows`` (pairs shared with each of the chosen): ``[size]``."""
        if not rows:
            return [0] * size
        if len(rows) == 1:
            return rows[0]
        return [sum(column) for column in zip(*rows, strict=True)]


def _interleave_domains(servers: Sequence[Server]) -> list[Server]:
    """Servers ordered so that neighbours are in different failure domains where possible:
    the first server of every domain, then the second of every domain, and so on."""
    groups: dict[str, list[Server]] = {}
    for server in servers:
        key = server.domain if server.domain is not None else f"\0{server.ordinal}"
        groups.setdefault(key, []).append(server)
    ordered_groups = sorted(groups.values(), key=lambda group: group[0].ordinal)
    result: list[Server] = []
    depth = max(len(group) for group in ordered_groups)
    for level in range(depth):
        result.extend(group[level] for group in ordered_groups if level < len(group))
    return result
