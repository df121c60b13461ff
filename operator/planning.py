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

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from eaas.operator.api.pools import ExpertPoolSpec
from eaas.runtime.placement import elastic
from eaas.runtime.placement.builders import round_robin
from eaas.runtime.placement.placement import (
    LayerExpert,
    Placement,
    PlacementError,
    Server,
    domain_ids,
    required_spread,
)

__all__ = [
    "Placement",
    "PlacementError",
    "PoolShape",
    "Server",
    "add_server",
    "add_servers",
    "drain_server",
    "drain_servers",
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
    if load is not None:
        if ordinal in current.ordinals:
            raise PlacementError(f"server {ordinal} is already in placement v{current.version}")
        capacity = shape.capacity(current.num_servers + 1)
        return elastic.add_server(current, Server(ordinal, capacity, name, domain), load)
    return add_servers(current, shape, {ordinal: (name, domain)})


def add_servers(
    current: Placement, shape: PoolShape, new: Mapping[int, tuple[str | None, str | None]]
) -> Placement:
    """`current` plus the servers `new` (ordinal -> (name, failure domain)), load-blind, in one change.

    Every server ends with an equal share of the pairs (within one), taken from the fullest
    servers, layer by layer (:func:`_movable_pair`); the new servers take their pairs in turns, so
    a batch of k servers moves what k single additions would, once."""
    already = sorted(o for o in new if o in current.ordinals)
    if already:
        what = f"server {already[0]} is" if len(already) == 1 else f"servers {already} are"
        raise PlacementError(f"{what} already in placement v{current.version}")
    if not new:
        raise PlacementError("no server to add")
    hosting = _Hosting({server.ordinal: current.experts_of(server.ordinal) for server in current.servers})
    domains = {server.ordinal: server.domain for server in current.servers}
    for ordinal, (_, domain) in sorted(new.items()):
        hosting.add_server(ordinal)
        domains[ordinal] = domain
    target = sum(len(pairs) for pairs in hosting.pairs.values()) // len(hosting.pairs)
    shared = _crowded_domains(current)
    fullest = _Fullest(hosting)
    receiving = sorted(new)
    while receiving:
        still = []
        for ordinal in receiving:
            if len(hosting.pairs[ordinal]) >= target:
                continue
            donor = fullest.other_than(ordinal)
            if donor is None or len(hosting.pairs[donor]) <= len(hosting.pairs[ordinal]) + 1:
                continue
            pair = _movable_pair(hosting, domains, donor, ordinal, shared)
            if pair is None:
                continue
            hosting.move(pair, donor, ordinal)
            fullest.changed(donor)
            fullest.changed(ordinal)
            still.append(ordinal)
        receiving = still
    servers = [
        *current.servers,
        *(
            Server(ordinal=o, capacity=0, name=name, domain=domain)
            for o, (name, domain) in sorted(new.items())
        ),
    ]
    capacity = shape.capacity(len(servers), at_least=max(len(pairs) for pairs in hosting.pairs.values()))
    sized = [Server(s.ordinal, capacity, s.name, s.domain) for s in servers]
    _spread_by_swaps(
        hosting, domains, required_spread(sized, shape.num_pairs, shape.replication), sorted(new)
    )
    return _rebuild(current, shape, servers, hosting.lists())


def _crowded_domains(placement: Placement) -> frozenset[str]:
    """The named failure domains that hold two or more replicas of some pair: the only ones a
    move can spread a pair out of."""
    ids, _ = placement.domain_ids()  # named domains first, in sorted order
    names = sorted({server.domain for server in placement.servers if server.domain is not None})
    if not names:
        return frozenset()
    matrix = placement.hosting_matrix()  # [S, L, E]
    one_hot = np.zeros((len(names), len(ids)), dtype=np.float32)
    named = ids < len(names)
    one_hot[ids[named], np.flatnonzero(named)] = 1
    per_domain = one_hot @ matrix.reshape(len(ids), -1).astype(np.float32)  # [named domains, L*E]
    return frozenset(name for name, row in zip(names, per_domain, strict=True) if row.max() > 1)


def _spread_by_swaps(
    hosting: _Hosting, domains: dict[int, str | None], needed: int, receivers: list[int]
) -> None:
    """Swaps that give every pair replicas in `needed` failure domains, where handing out pairs
    left some short (new servers on unknown nodes count as domains of their own, so a batch of
    them raises the spread a placement needs): a replica of a short pair moves from a server
    whose domain holds two to a receiver in a new domain, which hands back a pair of the same
    layer (else any) whose spread the swap keeps. Counts per server and per layer are unchanged
    by a same-layer swap."""
    if needed <= 1:
        return

    def spread(holders: Iterable[int]) -> int:
        return len({_domain(domains, o) for o in holders})

    short = sorted(pair for pair, holders in hosting.holders.items() if spread(holders) < needed)
    for pair in short:
        holders = hosting.holders[pair]
        if spread(holders) >= needed:
            continue
        taken = [_domain(domains, o) for o in holders]
        crowded = sorted(o for o in holders if taken.count(_domain(domains, o)) > 1)
        options = (
            (donor, receiver)
            for donor in crowded
            for receiver in receivers
            if pair not in hosting.pairs[receiver] and _domain(domains, receiver) not in taken
        )
        for donor, receiver in options:
            back = _swap_back(hosting, domains, needed, pair, donor, receiver)
            if back is not None:
                hosting.move(pair, donor, receiver)
                hosting.move(back, receiver, donor)
                break


def _swap_back(
    hosting: _Hosting,
    domains: dict[int, str | None],
    needed: int,
    pair: LayerExpert,
    donor: int,
    receiver: int,
) -> LayerExpert | None:
    """A pair of `receiver` that `donor` lacks and whose replicas still cover `needed` domains
    once it is on `donor` instead (of `pair`'s layer first), or None."""
    same_layer = sorted(hosting.per_layer[receiver].get(pair[0], ()))
    for back in [*same_layer, *sorted(hosting.pairs[receiver] - set(same_layer))]:
        if back == pair or back in hosting.pairs[donor]:
            continue
        after = (hosting.holders[back] - {receiver}) | {donor}
        if len({_domain(domains, o) for o in after}) >= needed:
            return back
    return None


def drain_server(
    current: Placement, shape: PoolShape, ordinal: int, load: np.ndarray | None = None
) -> Placement:
    """`current` without server `ordinal`, its pairs re-homed first. load: ``[L, E]`` or None."""
    if load is None:
        return drain_servers(current, shape, [ordinal])
    if ordinal not in current.ordinals:
        raise PlacementError(f"server {ordinal} is not in placement v{current.version}")
    remaining = [server for server in current.servers if server.ordinal != ordinal]
    _check_remaining(remaining, shape, [ordinal])
    # Give the survivors the room the smaller pool needs, then re-home cost-aware.
    capacity = shape.capacity(len(remaining), at_least=max(current.used_slots().values()))
    servers = [Server(s.ordinal, capacity, s.name, s.domain) for s in current.servers]
    matrix = current.hosting_matrix()
    widened = Placement.from_matrix(
        current.layers, current.num_experts, servers, matrix, current.replication, current.version
    )
    return elastic.drain_server(widened, ordinal, load)


def drain_servers(current: Placement, shape: PoolShape, leaving: Iterable[int]) -> Placement:
    """`current` without the servers `leaving`, load-blind, in one change: each pair they held goes
    to the others until it has R holders there, preferring a new failure domain, then the server
    with the fewest pairs of that layer, then the emptiest, then the lowest ordinal; then the
    re-homed pairs are moved again where that evens a layer out (:func:`_even_out_layers`)."""
    leaving = sorted(set(leaving))
    absent = [o for o in leaving if o not in current.ordinals]
    if absent:
        what = f"server {absent[0]} is" if len(absent) == 1 else f"servers {absent} are"
        raise PlacementError(f"{what} not in placement v{current.version}")
    remaining = [server for server in current.servers if server.ordinal not in leaving]
    _check_remaining(remaining, shape, leaving)
    columns = [i for i, server in enumerate(current.servers) if server.ordinal not in leaving]
    matrix = current.hosting_matrix()  # [S, L, E] bool, servers in ordinal order
    hosting = _Matrix(matrix[columns].copy(), domain_ids(remaining)[0])
    rehomed: dict[tuple[int, int], int] = {}  # (layer index, expert) -> the column it went to
    for ordinal in leaving:
        for l, e in np.argwhere(matrix[current.server_index(ordinal)]).tolist():
            if hosting.holders(l, e).sum() >= shape.replication:
                continue  # R remain (or a hot expert had more than R: a rebalance gave it one)
            rehomed[l, e] = hosting.add(l, e, hosting.best(l, e, avoid_domains=True))
    _even_out_layers(hosting, rehomed)
    most = int(hosting.totals.max())
    capacity = shape.capacity(len(remaining), at_least=most)
    sized = [Server(ordinal=s.ordinal, capacity=capacity, name=s.name, domain=s.domain) for s in remaining]
    return Placement.from_matrix(
        current.layers, current.num_experts, sized, hosting.holds, current.replication, current.version + 1
    )


def _check_remaining(remaining: list[Server], shape: PoolShape, leaving: list[int]) -> None:
    if len(remaining) < shape.replication:
        what = f"server {leaving[0]}" if len(leaving) == 1 else f"servers {leaving}"
        raise PlacementError(
            f"cannot drain {what}: {len(remaining)} servers would remain, "
            f"replication R={shape.replication} needs at least {shape.replication}"
        )


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


class _Fullest:
    """The server holding the most pairs (ties: the lowest ordinal), kept as a heap of stale-checked
    entries: a server whose count changed is pushed again, and entries that no longer match their
    server's count are dropped when they surface."""

    def __init__(self, hosting: _Hosting) -> None:
        self.hosting = hosting
        self.heap = [(-len(pairs), ordinal) for ordinal, pairs in hosting.pairs.items()]
        heapq.heapify(self.heap)

    def changed(self, ordinal: int) -> None:
        heapq.heappush(self.heap, (-len(self.hosting.pairs[ordinal]), ordinal))

    def other_than(self, ordinal: int) -> int | None:
        """The fullest server other than `ordinal` (None when there is none)."""
        skipped = None
        while self.heap:
            count, candidate = self.heap[0]
            if -count != len(self.hosting.pairs[candidate]):
                heapq.heappop(self.heap)  # stale
                continue
            if candidate != ordinal:
                break
            skipped = heapq.heappop(self.heap)
        found = self.heap[0][1] if self.heap else None
        if skipped is not None:
            heapq.heappush(self.heap, skipped)
        return found


def _movable_pair(
    hosting: _Hosting,
    domains: dict[int, str | None],
    donor: int,
    receiver: int,
    shared_domains: frozenset[str] = frozenset(),
) -> LayerExpert | None:
    """The pair of `donor` to hand `receiver`, or None if it has none `receiver` lacks.

    Prefer the layers where `donor` holds most more than `receiver` (so every layer gains its
    share), then among their pairs one whose move spreads it over one more failure domain (another
    replica stays in `donor`'s domain, none is in `receiver`'s: a batch of new servers on unknown
    nodes, each its own domain, raises the spread a placement must have), then one whose other
    replicas are in other domains than `receiver`'s, then the lowest pair.
    """
    surplus: dict[int, list[int]] = {}
    for layer, held in hosting.per_layer[donor].items():
        if held:
            surplus.setdefault(len(held) - hosting.count(receiver, layer), []).append(layer)
    receiver_domain = _domain(domains, receiver)
    donor_domain = _domain(domains, donor)
    # Only a domain of several servers can hold two replicas of a pair: elsewhere the first pair
    # that keeps the spread is the one.
    shared = domains.get(donor) in shared_domains

    for level in sorted(surplus, reverse=True):
        apart = clashing = None  # the lowest pair that keeps the spread; that would lower it
        for layer in sorted(surplus[level]):
            lacking = (p for p in hosting.per_layer[donor][layer] if p not in hosting.pairs[receiver])
            for pair in sorted(lacking):
                others = {_domain(domains, o) for o in hosting.holders[pair] if o != donor}
                if receiver_domain in others:
                    clashing = clashing or pair
                elif donor_domain in others or not shared:
                    return pair  # spreads it further (or keeps the spread, which is all there is)
                else:
                    apart = apart or pair
        if apart is not None or clashing is not None:
            return apart or clashing
    return None


class _Matrix:
    """A hosting matrix being changed: bool ``[S, L, E]`` (servers in ordinal order), with each
    server's pairs per layer ``[S, L]`` and in all ``[S]``, and its failure domain ``[S]``."""

    def __init__(self, holds: np.ndarray, domains: np.ndarray) -> None:
        self.holds = holds
        self.domains = domains
        self.counts = holds.sum(axis=2, dtype=np.int64)  # [S, L]
        self.totals = self.counts.sum(axis=1)  # [S]
        num_servers = holds.shape[0]
        # One integer orders servers by (layer count, total, column): the key's digits.
        self._total_digit = num_servers
        self._count_digit = num_servers * (int(holds.shape[1] * holds.shape[2]) + 1)
        self._clash_digit = self._count_digit * (holds.shape[2] + 1)

    def holders(self, l: int, e: int) -> np.ndarray:
        return self.holds[:, l, e]

    def clashes(self, l: int, e: int, without: int = -1) -> np.ndarray:
        """``[S]``: a server's domain already holds (l, e) (on a server other than `without`)."""
        holders = self.holders(l, e).copy()
        if without >= 0:
            holders[without] = False
        return np.isin(self.domains, self.domains[holders])

    def key(self, l: int) -> np.ndarray:
        """``[S]`` int64: the order to receive a pair of layer `l` in (fewest of the layer, then
        fewest in all, then the lowest ordinal)."""
        return (
            self.counts[:, l] * self._count_digit
            + self.totals * self._total_digit
            + np.arange(len(self.totals))
        )

    def best(self, l: int, e: int, avoid_domains: bool) -> int:
        """The column that lacks (l, e) and should receive it (a new failure domain first)."""
        key = self.key(l)
        if avoid_domains:
            key = key + self.clashes(l, e) * self._clash_digit
        key = np.where(self.holders(l, e), np.iinfo(np.int64).max, key)
        return int(np.argmin(key))

    def add(self, l: int, e: int, column: int) -> int:
        self.holds[column, l, e] = True
        self.counts[column, l] += 1
        self.totals[column] += 1
        return column

    def remove(self, l: int, e: int, column: int) -> None:
        self.holds[column, l, e] = False
        self.counts[column, l] -= 1
        self.totals[column] -= 1


def _even_out_layers(hosting: _Matrix, rehomed: dict[tuple[int, int], int]) -> None:
    """Move again the just re-homed pairs ((layer index, expert) → the column it went to) that
    leave a layer uneven.

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
        for (l, e), holder in sorted(rehomed.items()):
            held = int(hosting.counts[holder, l])
            clash = hosting.clashes(l, e, without=holder)
            apart = not clash[holder]
            lighter = ~hosting.holders(l, e) & (hosting.counts[:, l] <= held - 2) & (~clash | (not apart))
            if not lighter.any():
                continue
            target = int(np.argmin(np.where(lighter, hosting.key(l), np.iinfo(np.int64).max)))
            hosting.remove(l, e, holder)
            rehomed[l, e] = hosting.add(l, e, target)
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
