"""Placement changes the ExpertPool reconciler asks for, on top of THE ``Placement`` type.

``initial`` deals every (layer, expert) ``R`` times round-robin. With a measured load ``[L, E]``,
``add_server`` and ``drain_server`` are the cost-aware elastic operations of
``eaas.runtime.placement`` (they move only what lowers predicted latency). Without one (the
servers do not report per-expert load to the operator yet) a load-blind rule applies: a new
server takes an equal share of pairs from the fullest servers (the cost-aware search, seeing the
same load everywhere, would leave it empty), and a leaving server's pairs go to the emptiest
servers that lack them, preferring other failure domains. Both balance every *layer*, not just the
slot count: a layer's tokens wait for the busiest server hosting that layer, so a server that
holds whole layers adds capacity to those layers only (a 2 -> 4 server pool then served its peak
no faster). Both keep R and return ``version + 1``; all are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eaas.operator.api.pools import ExpertPoolSpec
from eaas.runtime.placement import elastic
from eaas.runtime.placement.builders import round_robin
from eaas.runtime.placement.placement import LayerExpert, Placement, PlacementError, Server

__all__ = ["Placement", "PlacementError", "PoolShape", "Server", "add_server", "drain_server", "initial"]


@dataclass(frozen=True)
class PoolShape:
    """What a placement of one ExpertPool must cover.

    layers: MoE layer ids (L); num_experts: E; replication: R;
    slots_per_server: expert slots of one server, 0 = as many as needed (``ceil(R·L·E / servers)``).
    """

    layers: tuple[int, ...]
    num_experts: int
    replication: int
    slots_per_server: int = 0

    @classmethod
    def of(cls, spec: ExpertPoolSpec) -> PoolShape:
        return cls(
            layers=tuple(spec.model.moe_layers),
            num_experts=spec.model.num_experts,
            replication=spec.replication_factor,
            slots_per_server=spec.expert_slots_per_server,
        )

    @property
    def num_pairs(self) -> int:
        """(layer, expert) pairs to host, each R times."""
        return len(self.layers) * self.num_experts

    def capacity(self, num_servers: int, at_least: int = 0) -> int:
        """Slots per server for `num_servers` servers (never below `at_least` in auto mode)."""
        if self.slots_per_server:
            return self.slots_per_server
        return max(math.ceil(self.replication * self.num_pairs / max(num_servers, 1)), at_least)


def initial(
    shape: PoolShape, servers: dict[int, str | None], names: dict[int, str], version: int = 1
) -> Placement:
    """The first placement over `servers` (ordinal → failure domain or None)."""
    capacity = shape.capacity(len(servers))
    server_list = [
        Server(ordinal=ordinal, capacity=capacity, name=names.get(ordinal), domain=domain)
        for ordinal, domain in sorted(servers.items())
    ]
    return round_robin(shape.layers, shape.num_experts, server_list, shape.replication, version=version)


def add_server(
    current: Placement,
    shape: PoolShape,
    ordinal: int,
    name: str | None,
    domain: str | None,
    load: np.ndarray | None = None,
) -> Placement:
    """`current` plus server `ordinal`. load: float ``[L, E]`` tokens per step, or None (load-blind)."""
    if ordinal in current.ordinals:
        raise PlacementError(f"server {ordinal} is already in placement v{current.version}")
    if load is not None:
        capacity = shape.capacity(current.num_servers + 1)
        return elastic.add_server(current, Server(ordinal, capacity, name, domain), load)
    hosted = {server.ordinal: list(current.experts_of(server.ordinal)) for server in current.servers}
    hosted[ordinal] = []
    domains = {server.ordinal: server.domain for server in current.servers} | {ordinal: domain}
    total = sum(len(pairs) for pairs in hosted.values())
    target = total // len(hosted)
    while len(hosted[ordinal]) < target:
        donor = max((o for o in hosted if o != ordinal), key=lambda o: (len(hosted[o]), -o))
        if len(hosted[donor]) <= len(hosted[ordinal]) + 1:
            break
        pair = _movable_pair(hosted, domains, donor, ordinal)
        if pair is None:
            break
        hosted[donor].remove(pair)
        hosted[ordinal].append(pair)
    servers = [*current.servers, Server(ordinal=ordinal, capacity=0, name=name, domain=domain)]
    return _rebuild(current, shape, servers, hosted)


def drain_server(
    current: Placement, shape: PoolShape, ordinal: int, load: np.ndarray | None = None
) -> Placement:
    """`current` without server `ordinal`, its pairs re-homed first. load: ``[L, E]`` or None."""
    if ordinal not in current.ordinals:
        raise PlacementError(f"server {ordinal} is not in placement v{current.version}")
    remaining = [server for server in current.servers if server.ordinal != ordinal]
    if len(remaining) < shape.replication:
        raise PlacementError(
            f"cannot drain server {ordinal}: {len(remaining)} servers would remain, "
            f"replication R={shape.replication} needs at least {shape.replication}"
        )
    if load is not None:  # give the survivors the room the smaller pool needs, then re-home cost-aware
        capacity = shape.capacity(len(remaining), at_least=max(current.used_slots().values()))
        servers = [Server(s.ordinal, capacity, s.name, s.domain) for s in current.servers]
        matrix = current.hosting_matrix()
        widened = Placement.from_matrix(
            current.layers, current.num_experts, servers, matrix, current.replication, current.version
        )
        return elastic.drain_server(widened, ordinal, load)
    hosted = {server.ordinal: list(current.experts_of(server.ordinal)) for server in remaining}
    domains = {server.ordinal: server.domain for server in remaining}
    rehomed: dict[LayerExpert, int] = {}
    for pair in current.experts_of(ordinal):
        holders = [o for o, pairs in hosted.items() if pair in pairs]
        used_domains = {_domain(domains, o) for o in holders}
        candidates = [o for o in hosted if pair not in hosted[o]]
        # Prefer a new failure domain, then the server with the fewest pairs of this layer, then the
        # emptiest, then the lowest ordinal.
        target = min(
            candidates,
            key=lambda o: (
                _domain(domains, o) in used_domains,
                _layer_count(hosted[o], pair[0]),
                len(hosted[o]),
                o,
            ),
        )
        hosted[target].append(pair)
        rehomed[pair] = target
    _even_out_layers(hosted, domains, rehomed)
    return _rebuild(current, shape, remaining, hosted)


def _even_out_layers(
    hosted: dict[int, list[LayerExpert]], domains: dict[int, str | None], rehomed: dict[LayerExpert, int]
) -> None:
    """Move again the just re-homed pairs (pair → the server it went to) that leave a layer uneven.

    Greedy re-homing can leave a layer two or more pairs heavier on one server than on another
    (the lighter one already held the pairs that had to move). A re-homed pair may go to any
    server that lacks it at no extra load, so move such pairs from the heavier server of their
    layer to a lighter one while the two differ by two or more, without putting two replicas in
    one failure domain that were apart. Each move lowers the sum of squared per-layer counts, so
    this ends.
    """
    moved = True
    while moved:
        moved = False
        for pair, holder in sorted(rehomed.items()):
            held = _layer_count(hosted[holder], pair[0])
            others = {_domain(domains, o) for o, pairs in hosted.items() if o != holder and pair in pairs}
            apart = _domain(domains, holder) not in others
            lighter = [
                o
                for o in hosted
                if pair not in hosted[o]
                and _layer_count(hosted[o], pair[0]) <= held - 2
                and (_domain(domains, o) not in others or not apart)
            ]
            if not lighter:
                continue
            target = min(lighter, key=lambda o: (_layer_count(hosted[o], pair[0]), len(hosted[o]), o))
            hosted[holder].remove(pair)
            hosted[target].append(pair)
            rehomed[pair] = target
            moved = True


def _domain(domains: dict[int, str | None], ordinal: int) -> str:
    return domains[ordinal] or f"<server {ordinal}>"


def _layer_count(pairs: list[LayerExpert], layer: int) -> int:
    return sum(1 for pair in pairs if pair[0] == layer)


def _movable_pair(
    hosted: dict[int, list[LayerExpert]], domains: dict[int, str | None], donor: int, receiver: int
) -> LayerExpert | None:
    """The pair of `donor` to hand `receiver`, or None if it has none `receiver` lacks.

    Prefer the layer where `donor` holds most more than `receiver` (so every layer gains its
    share), then a pair whose other replicas are in other domains than `receiver`'s, then the
    lowest pair.
    """
    layers = {pair[0] for pair in hosted[donor]}
    surplus = {
        layer: _layer_count(hosted[donor], layer) - _layer_count(hosted[receiver], layer) for layer in layers
    }

    def rank(pair: LayerExpert) -> tuple[int, bool, LayerExpert]:
        others = {_domain(domains, o) for o, pairs in hosted.items() if o != donor and pair in pairs}
        return (-surplus[pair[0]], _domain(domains, receiver) in others, pair)

    candidates = [pair for pair in hosted[donor] if pair not in hosted[receiver]]
    return min(candidates, key=rank, default=None)


def _rebuild(
    current: Placement, shape: PoolShape, servers: list[Server], hosted: dict[int, list[LayerExpert]]
) -> Placement:
    """A validated placement at ``current.version + 1`` with capacities for the new server count."""
    most = max(len(pairs) for pairs in hosted.values())
    capacity = shape.capacity(len(servers), at_least=most)
    sized = [Server(ordinal=s.ordinal, capacity=capacity, name=s.name, domain=s.domain) for s in servers]
    return Placement(
        current.layers,
        current.num_experts,
        sized,
        hosted,
        replication=current.replication,
        version=current.version + 1,
    )
