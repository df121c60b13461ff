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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from eaas.operator.api.pools import ExpertPoolSpec
from eaas.runtime.placement import elastic
from eaas.runtime.placement.builders import round_robin
from eaas.runtime.placement.placement import LayerExpert, Placement, PlacementError, Server

__all__ = [
    "Placement",
    "PlacementError",
    "PoolShape",
    "Server",
    "add_server",
    "drain_server",
    "initial",
    "spread",
    "spread_shortfall",
]


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
    hosting = _Hosting({server.ordinal: current.experts_of(server.ordinal) for server in current.servers})
    hosting.add_server(ordinal)
    domains = {server.ordinal: server.domain for server in current.servers} | {ordinal: domain}
    target = sum(len(pairs) for pairs in hosting.pairs.values()) // len(hosting.pairs)
    while len(hosting.pairs[ordinal]) < target:
        donor = max((o for o in hosting.pairs if o != ordinal), key=lambda o: (len(hosting.pairs[o]), -o))
        if len(hosting.pairs[donor]) <= len(hosting.pairs[ordinal]) + 1:
            break
        pair = _movable_pair(hosting, domains, donor, ordinal)
        if pair is None:
            break
        hosting.move(pair, donor, ordinal)
    servers = [*current.servers, Server(ordinal=ordinal, capacity=0, name=name, domain=domain)]
    return _rebuild(current, shape, servers, hosting.lists())


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
    hosting = _Hosting({server.ordinal: current.experts_of(server.ordinal) for server in remaining})
    domains = {server.ordinal: server.domain for server in remaining}
    rehomed: dict[LayerExpert, int] = {}
    for pair in current.experts_of(ordinal):
        if len(hosting.holders.get(pair, ())) >= shape.replication:
            continue  # a hot expert with more than R replicas (a rebalance gave it one): R remain
        used_domains = {_domain(domains, o) for o in hosting.holders.get(pair, ())}
        candidates = [o for o in hosting.pairs if pair not in hosting.pairs[o]]
        # Prefer a new failure domain, then the server with the fewest pairs of this layer, then the
        # emptiest, then the lowest ordinal.
        target = min(
            candidates,
            key=lambda o: (
                _domain(domains, o) in used_domains,
                hosting.count(o, pair[0]),
                len(hosting.pairs[o]),
                o,
            ),
        )
        hosting.add(target, pair)
        rehomed[pair] = target
    _even_out_layers(hosting, domains, rehomed)
    return _rebuild(current, shape, remaining, hosting.lists())


def _domain(domains: dict[int, str | None], ordinal: int) -> str:
    return domains[ordinal] or f"<server {ordinal}>"


class _Hosting:
    """Who hosts what while a placement change is worked out, indexed for the questions asked:
    a server's pairs, its pairs per layer, and a pair's holders."""

    def __init__(self, hosted: dict[int, Iterable[LayerExpert]]) -> None:
        self.pairs: dict[int, set[LayerExpert]] = {}
        self.per_layer: dict[int, dict[int, set[LayerExpert]]] = {}  # ordinal -> layer -> its pairs
        self.holders: dict[LayerExpert, set[int]] = {}
        for ordinal, pairs in hosted.items():
            self.add_server(ordinal)
            for pair in pairs:
                self.add(ordinal, pair)

    def add_server(self, ordinal: int) -> None:
        self.pairs[ordinal] = set()
        self.per_layer[ordinal] = {}

    def count(self, ordinal: int, layer: int) -> int:
        return len(self.per_layer[ordinal].get(layer, ()))

    def add(self, ordinal: int, pair: LayerExpert) -> None:
        self.pairs[ordinal].add(pair)
        self.per_layer[ordinal].setdefault(pair[0], set()).add(pair)
        self.holders.setdefault(pair, set()).add(ordinal)

    def move(self, pair: LayerExpert, source: int, target: int) -> None:
        self.pairs[source].remove(pair)
        self.per_layer[source][pair[0]].remove(pair)
        self.holders[pair].remove(source)
        self.add(target, pair)

    def lists(self) -> dict[int, list[LayerExpert]]:
        return {ordinal: sorted(pairs) for ordinal, pairs in self.pairs.items()}


