"""Move-by-move local search on the seed-002 objective (shared by `cost_aware` and `elastic`).

State: which server hosts which (layer, expert), per-layer tokens per server, and how many experts
each server must newly load compared with the current placement. A *move* on layer ``l`` takes an
expert ``e`` off the busiest server ``h`` of that layer:

- relocate ``e`` from ``h`` to a cold server ``v``;
- replicate ``e`` onto ``v`` (all its replicas get a smaller share);
- swap ``e`` with a lighter expert ``f`` of ``v``.

A receiver without a free slot may drop a surplus replica (one whose expert keeps >= R replicas
and its domain spread); the rise of that replica's layer peak is subtracted from the move's gain.
The gain of a move is how far the busiest server it touches ends below the layer's old peak; a
swap, which loads two experts, is ranked by ``SWAP_WEIGHT`` times its gain.

Movement is charged as the busiest loader's time, so moves are taken in *levels*: level ``k``
allows every server up to ``k`` new loads; all layers take their best moves under that allowance
(largest excess first). A level is kept only if its compute gain over the horizon pays for the
extra level of movement; the search looks ``patience`` levels past the best one (a level can pay
after one that does not), stops there (or when nothing moves, or at the move budget) and rolls
back to the best level. A last bounded pass re-runs the best level and the next one allowing
two-step *chains* (`Search.best_chain`: clear room on a cold server with a move that need not
lower the peak, then move a hot expert there), each kept only if the objective improves.

Indices: ``l`` layer row, ``e`` expert, ``s``/``h``/``v`` server column (ordinal order).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np

from eaas.runtime.placement.cost import CostModel
from eaas.runtime.placement.placement import Placement, PlacementError, Server, domain_ids, required_spread

_RELOCATE, _REPLICATE, _SWAP = 0, 1, 2
_FREE: tuple[int, int] = (-1, -1)
_SWAP_RECEIVERS = 4
_CHAIN_RECEIVERS = 2  # coldest open servers tried as the middle server of a two-step chain
_EVICTION_TRIES = 6  # surplus replicas examined per receiver before giving up on it
SWAP_WEIGHT = 0.75  # a swap's gain counts 0.75x: it costs two loads but fixes two servers


class Search:
    """Mutable search state. Build it, optionally `ensure_replicas`, then `optimize`, then read
    `matrix()`.

    Args:
        start: bool ``[S, L, E]`` the assignment to start from.
        original: bool ``[S, L, E]`` what each server hosts in the *current* (serving) placement;
            hosting anything else costs a load.
        load: float ``[L, E]`` predicted tokens per step.
        capacities: ``[S]`` slots. domain_ids: int ``[S]`` failure domain per server.
        replication: R. spread: failure domains each pair's replicas must cover.
        cost / horizon_steps: the objective (see `eaas.runtime.placement.cost`).
        load_allowed: ``[S]`` servers that may load experts (default all).
        charged: ``[S]`` servers whose loads stall serving (default all; a new server is not).
        max_moves: stop after this many moves.
        min_gain_fraction: ignore moves that lower a layer's peak by less than this fraction of the
            layer's mean tokens per server (smaller gains are within the load estimate's noise).
    """

    def __init__(
        self,
        start: np.ndarray,
        original: np.ndarray,
        load: np.ndarray,
        capacities: Sequence[int],
        domain_ids: Sequence[int],
        replication: int,
        spread: int,
        cost: CostModel,
        horizon_steps: int,
        *,
        load_allowed: Sequence[bool] | None = None,
        charged: Sequence[bool] | None = None,
        max_moves: int | None = None,
        min_gain_fraction: float = 2e-3,
    ) -> None:
        num_servers, num_layers, num_experts = start.shape
        self.num_servers, self.num_layers, self.num_experts = num_servers, num_layers, num_experts
        self.replication = replication
        self.load: list[list[float]] = load.tolist()
        self.cap = [int(c) for c in capacities]
        self.dom = [int(d) for d in domain_ids]
        self.need_dom = spread
        self.allowed = list(load_allowed) if load_allowed is not None else [True] * num_servers
        self.charged = list(charged) if charged is not None else [True] * num_servers
        self.coef = horizon_steps * cost.seconds_per_token
        self.fixed = horizon_steps * num_layers * cost.seconds_per_layer
        self.move_cost = cost.seconds_per_expert_load
        self.max_moves = max_moves
        self.moves = 0
        self.log: list[tuple[int, int, int, int]] = []
        self.layer_version = [0] * num_layers
        self.stuck = [-1] * num_layers
        self._evictable: dict[int, list[tuple[float, int, int]]] = {}
        self._evictable_level: dict[int, int] = {}
        self._peaks: list[tuple[int, float]] = [(-1, 0.0)] * num_layers

        self.hosts: list[list[list[int]]] = _grouped(start.transpose(1, 2, 0))
        on_lists = _grouped(start.transpose(1, 0, 2))
        self.on: list[list[set[int]]] = [[set(experts) for experts in row] for row in on_lists]
        counts = np.maximum(start.sum(axis=0), 1)
        self.srv: list[list[float]] = np.einsum("sle,le->ls", start, load / counts).tolist()
        self.used = start.sum(axis=(1, 2)).tolist()
        self._original = original
        # Original hosts of a pair: when the search starts from the current placement, the hosts
        # lists are copied before their first change (copy on write), else built here.
        self._copy_on_write = original is start
        self._saved_hosts: dict[int, list[int]] = {}
        self._orig_hosts: list[list[list[int]]] = (
            [] if self._copy_on_write else _grouped(original.transpose(1, 2, 0))
        )
        self.level = 0
        self.open_servers: set[int] = set()
        self.closed_servers: set[int] = set()
        self.new_loads = (start & ~original).sum(axis=(1, 2)).tolist()
        total = load.sum(axis=1)
        self.mean = (total / num_servers).tolist()
        charged_count = max(1, sum(self.charged))
        floor = self.move_cost / (charged_count * self.coef)
        self.min_gain = [max(floor, min_gain_fraction * m, 1e-9) for m in self.mean]

    # -- primitive edits (logged for rollback) ---------------------------------------------------

    def add(self, l: int, e: int, s: int) -> None:
        hosts = self.hosts[l][e]
        if self._copy_on_write:
            self._saved_hosts.setdefault(l * self.num_experts + e, list(hosts))
        row = self.srv[l]
        count = len(hosts)
        demand = self.load[l][e]
        new_share = demand / (count + 1)
        if count:
            old_share = demand / count
            for u in hosts:
                row[u] -= old_share - new_share
        row[s] += new_share
        hosts.append(s)
        self.on[l][s].add(e)
        self.used[s] += 1
        if not self._original[s, l, e]:
            self.new_loads[s] += 1
            self._refresh(s)
        self.layer_version[l] += 1
        self.log.append((0, l, e, s))

    def remove(self, l: int, e: int, s: int) -> None:
        hosts = self.hosts[l][e]
        if self._copy_on_write:
            self._saved_hosts.setdefault(l * self.num_experts + e, list(hosts))
        row = self.srv[l]
        count = len(hosts)
        demand = self.load[l][e]
        old_share = demand / count
        hosts.remove(s)
        row[s] -= old_share
        if count > 1:
            new_share = demand / (count - 1)
            for u in hosts:
                row[u] += new_share - old_share
        self.on[l][s].discard(e)
        self.used[s] -= 1
        if not self._original[s, l, e]:
            self.new_loads[s] -= 1
            self._refresh(s)
        self.layer_version[l] += 1
        self.log.append((1, l, e, s))

    def undo_to(self, position: int) -> None:
        while len(self.log) > position:
            kind, l, e, s = self.log.pop()
            if kind == 0:
                self.remove(l, e, s)
            else:
                self.add(l, e, s)
            self.log.pop()

    def orig_hosts(self, l: int, e: int) -> list[int]:
        """Servers that host (l, e) in the current placement (hosting it again costs no load)."""
        if self._copy_on_write:
            saved = self._saved_hosts.get(l * self.num_experts + e)
            return self.hosts[l][e] if saved is None else saved
        return self._orig_hosts[l][e]

    def is_open(self, s: int) -> bool:
        """Server ``s`` may load one more expert at the current level."""
        return self.allowed[s] and (not self.charged[s] or self.new_loads[s] < self.level)

    def set_level(self, level: int) -> None:
        self.level = level
        self.open_servers = {s for s in range(self.num_servers) if self.is_open(s)}
        self.closed_servers = {s for s in range(self.num_servers) if self.allowed[s]} - self.open_servers

    def _refresh(self, s: int) -> None:
        if not self.allowed[s]:
            return
        if self.is_open(s):
            self.open_servers.add(s)
            self.closed_servers.discard(s)
        else:
            self.open_servers.discard(s)
            self.closed_servers.add(s)

    # -- objective -------------------------------------------------------------------------------

    def max_charged_loads(self) -> int:
        return max((n for n, c in zip(self.new_loads, self.charged, strict=True) if c), default=0)

    def objective(self) -> float:
        """Predicted seconds (without planner runtime) of the current state."""
        peaks = sum(max(row) for row in self.srv)
        return self.fixed + self.coef * peaks + self.move_cost * self.max_charged_loads()

    # -- feasibility helpers -----------------------------------------------------------------------

    def spread_ok(self, hosts: Iterable[int]) -> bool:
        if self.need_dom <= 1:
            return True
        return len({self.dom[u] for u in hosts}) >= self.need_dom

    def find_slot(self, s: int, layer: int, any_harm: bool = False) -> tuple[tuple[int, int], float] | None:
        """A slot on server ``s`` and what taking it costs: ``(_FREE, 0)``, or a surplus replica
        ``(l2, e2)`` to drop (never in ``layer``) with the rise of layer ``l2``'s peak that dropping
        it causes (its tokens move to the other replicas); None if there is none. Only the lightest
        few surplus replicas are examined unless ``any_harm``."""
        if self.used[s] < self.cap[s]:
            return _FREE, 0.0
        candidates = self._evictable.get(s)
        if candidates is None or (not candidates and self._evictable_level.get(s, -1) < self.level):
            candidates = self._build_evictable(s)
            self._evictable_level[s] = self.level
        best: tuple[tuple[int, int], float] | None = None
        tries = 0
        for index in range(len(candidates) - 1, -1, -1):
            _, l2, e2 = candidates[index]
            if l2 == layer:
                continue
            harm = self._eviction_harm(l2, e2, s)
            if harm is None:
                del candidates[index]
                continue
            if best is None or harm < best[1]:
                best = ((l2, e2), harm)
                if harm == 0.0:
                    break
            tries += 1
            if tries >= _EVICTION_TRIES and not any_harm:
                break
        return best

    def _build_evictable(self, s: int) -> list[tuple[float, int, int]]:
        found = []
        for l2 in range(self.num_layers):
            for e2 in self.on[l2][s]:
                count = len(self.hosts[l2][e2])
                if count > self.replication:
                    found.append((self.load[l2][e2] / count, l2, e2))
        found.sort(reverse=True)  # lightest share last
        self._evictable[s] = found
        return found

    def _eviction_harm(self, l2: int, e2: int, s: int) -> float | None:
        """How much dropping (l2, e2) from s raises layer l2's peak; None if it must stay (R or
        the domain spread would break)."""
        hosts = self.hosts[l2][e2]
        count = len(hosts)
        if e2 not in self.on[l2][s] or count <= self.replication:
            return None
        others = [u for u in hosts if u != s]
        if not self.spread_ok(others):
            return None
        demand = self.load[l2][e2]
        delta = demand / (count - 1) - demand / count
        row = self.srv[l2]
        peak = self.peak(l2)
        return max(0.0, max(row[u] for u in others) + delta - peak)

    def peak(self, l: int) -> float:
        """The busiest server's tokens in layer ``l`` (cached per layer version)."""
        version, value = self._peaks[l]
        if version != self.layer_version[l]:
            value = max(self.srv[l])
            self._peaks[l] = (self.layer_version[l], value)
        return value

    # -- moves -------------------------------------------------------------------------------------

    def best_move(
        self, l: int, level: int
    ) -> tuple[tuple[int, int, int, int, int, tuple[int, int]] | None, bool]:
        """Best move off the busiest server of layer ``l`` under load allowance ``level``.

        The gain of a move is how far it lowers the busiest of the servers it touches below the
        layer's peak (with near-ties at the top, each move lowers one of the top servers and the
        layer's peak falls over several moves; every move lowers the sorted load vector
        lexicographically, so the search cannot cycle within a layer).

        Returns (move, blocked): move = (kind, e, h, v, f, slot) or None; blocked = a better move
        may exist once servers get more load allowance or free slots (at a higher level).
        """
        row = self.srv[l]
        peak = max(row)
        hottest = row.index(peak)
        best_gain = self.min_gain[l]
        if peak - self.mean[l] <= best_gain:
            return None, False
        # Receivers: servers with load allowance left this level, coldest first.
        receivers = sorted(self.open_servers, key=row.__getitem__)
        best: tuple[int, int, int, int, int, tuple[int, int]] | None = None
        blocked = False
        on_layer, hosts_layer, load_layer = self.on[l], self.hosts[l], self.load[l]
        hot_experts = sorted(on_layer[hottest])
        sorted_on: dict[int, list[int]] = {}  # the swap partners' experts, sorted (per call)
        for e in hot_experts:
            hosts = hosts_layer[e]
            count = len(hosts)
            demand = load_layer[e]
            share = demand / count
            if share <= best_gain:
                continue
            # Receivers for e: open servers, plus closed ones that hosted e before (no load).
            candidates = receivers
            if self.closed_servers:
                # (The hottest server itself is never a receiver, so it is left out.)
                returning = [
                    v
                    for v in self.orig_hosts(l, e)
                    if v != hottest and v in self.closed_servers and self.allowed[v]
                ]
                if returning:
                    candidates = sorted([*receivers, *returning], key=row.__getitem__)
            # Relocate e from the hottest server to the coldest one that can take it.
            new_h = peak - share
            for v in candidates:
                if peak - (row[v] + share) <= best_gain:
                    break
                if v == hottest or e in on_layer[v]:
                    continue
                if self.need_dom > 1 and not self.spread_ok([u for u in hosts if u != hottest] + [v]):
                    continue
                found = self.find_slot(v, l)
                if found is None:
                    blocked = True
                    continue
                slot, harm = found
                gain = peak - max(new_h, row[v] + share) - harm
                if gain > best_gain:
                    best_gain, best = gain, (_RELOCATE, e, hottest, v, -1, slot)
                break
            # Replicate e onto the coldest server that can take it.
            if count < self.num_servers:
                new_share = demand / (count + 1)
                hosts_max = row[hosts[0]] if count == 1 else max([row[u] for u in hosts])
                hosts_peak = hosts_max - (share - new_share)
                for v in candidates:
                    if peak - max(row[v] + new_share, hosts_peak) <= best_gain:
                        break
                    if e in on_layer[v]:
                        continue
                    found = self.find_slot(v, l)
                    if found is None:
                        blocked = True
                        continue
                    slot, harm = found
                    gain = peak - max(hosts_peak, row[v] + new_share) - harm
                    if gain > best_gain:
                        best_gain, best = gain, (_REPLICATE, e, hottest, v, -1, slot)
                    break
            # Swap e with a lighter expert f of one of the coldest servers (both sides load).
            if not self.is_open(hottest):
                continue
            tried = 0
            for v in candidates:
                if tried >= _SWAP_RECEIVERS:
                    break
                if v == hottest or e in on_layer[v]:
                    continue
                tried += 1
                row_v = row[v]
                if SWAP_WEIGHT * min(share, peak - row_v) <= best_gain:
                    break
                experts_v = sorted_on.get(v)
                if experts_v is None:
                    experts_v = sorted_on[v] = sorted(on_layer[v])
                for f in experts_v:
                    if f in on_layer[hottest]:
                        continue
                    share_f = load_layer[f] / len(hosts_layer[f])
                    if share_f >= share:
                        continue
                    # A swap loads two experts: rank it by its gain per load.
                    gain = SWAP_WEIGHT * (peak - max(peak - share + share_f, row_v - share_f + share))
                    if gain <= best_gain:
                        continue
                    if self.need_dom > 1 and not (
                        self.spread_ok([u for u in hosts if u != hottest] + [v])
                        and self.spread_ok([u for u in hosts_layer[f] if u != v] + [hottest])
                    ):
                        continue
                    best_gain, best = gain, (_SWAP, e, hottest, v, f, _FREE)
        if best is None and not blocked and self.closed_servers and hot_experts:
            # A server out of allowance could take a move if it is cold enough.
            coldest_closed = min([row[v] for v in self.closed_servers])
            lightest = min(load_layer[e] / (len(hosts_layer[e]) + 1) for e in hot_experts)
            blocked = coldest_closed + lightest < peak - self.min_gain[l]
        return best, blocked

    def best_chain(self, l: int) -> tuple[int, int, int, int, int, int] | None:
        """A two-step move for a layer in a local optimum that needs a neutral first step: clear
        room on a cold server ``v`` by relocating one of its experts ``g`` to another open server
        ``w`` with a free slot (this step alone need not lower the peak), then relocate or replicate
        an expert ``e`` of the busiest server ``h`` onto ``v``. It loads two experts (``g`` on ``w``,
        ``e`` on ``v``), like a swap. Bounded: the ``_CHAIN_RECEIVERS`` coldest open servers as
        ``v``; ``w`` coldest first. Every server it touches ends more than ``min_gain`` below the old
        peak, so the search still cannot cycle.

        Returns ``(g, v, w, kind, e, h)`` or None.
        """
        row = self.srv[l]
        peak = max(row)
        hottest = row.index(peak)
        best_gain = self.min_gain[l]
        if peak - self.mean[l] <= best_gain:
            return None
        receivers = [v for v in sorted(self.open_servers, key=row.__getitem__) if v != hottest]
        if len(receivers) < 2:
            return None
        on_layer, hosts_layer, load_layer = self.on[l], self.hosts[l], self.load[l]
        hot_experts = sorted(on_layer[hottest])
        swap_back = hottest in self.open_servers
        has_slot = self.used[hottest] < self.cap[hottest]
        best: tuple[int, int, int, int, int, int] | None = None
        for v in receivers[:_CHAIN_RECEIVERS]:
            for e in hot_experts:
                if e in on_layer[v]:
                    continue
                hosts = hosts_layer[e]
                count = len(hosts)
                demand = load_layer[e]
                share = demand / count
                others = [u for u in hosts if u != hottest]
                # (kind, share added to v, new load of h, highest other host of e after the move)
                options: list[tuple[int, float, float, float]] = []
                others_max = max([row[u] for u in others], default=0.0)
                if self.need_dom <= 1 or self.spread_ok([*others, v]):
                    options.append((_RELOCATE, share, peak - share, others_max))
                if count < self.num_servers:
                    new_share = demand / (count + 1)
                    drop = share - new_share
                    options.append((_REPLICATE, new_share, peak - drop, others_max - drop))
                for kind, added, new_h, others_top in options:
                    hosts_top = max(new_h, others_top)
                    if peak - hosts_top <= best_gain:
                        continue
                    for g in sorted(on_layer[v]):
                        g_hosts = hosts_layer[g]
                        share_g = load_layer[g] / len(g_hosts)
                        top = max(hosts_top, row[v] - share_g + added)
                        if peak - top <= best_gain:
                            continue
                        g_others = [u for u in g_hosts if u != v]
                        for w in receivers:
                            if w == v or g in on_layer[w] or self.used[w] >= self.cap[w]:
                                continue
                            gain = peak - max(top, row[w] + share_g)
                            if gain <= best_gain:
                                break  # receivers are coldest first
                            if self.need_dom > 1 and not self.spread_ok([*g_others, w]):
                                continue
                            best_gain, best = gain, (g, v, w, kind, e, hottest)
                            break
                        # Or g goes to the busiest server (a swap when e is relocated from it).
                        if swap_back and g not in on_layer[hottest] and (kind == _RELOCATE or has_slot):
                            gain = peak - max(others_top, new_h + share_g, row[v] - share_g + added)
                            spread = self.need_dom <= 1 or self.spread_ok([*g_others, hottest])
                            if gain > best_gain and spread:
                                best_gain, best = gain, (g, v, hottest, kind, e, hottest)
        return best

    def apply(self, l: int, move: tuple[int, int, int, int, int, tuple[int, int]]) -> None:
        kind, e, h, v, f, slot = move
        if slot != _FREE:
            self.remove(slot[0], slot[1], v)
        if kind == _RELOCATE:
            self.remove(l, e, h)
            self.add(l, e, v)
        elif kind == _REPLICATE:
            self.add(l, e, v)
        else:
            self.remove(l, e, h)
            self.remove(l, f, v)
            self.add(l, e, v)
            self.add(l, f, h)
        self.moves += 1

    # -- driver ------------------------------------------------------------------------------------

    def run_level(self, level: int, chains: bool = False) -> int:
        """Take best moves, largest-excess layer first, until no layer can improve. Returns moves.
        With ``chains``, a layer without an improving move tries a two-step `best_chain`."""
        self.set_level(level)
        heap = [
            (-(max(self.srv[l]) - self.mean[l]), l)
            for l in range(self.num_layers)
            if self.stuck[l] != self.layer_version[l]
        ]
        heapq.heapify(heap)
        made = 0
        safety = 4 * self.num_servers * self.num_layers * max(1, level)
        while heap and made < safety:
            negative_excess, l = heapq.heappop(heap)
            excess = max(self.srv[l]) - self.mean[l]
            if excess < -negative_excess - 1e-9:
                heapq.heappush(heap, (-excess, l))
                continue
            move, blocked = self.best_move(l, level)
            if move is not None:
                self.apply(l, move)
            elif chains and (chain := self.best_chain(l)) is not None:
                g, v, w, kind, e, h = chain
                self.remove(l, g, v)
                self.add(l, g, w)
                self.apply(l, (kind, e, h, v, -1, _FREE))
            else:
                if not blocked or chains:
                    self.stuck[l] = self.layer_version[l]
                continue
            made += 1
            if self.max_moves is not None and self.moves >= self.max_moves:
                break
            heapq.heappush(heap, (-(max(self.srv[l]) - self.mean[l]), l))
        return made

    def optimize(self, patience: int = 2, chains: bool = True) -> float:
        """Run levels until one does not pay (keeping up to ``patience`` unpaid levels in search of
        a later one that does); roll back to the best. Then, with ``chains``, a bounded escape from
        local optima: the best level and the next one again, now also taking two-step chains
        (`best_chain`), each kept only if the objective improves. Returns the best objective."""
        best = self.objective()
        best_position = len(self.log)
        level = self.max_charged_loads()
        best_level = level
        if level == 0:
            level = 1
        while True:
            made = self.run_level(level)
            value = self.objective()
            if value < best - 1e-12:
                best, best_position, best_level = value, len(self.log), level
            out_of_budget = self.max_moves is not None and self.moves >= self.max_moves
            if made == 0 or out_of_budget or level - best_level >= patience:
                break
            level += 1
        self.undo_to(best_position)
        if not chains or (self.max_moves is not None and self.moves >= self.max_moves):
            return best
        for level in (max(best_level, 1), max(best_level, 1) + 1):
            self.stuck = [-1] * self.num_layers
            self.run_level(level, chains=True)
            value = self.objective()
            if value < best - 1e-12:
                best, best_position = value, len(self.log)
            else:
                self.undo_to(best_position)
        return best

    def ensure_replicas(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Add replicas until each (l, e) in ``pairs`` has R of them over enough domains, on the
        servers with the fewest new loads (then the least tokens). Raises if impossible."""
        for l, e in pairs:
            hosts = self.hosts[l][e]
            while len(hosts) < self.replication or not self.spread_ok(hosts):
                want_domain = self.need_dom > 1 and not self.spread_ok(hosts)
                covered = {self.dom[u] for u in hosts}
                best: tuple[tuple[int, float], int, tuple[int, int]] | None = None
                for v in range(self.num_servers):
                    if not self.allowed[v] or e in self.on[l][v]:
                        continue
                    if want_domain and self.dom[v] in covered:
                        continue
                    key = (self.new_loads[v] if self.charged[v] else 0, self.srv[l][v])
                    if best is not None and key >= best[0]:
                        continue
                    found = self.find_slot(v, -1, any_harm=True)
                    if found is not None:
                        best = (key, v, found[0])
                if best is None:
                    if self._shift_and_add(l, e, covered if want_domain else set()):
                        continue
                    raise PlacementError(
                        f"no server can take a replica of (layer row {l}, expert {e}): every server that "
                        "does not host it (in a new failure domain where one is needed) is full"
                    )
                _, v, slot = best
                if slot != _FREE:
                    self.remove(slot[0], slot[1], v)
                self.add(l, e, v)

    def _shift_and_add(self, l: int, e: int, avoid_domains: set[int]) -> bool:
        """Make room for (l, e): move some pair f from a full server v that lacks e to a server u
        with a free slot that lacks f (keeping f's spread), then put e on v."""
        free = [u for u in range(self.num_servers) if self.allowed[u] and self.used[u] < self.cap[u]]
        for v in range(self.num_servers):
            if not self.allowed[v] or e in self.on[l][v] or self.dom[v] in avoid_domains:
                continue
            for l2 in range(self.num_layers):
                for f in sorted(self.on[l2][v]):
                    if (l2, f) == (l, e):
                        continue
                    for u in free:
                        if u == v or f in self.on[l2][u]:
                            continue
                        if not self.spread_ok([w for w in self.hosts[l2][f] if w != v] + [u]):
                            continue
                        self.remove(l2, f, v)
                        self.add(l2, f, u)
                        self.add(l, e, v)
                        return True
        return False

    def matrix(self) -> np.ndarray:
        """bool ``[S, L, E]`` of the state."""
        result = np.zeros((self.num_servers, self.num_layers, self.num_experts), dtype=bool)
        for l, per_expert in enumerate(self.hosts):
            for e, hosts in enumerate(per_expert):
                for s in hosts:
                    result[s, l, e] = True
        return result


def search_for(
    current: Placement,
    servers: Sequence[Server],
    start: np.ndarray,
    original: np.ndarray,
    load: np.ndarray,
    cost: CostModel,
    horizon_steps: int,
    *,
    replication: int | None = None,
    load_allowed: Sequence[bool] | None = None,
    charged: Sequence[bool] | None = None,
    max_moves: int | None = None,
) -> Search:
    """A `Search` over ``servers`` (in ordinal order, the columns of ``start``/``original``) for
    ``current``'s layers and experts, with their capacities, failure domains and the spread that
    ``replication`` (default ``current.replication``) needs."""
    domains, _ = domain_ids(servers)
    replicas = replication or current.replication
    return Search(
        start,
        original,
        load,
        [s.capacity for s in servers],
        domains.tolist(),
        replicas,
        required_spread(servers, len(current.layers) * current.num_experts, replicas),
        cost,
        horizon_steps,
        load_allowed=load_allowed,
        charged=charged,
        max_moves=max_moves,
    )


def _grouped(matrix: np.ndarray) -> list[list[list[int]]]:
    """bool ``[A, B, C]`` -> for every (a, b), the ascending ``c`` where it is set (nested lists)."""
    size_a, size_b, size_c = matrix.shape
    flat = matrix.reshape(size_a * size_b, size_c)
    _, columns = np.nonzero(flat)
    values = columns.tolist()
    ends = np.cumsum(flat.sum(axis=1)).tolist()
    starts = [0, *ends[:-1]]
    lists = [values[a:b] for a, b in zip(starts, ends, strict=True)]
    return [lists[a * size_b : (a + 1) * size_b] for a in range(size_a)]
