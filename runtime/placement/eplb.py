"""`replicate_and_pack`: DeepSeek's EPLB policy, re-implemented from its published description.

The baseline the cost-aware planner is measured against. It ignores where experts are now:

1. *Replicate*: every expert starts with R replicas; while a layer has free slots, add a replica
   to the expert with the highest load per replica.
2. *Pack*: sort the replicas by load per replica, heaviest first, and put each on the server with
   the least load so far that still has a slot for this layer (and does not host the expert yet).
3. *Hierarchical* variant (when servers have failure domains = nodes and ``num_groups`` expert
   groups divide evenly over the nodes): first pack whole expert groups onto nodes (equal group
   count per node, heaviest first), then replicate and pack within each node.

Generalisations over the original, needed here: servers may have unequal capacities and a layer's
slot count need not divide by the number of servers (per-layer slot quotas rotate the remainder
over layers, see `layer_quotas`); replicas of one expert go to distinct servers (and spread over
failure domains when R > 1).

Shapes: L = MoE layers, E = experts, S = servers (ordinal order), N = replicas ("physical
experts") per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eaas.runtime.placement.cost import CostModel, check_load, failover_shares
from eaas.runtime.placement.placement import Placement, PlacementError
from eaas.runtime.placement.search import Search
from eaas.runtime.placement.spread import repair_spread

PARTNER_TOLERANCE = 0.25
"""Failure-aware packing: servers within this many times an item's tokens of the least loaded one
count as tied. On benchmarks/fault_drill.py's DeepSeek-V3 shape (64 servers, R = 2) the ties are
exact (an expert's replicas have equal shares) and any value from 0.1 to 0.5 gives the same: the
busiest server per layer 0.1% below plain packing's, and 1.14x the healthy tokens after one
server's failure against 1.67x. On a small shape (16 servers, 4.5 slots per layer) 0.25 kept the
balance within 5% of plain packing's over six loads (0.5: 9%) with the same spread."""


def replicate_and_pack(
    current: Placement,
    load: np.ndarray,
    *,
    slots_per_layer: int | None = None,
    num_groups: int | None = None,
    failure_aware: bool = False,
) -> Placement:
    """EPLB: replicate hot experts, then pack replicas heaviest-first onto the least-loaded server.

    Args:
        current: gives the servers, layers, replication factor and version; its assignment is
            ignored (EPLB plans from scratch).
        load: float ``[L, E]`` predicted tokens per (layer, expert).
        slots_per_layer: replicas per layer (N = E + redundant experts); default: all capacity,
            ``sum(capacity) // L``.
        num_groups: expert groups (DeepSeek-V3: 8). When given and the servers' domains (nodes)
            divide the groups evenly, the hierarchical policy is used; otherwise the global one.
        failure_aware: break the packing's near-ties so that each server's experts have their
            other replicas on many servers (see `_pack`): the same balance, and a lost server's
            load spread thin instead of doubling one partner's (our planners' fresh packing; the
            EPLB baseline is ``False``).

    Returns:
        A new placement (version + 1), or ``current`` itself if the plan equals it.
    """
    num_layers, num_experts = len(current.layers), current.num_experts
    loads = check_load(load, num_layers, num_experts)
    capacities = [server.capacity for server in current.servers]
    replication = current.replication
    if slots_per_layer is None:
        slots_per_layer = min(sum(capacities) // num_layers, num_experts * current.num_servers)
    if not isinstance(slots_per_layer, int) or slots_per_layer < replication * num_experts:
        raise PlacementError(
            f"slots_per_layer must be an int >= replication x experts = {replication * num_experts}, "
            f"got {slots_per_layer!r}"
        )
    domain_ids, _ = current.domain_ids()
    quotas = layer_quotas(capacities, num_layers, slots_per_layer, num_experts, domain_ids.tolist())  # [L, S]
    named_domains = sorted({s.domain for s in current.servers if s.domain is not None})
    hierarchical = (
        num_groups is not None
        and len(named_domains) > 0
        and all(server.domain is not None for server in current.servers)
        and num_groups % len(named_domains) == 0
    )
    if num_groups is not None and (num_groups < 1 or num_experts % num_groups):
        raise PlacementError(f"num_groups must divide num_experts={num_experts}, got {num_groups}")
    if hierarchical:
        assert num_groups is not None
        if current.required_spread > 1:
            raise PlacementError(
                "hierarchical packing keeps an expert group on one node, so it cannot spread "
                f"replication={replication} replicas over failure domains; use num_groups=None or "
                "replication=1"
            )
        matrix = _hierarchical(
            loads, quotas, domain_ids, len(named_domains), num_groups, replication, failure_aware
        )
    else:
        needed_domains = current.required_spread
        matrix = _replicate_then_pack(loads, quotas, replication, domain_ids, needed_domains, failure_aware)
        if needed_domains > 1:
            matrix = _spread(matrix, loads, capacities, domain_ids, replication, needed_domains)
    if np.array_equal(matrix, current.hosting_matrix()):
        return current
    return Placement.from_matrix(
        current.layers, num_experts, current.servers, matrix, replication, current.version + 1
    )


def layer_quotas(
    capacities: Sequence[int],
    num_layers: int,
    slots_per_layer: int,
    num_experts: int,
    domain_ids: Sequence[int] | None = None,
) -> np.ndarray:
    """int ``[L, S]``: how many replicas of each layer each server holds.

    Every row sums to ``slots_per_layer``; server ``s`` gets about ``capacity[s]``-proportional
    slots in total (never more than its capacity, nor more than E per layer), and where a layer's
    slots do not divide evenly the extra slot rotates over layers — over the servers of one failure
    domain in turn (``domain_ids [S]``), so every domain's share of a layer is even too.
    """
    bounds = np.minimum(np.asarray(capacities, dtype=np.int64), num_layers * num_experts)
    total = num_layers * slots_per_layer
    if bounds.sum() < total:
        raise PlacementError(
            f"{num_layers} layers x {slots_per_layer} slots = {total} exceed the servers' usable capacity "
            f"{int(bounds.sum())}"
        )
    raw = bounds * (total / bounds.sum())
    per_server = np.floor(raw).astype(np.int64)
    shortfall = total - int(per_server.sum())
    # Largest remainders first; ties go to the lower server index (stable sort).
    order = np.argsort(-(raw - per_server), kind="stable")
    per_server[order[:shortfall]] += 1
    base, extra = np.divmod(per_server, num_layers)
    quotas = np.repeat(base[None, :], num_layers, axis=0)
    # Deal each server's extra slots to consecutive layers, continuing where the previous server
    # stopped, so every layer receives the same number of extras.
    cursor = 0
    columns = (
        range(len(extra))
        if domain_ids is None
        else np.argsort(np.asarray(domain_ids), kind="stable").tolist()
    )
    for column in columns:
        count = int(extra[column])
        rows = (cursor + np.arange(count)) % num_layers
        quotas[rows, column] += 1
        cursor += count
    return quotas


def replicate(load: np.ndarray, slots: np.ndarray, replication: int, max_count: np.ndarray) -> np.ndarray:
    """Replica counts: start every expert at R, then repeatedly add one to the expert with the
    highest load per replica.

    Args:
        load: float ``[L, E]``. slots: int ``[L]`` replicas per layer. max_count: int ``[L]`` at most
            this many replicas of one expert (servers that can take it).
    Returns:
        int ``[L, E]`` counts; row ``l`` sums to ``slots[l]``.
    """
    num_layers, num_experts = load.shape
    counts = np.full((num_layers, num_experts), replication, dtype=np.int64)
    extra = slots - replication * num_experts
    rows = np.arange(num_layers)
    for step in range(int(extra.max(initial=0))):
        active = extra > step
        per_replica = load / counts
        per_replica[counts >= max_count[:, None]] = -np.inf
        pick = np.argmax(per_replica, axis=1)
        counts[rows[active], pick[active]] += 1
    return counts


def _replicate_then_pack(
    load: np.ndarray,
    quotas: np.ndarray,
    replication: int,
    domain_ids: np.ndarray,
    needed_domains: int,
    failure_aware: bool = False,
) -> np.ndarray:
    """Global policy over all servers → bool ``[S, L, E]``."""
    slots = quotas.sum(axis=1)
    counts = replicate(load, slots, replication, (quotas > 0).sum(axis=1))
    bins = _Bins(quotas, load / counts, counts if failure_aware else None)
    if needed_domains > 1:
        # Place each expert's first `needed_domains` replicas (one per domain) before the extra
        # ones, so no domain runs out of slots before every expert has a replica in it.
        # Extra replicas of the most replicated experts go first: they need the most distinct servers.
        required = np.minimum(counts, needed_domains)
        _pack(*_items(required, load, counts), bins, domain_ids, needed_domains)
        items, weights = _items(counts - required, load, counts)
        rows = np.arange(len(counts))[:, None]
        priority = np.where(items >= 0, counts[rows, np.maximum(items, 0)], -1)
        _pack(items, weights, bins, domain_ids, needed_domains, priority)
        return bins.matrix()
    return _pack(*_items(counts, load, counts), bins, domain_ids, 1).matrix()


def _spread(
    matrix: np.ndarray,
    load: np.ndarray,
    capacities: Sequence[int],
    domain_ids: np.ndarray,
    replication: int,
    needed_domains: int,
) -> np.ndarray:
    """Make every pair's replicas cover ``needed_domains`` domains. Per-layer quotas can leave a
    domain a slot short in some layer; first try swapping pairs between servers, else add the
    missing replicas on a server of a new domain (dropping a surplus replica there, or shifting
    one pair to a server with room) — the server's total capacity still holds."""
    try:
        repair_spread(matrix, load / np.maximum(matrix.sum(axis=0), 1), domain_ids, needed_domains)
        return matrix
    except PlacementError:
        pass
    search = Search(matrix, load, capacities, domain_ids, replication, needed_domains, CostModel(), 1)
    search.ensure_replicas(search.under_spread())
    return search.matrix()


def _items(copies: np.ndarray, load: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replica lists for ``copies [L, E]`` replicas of each expert: expert id ``[L, N]`` and tokens
    per replica ``load / counts`` ``[L, N]`` (both -1 padded)."""
    num_layers, num_experts = copies.shape
    width = max(1, int(copies.sum(axis=1).max()))
    items = np.full((num_layers, width), -1, dtype=np.int64)
    weights = np.full((num_layers, width), -1.0)
    for row in range(num_layers):
        experts = np.repeat(np.arange(num_experts), copies[row])
        items[row, : len(experts)] = experts
        weights[row, : len(experts)] = load[row, experts] / counts[row, experts]
    return items, weights


class _Bins:
    """Packing state, per layer: tokens per server ``packed [L, S]``, free slots
    ``remaining [L, S]``, ``hosts [L, E, S]``, and tokens per replica ``share [L, E]``.

    With the experts' final replica ``counts [L, E]`` (a failure-aware packing), also
    ``cross [L, S, S]``: the tokens server ``v`` takes over when server ``h`` fails (each shared
    expert's ``share / (count - 1)``, ``extra [L, E]``), kept as replicas are placed."""

    def __init__(self, quotas: np.ndarray, share: np.ndarray, counts: np.ndarray | None = None) -> None:
        num_layers, num_servers = quotas.shape
        self.share = share
        self.packed = np.zeros((num_layers, num_servers))
        self.remaining = quotas.astype(np.int64).copy()
        self.hosts = np.zeros((num_layers, share.shape[1], num_servers), dtype=bool)
        self.extra: np.ndarray | None = None
        self.cross: np.ndarray | None = None
        if counts is not None:
            self.extra = failover_shares(share, counts)
            self.cross = np.zeros((num_layers, num_servers, num_servers))

    def matrix(self) -> np.ndarray:
        """bool ``[S, L, E]``."""
        return np.transpose(self.hosts, (2, 0, 1)).copy()


def _pack(
    items: np.ndarray,
    weights: np.ndarray,
    bins: _Bins,
    domain_ids: np.ndarray,
    needed_domains: int,
    priority: np.ndarray | None = None,
) -> _Bins:
    """Balanced packing, heaviest first, vectorised over layers: each item goes to the server with
    the least tokens that has a slot left in its layer and does not host the item's expert (and,
    while the expert covers fewer than ``needed_domains`` domains, is in a new domain).

    Failure-aware (``bins.cross`` kept): among the servers within ``PARTNER_TOLERANCE`` x the
    item's tokens of the least loaded one, the item goes to the one that takes over least from
    any one of the expert's other hosts should that host fail, then the least loaded. Plain
    heaviest-first packing places an expert's replicas (equal shares) on two servers tied in
    load, and they stay tied: the same two servers end up sharing most of their experts, and
    one's failure doubles the other's load. Spread this way, each server's experts have their
    other replicas on many servers, each of which takes over little.

    items/weights: ``[L, N]`` expert id and tokens per item (-1 = padding). priority: optional
    ``[L, N]``; items with a higher priority go first, then heavier ones. Updates ``bins``.
    """
    num_layers, width = items.shape
    num_servers = bins.remaining.shape[1]
    rows = np.arange(num_layers)
    if priority is None:
        order = np.argsort(-weights, axis=1, kind="stable")
    else:
        order = np.lexsort((-weights, -priority), axis=1)
    items = np.take_along_axis(items, order, axis=1)
    weights = np.take_along_axis(weights, order, axis=1)
    packed, remaining, hosts = bins.packed, bins.remaining, bins.hosts
    spread = needed_domains > 1
    one_hot = np.zeros((num_servers, int(domain_ids.max()) + 1), dtype=np.int64)
    one_hot[np.arange(num_servers), domain_ids] = 1
    for i in range(width):
        expert = items[:, i]
        live = expert >= 0
        if not live.any():
            break
        safe_expert = np.where(live, expert, 0)
        feasible = (remaining > 0) & ~hosts[rows, safe_expert, :]
        if spread:
            holders = hosts[rows, safe_expert, :].astype(np.int64)  # [L, S]
            covered = (holders @ one_hot) > 0  # [L, D]
            wants_new_domain = covered.sum(axis=1) < needed_domains
            fresh = feasible & ~covered[:, domain_ids]
            use_fresh = wants_new_domain & fresh.any(axis=1)
            feasible = np.where(use_fresh[:, None], fresh, feasible)
        stuck = live & ~feasible.any(axis=1)
        score = np.where(feasible, packed, np.inf)
        if bins.cross is None:
            target = np.argmin(score, axis=1)
        else:
            holders = hosts[rows, safe_expert, :]  # [L, S]
            takes = np.where(holders[:, :, None], bins.cross, 0.0).max(axis=1)  # [L, S]
            tolerance = PARTNER_TOLERANCE * np.maximum(weights[:, i], 0.0)
            near = score <= score.min(axis=1)[:, None] + tolerance[:, None]
            takes = np.where(near, takes, np.inf)
            least = takes <= takes.min(axis=1)[:, None] + 1e-12 * np.maximum(tolerance[:, None], 1.0)
            target = np.argmin(np.where(least & near, packed, np.inf), axis=1)
        for row in np.flatnonzero(stuck).tolist():
            try:
                target[row] = _make_room(row, int(expert[row]), bins, domain_ids, needed_domains)
            except PlacementError:
                # No room for this replica anywhere: give its slot to the expert with the highest
                # load per replica that the free server does not host yet.
                server = int(np.argmin(np.where(remaining[row] > 0, packed[row], np.inf)))
                candidates = np.where(hosts[row, :, server], -np.inf, bins.share[row])
                expert[row] = int(np.argmax(candidates))
                target[row] = server
        live_rows = rows[live]
        live_targets = target[live]
        if bins.cross is not None and bins.extra is not None:
            others = (
                hosts[live_rows, expert[live], :] * bins.extra[live_rows, expert[live]][:, None]
            )  # [n, S]
            bins.cross[live_rows, :, live_targets] += others
            bins.cross[live_rows, live_targets, :] += others
        packed[live_rows, live_targets] += weights[live, i]
        remaining[live_rows, live_targets] -= 1
        hosts[live_rows, expert[live], live_targets] = True
    return bins


def _make_room(row: int, expert: int, bins: _Bins, domain_ids: np.ndarray, needed_domains: int) -> int:
    """Every server with a free slot in this layer already hosts ``expert``: move some other
    expert ``f`` from a server ``q`` (not hosting ``expert``) to a free server ``p`` (not hosting
    ``f``, keeping ``f``'s domain spread) and return ``q`` for ``expert``. Rare; only at the tail
    of the packing."""
    hosts, remaining, packed = bins.hosts, bins.remaining, bins.packed

    def spread(holders: np.ndarray) -> int:
        return len(set(domain_ids[holders].tolist()))

    for p in np.flatnonzero(remaining[row] > 0).tolist():
        for q in np.flatnonzero(~hosts[row, expert, :] & (remaining[row] == 0)).tolist():
            for other in np.flatnonzero(hosts[row, :, q] & ~hosts[row, :, p]).tolist():
                if needed_domains > 1:
                    before = hosts[row, other].copy()
                    after = before.copy()
                    after[q], after[p] = False, True
                    if spread(after) < min(needed_domains, spread(before)):
                        continue
                weight = float(bins.share[row, other])
                hosts[row, other, q] = False
                hosts[row, other, p] = True
                packed[row, q] -= weight
                packed[row, p] += weight
                remaining[row, p] -= 1
                remaining[row, q] += 1
                return q
    raise PlacementError(
        f"cannot place replica of expert {expert} in layer row {row}: every server with a free slot "
        "already hosts it; use more servers or fewer replicas"
    )


def _hierarchical(
    load: np.ndarray,
    quotas: np.ndarray,
    domain_ids: np.ndarray,
    num_nodes: int,
    num_groups: int,
    replication: int,
    failure_aware: bool = False,
) -> np.ndarray:
    """Hierarchical policy: groups → nodes (equal count), then replicate and pack inside each node.
    ``domain_ids[S]`` are node indices ``0..num_nodes-1``. Returns bool ``[S, L, E]``."""
    num_layers, num_experts = load.shape
    num_servers = quotas.shape[1]
    group_size = num_experts // num_groups
    group_load = load.reshape(num_layers, num_groups, group_size).sum(axis=2)  # [L, G]
    groups_per_node = num_groups // num_nodes
    node_quota = np.full((num_layers, num_nodes), groups_per_node, dtype=np.int64)
    group_items = np.tile(np.arange(num_groups), (num_layers, 1))
    no_domains = np.arange(num_nodes)
    node_of_group = _pack(
        group_items, group_load, _Bins(node_quota, group_load), no_domains, 1
    ).matrix()  # [N, L, G]
    matrix = np.zeros((num_servers, num_layers, num_experts), dtype=bool)
    for node in range(num_nodes):
        members = np.flatnonzero(domain_ids == node)
        node_slots = quotas[:, members].sum(axis=1)  # [L]
        groups = np.argsort(~node_of_group[node], axis=1, kind="stable")[:, :groups_per_node]  # [L, g]
        experts = (groups[:, :, None] * group_size + np.arange(group_size)).reshape(num_layers, -1)  # [L, En]
        if (node_slots < replication * experts.shape[1]).any():
            raise PlacementError(
                f"node {node} has {int(node_slots.min())} slots in some layer but must host "
                f"{experts.shape[1]} experts x replication {replication}"
            )
        local_load = np.take_along_axis(load, experts, axis=1)
        member_quotas = quotas[:, members]
        counts = replicate(local_load, node_slots, replication, (member_quotas > 0).sum(axis=1))
        bins = _Bins(member_quotas, local_load / counts, counts if failure_aware else None)
        local = _pack(*_items(counts, local_load, counts), bins, np.arange(len(members)), 1).matrix()
        for position, server in enumerate(members.tolist()):
            layer_rows, local_experts = np.nonzero(local[position])
            matrix[server, layer_rows, experts[layer_rows, local_experts]] = True
    return matrix


def keep_in_place(current: Placement, packed: Placement) -> Placement:
    """``packed`` (a from-scratch plan for ``current``'s servers) with, in every layer, the replica
    sets of servers that hold equally many of that layer's experts exchanged so that as many
    replicas as possible stay where ``current`` has them (an assignment problem per layer and set
    size, `scipy.optimize.linear_sum_assignment`). Every server keeps its slot count per layer, so
    capacities hold; an exchange is kept only if the failure-domain spread still holds, else
    ``packed`` is returned. Returns ``packed`` itself when nothing is exchanged."""
    # scipy loads in ~0.5 s: imported here so servers and clients that import placement skip it.
    from scipy.optimize import linear_sum_assignment

    if (packed.ordinals, packed.layers, packed.num_experts) != (
        current.ordinals,
        current.layers,
        current.num_experts,
    ):
        raise PlacementError("keep_in_place needs two placements of the same servers, layers and experts")
    old = current.hosting_matrix()  # [S, L, E]
    new = packed.hosting_matrix()
    # overlap[l, a, b]: experts of layer l that packed server a holds and current server b holds.
    overlap = np.matmul(new.transpose(1, 0, 2).astype(np.float32), old.transpose(1, 2, 0).astype(np.float32))
    sizes = new.sum(axis=2)  # [S, L]
    out = np.zeros_like(new)
    for layer in range(new.shape[1]):
        for size in np.unique(sizes[:, layer]):
            group = np.flatnonzero(sizes[:, layer] == size)
            rows, cols = linear_sum_assignment(overlap[layer][np.ix_(group, group)], maximize=True)
            out[group[cols], layer] = new[group[rows], layer]
    if np.array_equal(out, new):
        return packed
    try:
        return Placement.from_matrix(
            packed.layers, packed.num_experts, packed.servers, out, packed.replication, packed.version
        )
    except PlacementError:  # the exchange broke the failure-domain spread: keep the packing
        return packed