def _movable_pair(
    hosting: _Hosting, domains: dict[int, str | None], donor: int, receiver: int
) -> LayerExpert | None:
    """The pair of `donor` to hand `receiver`, or None if it has none `receiver` lacks.

    Prefer the layers where `donor` holds most more than `receiver` (so every layer gains its
    share), then among their pairs one whose other replicas are in other domains than
    `receiver`'s, then the lowest pair.
    """
    surplus: dict[int, list[int]] = {}
    for layer, held in hosting.per_layer[donor].items():
        if held:
            surplus.setdefault(len(held) - hosting.count(receiver, layer), []).append(layer)
    receiver_domain = _domain(domains, receiver)

    def clash(pair: LayerExpert) -> bool:
        return any(_domain(domains, o) == receiver_domain for o in hosting.holders[pair] if o != donor)

    for level in sorted(surplus, reverse=True):
        fallback = None  # the lowest pair whose replica would share `receiver`'s domain
        for layer in sorted(surplus[level]):
            lacking = (p for p in hosting.per_layer[donor][layer] if p not in hosting.pairs[receiver])
            for pair in sorted(lacking):
                if not clash(pair):
                    return pair
                fallback = fallback or pair
        if fallback is not None:
            return fallback
    return None


def _even_out_layers(
    hosting: _Hosting, domains: dict[int, str | None], rehomed: dict[LayerExpert, int]
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
            held = hosting.count(holder, pair[0])
            others = {_domain(domains, o) for o in hosting.holders[pair] if o != holder}
            apart = _domain(domains, holder) not in others
            lighter = [
                o
                for o in hosting.pairs
                if pair not in hosting.pairs[o]
                and hosting.count(o, pair[0]) <= held - 2
                and (_domain(domains, o) not in others or not apart)
            ]
            if not lighter:
                continue
            target = min(lighter, key=lambda o: (hosting.count(o, pair[0]), len(hosting.pairs[o]), o))
            hosting.move(pair, holder, target)
            rehomed[pair] = target
            moved = True


def spread_shortfall(placement: Placement, domains: dict[int, str]) -> int:
    """(layer, expert) pairs whose replicas cover fewer than ``min(R, domains)`` of the failure
    domains `domains` (ordinal -> domain, e.g. the node each server's pod runs on) say; 0 when
    losing any one domain leaves every pair a replica elsewhere (or there is one domain only)."""
    ordinals = placement.ordinals
    names = sorted({domains[o] for o in ordinals})
    needed = min(placement.replication, len(names))
    if needed <= 1:
        return 0
    index = {name: i for i, name in enumerate(names)}
    ids = np.array([index[domains[o]] for o in ordinals])
    matrix = placement.hosting_matrix()  # [S, L, E]
    covered = np.zeros((len(names), *matrix.shape[1:]), dtype=bool)
    for domain in range(len(names)):
        covered[domain] = matrix[ids == domain].any(axis=0)
    return int((covered.sum(axis=0) < needed).sum())


def spread(current: Placement, shape: PoolShape, domains: dict[int, str]) -> Placement:
    """`current` with its servers' failure domains recorded (version + 1), every pair's replicas on
    ``min(R, domains)`` domains: the same assignment where it already is so, else dealt again over
    the domains. In auto mode a domain with fewer servers gets the slots it needs to hold its
    share of every pair (a lone server in its own domain hosts one replica of everything, R = 2
    over two domains): the price of surviving the loss of a whole domain."""
    ordinals = current.ordinals
    pairs = shape.num_pairs
    per_domain: dict[str, int] = {}
    for ordinal in ordinals:
        per_domain[domains[ordinal]] = per_domain.get(domains[ordinal], 0) + 1
    needed = min(shape.replication, len(per_domain))
    used = current.used_slots()

    def capacity(ordinal: int) -> int:
        if shape.slots_per_server:
            return shape.slots_per_server
        domain_share = math.ceil(
            min(pairs, math.ceil(needed * pairs / len(per_domain))) / per_domain[domains[ordinal]]
        )
        return max(shape.capacity(len(ordinals)), domain_share, used[ordinal])

    servers = [
        Server(ordinal=s.ordinal, capacity=capacity(s.ordinal), name=s.name, domain=domains[s.ordinal])
        for s in current.servers
    ]
    version = current.version + 1
    if spread_shortfall(current, domains) == 0:
        return Placement.from_matrix(
            current.layers,
            current.num_experts,
            servers,
            current.hosting_matrix(),
            current.replication,
            version,
        )
    dealt = round_robin(current.layers, current.num_experts, servers, shape.replication, version=version)
    if spread_shortfall(dealt, domains):
        raise PlacementError(
            f"cannot put the replicas of every expert on {needed} failure domains with these servers "
            f"({per_domain}); add servers in other domains or raise expertSlotsPerServer"
        )
    return dealt


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
