"""The planners' one search: round-based local search on the seed-002 objective, batched over
layers in numpy. `cost_aware` rebalances with it; `add_server`, `drain_server` and `recover`
restore R with it (`Search.ensure_replicas`) and then rebalance with it; EPLB's packing repairs
its domain spread with `ensure_replicas`.

Moves take an expert ``e`` off a busy server ``h`` of a layer and relocate it to a cold server
``v``, replicate it there, or swap it with a lighter expert ``f`` of ``v``, evaluated for every
layer at once with array operations, a few moves per layer per *round*.

Movement is charged as the busiest loader's time, so a round's *allowance* is the busiest
loader's new loads plus a *step*: every server may newly load up to that many experts in all. In a
round every layer proposes its best move off each of its busiest servers (pairing the i-th busiest
with the i-th and (P+i)-th coldest servers that have a free slot, and for the two busiest also a
swap with the i-th coldest open server); proposals are granted largest gain first while the
servers they load have allowance and slots left, and moves of one layer in one round touch
distinct servers and experts. Where cold servers are full, the round first drops surplus
replicas there (`Search._drops`) so that moves can land there. After each round the
objective (compute over the horizon + movement) decides: keep, keep on trial, or take back and
halve the step (see `Search.optimize`).

The gain of a move is how far the busiest server it touches ends below that busy server's tokens
(with near-ties at the top the layer's peak falls over several moves); a swap loads two experts
and counts ``swap_weight`` times its gain. Every granted move lowers the layer's sorted load
vector and a drop raises no peak. Moves keep every pair's replica count (R) and its
failure-domain spread.

With ``cost.failover_factor`` > 0 the objective also counts how far each layer's failover peak
exceeds its bound (`eaas.runtime.placement.cost`), and a layer where it does also proposes
*failover moves* (`Search._failover_proposals`): with ``s`` the server whose failure
overloads ``u`` most, take an expert both host off ``u`` or off ``s``, or give it another replica
(in a free slot or in place of a surplus replica), on a server that would carry little should
``s`` fail. Such a move may raise the healthy peak; a round is kept only if the objective falls,
so the search still ends. The tokens each server takes over from each other one are kept in
``overlap [L, S, S]``, updated move by move.

A move budget (``max_moves``) counts loads: (layer, expert, server) slots hosted now and not at
the start. When a round's proposals would load more than is left, they are granted by gain per
load instead of by gain (`Search._grant`), so a budget that binds buys the most gain.

Servers may be barred from loading (``load_allowed``: a server being added is the only one that
loads) or load without stalling anyone (``charged`` false: a new server loads before it serves).
On small instances `Search.settle` follows the rounds with an iterated local search
(`Search.escape`): random neutral moves, each kept only if optimizing from it ends better, which
finds the two-step improvements (make room, then move a hot expert there) no improving move takes.

Shapes: ``L`` layers, ``E`` experts per layer, ``S`` servers; ``K`` the most experts a server
hosts in one layer (the padded width of per-server expert lists).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from eaas.runtime.placement.cost import (
    CostModel,
    failover_limits,
    failover_overlap,
    failover_shares,
    overlap_cells,
)
from eaas.runtime.placement.placement import Placement, PlacementError, Server, domain_ids, required_spread

SWAP_WEIGHT = 0.75  # a swap's gain counts 0.75x: it loads two experts
_RELOCATE, _REPLICATE, _SWAP, _DROP, _REPLACE = 0, 1, 2, 3, 4
PAIRS_PER_STEP = 1.0  # busy servers per layer that propose a move, per unit of step
MIN_PAIRS = 4  # busy servers per layer that propose a move at least (near-ties at the top need several)
HALVE_BELOW = 3.0  # halve the step when a round gains less than this many loads per unit of step
_SWAP_PAIRS = 2  # busiest servers per layer that also try swaps
_SPARE_COLUMNS = 4  # free columns added to the per-server expert table when it fills
SMALL_CELLS = 1 << 12  # S x L x E up to which a search is cheap enough to also `escape`
ESCAPE_TRIES = 32  # kicks of the iterated local search on small instances (`Search.escape`)
_FREE_SLOT = (-1, -1)
_FAILOVER_PAIRS = 4  # survivors per layer (most loaded after a failure) that get a failover move
_FAILOVER_RECEIVERS = 2  # servers tried as a failover move's receiver (besides the two it involves)


class Search:
    """Build it (`search_for` builds it for a placement), optionally `ensure_replicas`, then
    `optimize` (and on small instances `escape`), then read `matrix()`.

    Args:
        matrix: bool ``[S, L, E]`` what each server hosts now (servers in ordinal order); hosting
            anything else costs a load. May hold pairs below R (`ensure_replicas` restores them).
        load: float ``[L, E]`` predicted tokens per step (validated by the caller).
        capacities: ``[S]`` slots. domain_ids: int ``[S]`` failure domain per server.
        replication: R. spread: failure domains each pair's replicas must cover; moves keep both.
        cost / horizon_steps: the objective (see `eaas.runtime.placement.cost`).
        load_allowed: ``[S]`` servers that may load experts (default all).
        charged: ``[S]`` servers whose loads stall serving (default all; a new server's do not).
        tokens: optional forecast tokens ``[L, S]`` of ``matrix``, if the caller has them.
        entries: optional ``matrix``'s hosted pairs as `Placement.hosted_entries` gives them
            (layer, server, expert index arrays in that order, replica counts), if the caller has
            them.
        max_moves: a budget of loads: the search never hosts more than this many (layer, expert,
            server) slots that the start did not (a relocation or replication loads one, a swap
            two); when it binds, moves are granted by gain per load (`Search._grant`).
        min_gain_fraction: ignore moves that lower a layer's peak by less than this fraction of the
            layer's mean tokens per server (smaller gains are within the load estimate's noise).
        swap_weight: a swap's gain is multiplied by this when ranking moves (it loads two experts).
    """

    def __init__(
        self,
        matrix: np.ndarray,
        load: np.ndarray,
        capacities: Sequence[int],
        domain_ids: Sequence[int] | np.ndarray,
        replication: int,
        spread: int,
        cost: CostModel,
        horizon_steps: int,
        *,
        load_allowed: Sequence[bool] | None = None,
        charged: Sequence[bool] | None = None,
        tokens: np.ndarray | None = None,
        entries: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
        max_moves: int | None = None,
        min_gain_fraction: float = 2e-3,
        swap_weight: float = SWAP_WEIGHT,
    ) -> None:
        self.swap_weight = swap_weight
        start = np.asarray(matrix, dtype=bool)
        num_servers, num_layers, num_experts = start.shape
        self.num_servers, self.num_layers, self.num_experts = num_servers, num_layers, num_experts
        self.load = np.asarray(load, dtype=np.float64)
        self.servers_experts = np.array(start.transpose(1, 0, 2), order="C")  # [L, S, E] (a copy)
        if entries is None:
            layer, server, expert = np.nonzero(self.servers_experts)  # in (l, s, e) order
            counts = start.sum(axis=0)
        else:
            layer, server, expert, counts = entries
        layer_server = layer * num_servers + server
        self.experts_servers = np.zeros((num_layers, num_experts, num_servers), dtype=bool)  # [L, E, S]
        self.experts_servers[layer, expert, server] = True
        self.original = self.experts_servers.copy()
        self.count = np.array(counts, dtype=np.int64)  # [L, E] replicas
        self.mean = self.load.sum(axis=1) / max(1, num_servers)  # [L] tokens per server
        # Forecast tokens of a share x are x + risk * x^2 (`eaas.runtime.placement.cost`).
        self.risk = cost.load_error / np.where(self.mean > 0, self.mean, 1.0)  # [L]
        self.share = self._per_replica(np.arange(num_layers)[:, None], self.load, np.maximum(self.count, 1))
        if tokens is None:
            tokens = np.bincount(
                layer_server, weights=self.share[layer, expert], minlength=num_layers * num_servers
            ).reshape(num_layers, num_servers)
        self.tokens = np.array(tokens, dtype=np.float64)  # [L, S]
        # The experts each server hosts in each layer, -1 padded: [L, S, W].
        per_cell = np.bincount(layer_server, minlength=num_layers * num_servers)
        width = int(per_cell.max(initial=0)) + _SPARE_COLUMNS
        table = np.full((num_layers * num_servers, width), -1, dtype=np.int64)
        table[layer_server, np.arange(len(layer)) - (np.cumsum(per_cell) - per_cell)[layer_server]] = expert
        self.table = table.reshape(num_layers, num_servers, width)
        self.filled = per_cell.reshape(num_layers, num_servers)  # [L, S] experts per cell
        self.used = np.bincount(server, minlength=num_servers).astype(np.int64)
        self.capacity = np.array(capacities, dtype=np.int64)
        self.domains = np.asarray(domain_ids, dtype=np.int64)
        self.spread = spread
        # Whether a move can break the spread: not where every server is its own failure domain
        # (a pair's replicas are always on distinct servers).
        self.guards_spread = spread > 1 and len(np.unique(self.domains)) < num_servers
        self.replication = replication
        self.domain_onehot = np.eye(int(self.domains.max()) + 1 if num_servers else 1)[self.domains]  # [S, D]
        self.allowed = np.ones(num_servers, bool) if load_allowed is None else np.array(load_allowed, bool)
        self.charged = np.ones(num_servers, bool) if charged is None else np.array(charged, bool)
        self.new_loads = np.zeros(num_servers, dtype=np.int64)
        self.coef = horizon_steps * cost.seconds_per_token
        self.fixed = horizon_steps * num_layers * cost.seconds_per_layer
        self.move_cost = cost.seconds_per_expert_load
        self.max_moves = max_moves
        floor = self.move_cost / (max(1, int(self.charged.sum())) * self.coef)
        self.min_gain = np.maximum(np.maximum(min_gain_fraction * self.mean, floor), 1e-9)
        self.rows = np.arange(num_layers)
        self._journal: list[tuple[np.ndarray, ...]] = []  # moves applied and not taken back, in order
        self.failover_factor = cost.failover_factor
        # [L, S, S] tokens u takes over when s fails, at [l, s, u]; -inf on the diagonal (a server
        # takes nothing over from itself), so that a maximum over s needs no copy.
        self.overlap: np.ndarray | None = None
        if self.failover_factor > 0 and num_servers > 1 and self.replication > 1:
            self.overlap = failover_overlap(self.servers_experts, self.share, self.count)
            diagonal = np.arange(num_servers)
            self.overlap[:, diagonal, diagonal] = -np.inf

    def is_open(self, allowance: int) -> np.ndarray:
        """bool ``[S]``: servers that may load one more expert under ``allowance`` new loads."""
        return self.allowed & (~self.charged | (self.new_loads < allowance))

    def _room(self, allowance: int) -> np.ndarray:
        """int ``[S]``: new loads each server may still take under ``allowance`` (0 where it may
        load nothing; unbounded where its loads are not charged)."""
        room = np.where(self.charged, allowance - self.new_loads, np.iinfo(np.int64).max // 2)
        return np.where(self.allowed, room, 0)

    @property
    def moves(self) -> int:
        """(layer, expert, server) slots loaded so far: hosted now and not at the start (what
        ``max_moves`` bounds; `eaas.runtime.placement.diff` counts the same loads)."""
        return int(self.new_loads.sum())

    def loads_charged(self) -> int:
        """The busiest charged loader's new loads (what movement costs)."""
        return int(self.new_loads[self.charged].max(initial=0))

    def _per_replica(self, layer: np.ndarray, demand: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Forecast tokens of one replica of experts with ``demand`` tokens over ``count``
        replicas, in ``layer`` (arrays broadcast together)."""
        share = demand / count
        return share + self.risk[layer] * share * share

    @property
    def changed(self) -> bool:
        """Whether the state differs from the start (loads or drops; after `optimize`, the best state)."""
        return not np.array_equal(self.experts_servers, self.original)

    # -- objective -------------------------------------------------------------------------------

    def peaks(self) -> np.ndarray:
        """``[L]`` the peak each layer's compute term counts (`eaas.runtime.placement.cost.compute_peaks`)."""
        peaks = self.tokens.max(axis=1)
        limits = self._limits()
        if limits is None or self.overlap is None:
            return peaks
        return peaks + np.maximum(0.0, self._after_worst().max(axis=1) - limits * self.mean)

    def _after_worst(self) -> np.ndarray:
        """``[L, S]`` each server's tokens after the single failure that adds it most (its failover
        load; the layer's maximum is `eaas.runtime.placement.cost.failover_peaks`)."""
        assert self.overlap is not None
        return self.tokens + self.overlap.max(axis=1)

    def _limits(self) -> np.ndarray | None:
        if self.overlap is None:
            return None
        return failover_limits(self.failover_factor, self.count, self.num_servers, self.replication)

    def compute(self) -> float:
        """Predicted compute seconds over the horizon of the current state."""
        return self.fixed + self.coef * float(self.peaks().sum())

    def objective(self) -> float:
        """Predicted seconds (without planner runtime) of the current state."""
        return self.compute() + self.move_cost * self.loads_charged()

    # -- one round ---------------------------------------------------------------------------------

    def _failover_round(self, allowance: int, best: float) -> float:
        """A round of `_failover_proposals` under ``allowance``, kept only if the objective falls
        below ``best``; returns the objective then. Separate from the balancing rounds
        (`_balance_proposals`), so that a failover move that does not pay never costs a balancing
        round its place."""
        if self.overlap is None:
            return best
        proposals = self._failover_proposals(allowance)
        if proposals is None:
            return best
        granted = self._grant(proposals, allowance)
        if len(granted[0]) == 0:
            return best
        self._apply(granted)
        value = self.objective()
        if value < best - 1e-12:
            return value
        self._undo(granted)
        return best

    def _balance_proposals(self, allowance: int, pairs: int) -> tuple[np.ndarray, ...] | None:
        """Every layer's best move off each of its ``pairs`` busiest servers: arrays (gain, kind,
        layer, e, f, h, v) for the (layer, pair) that have an improving move; None if none.

        Pair ``i`` joins the ``i``-th busiest server with the ``i``-th and ``pairs + i``-th coldest
        servers with a free slot (relocation, replication) and, for the busiest ``_SWAP_PAIRS``,
        the ``i``-th coldest open server (swap). The gain is how far the busiest server the move
        touches ends below the busy server's tokens: with ``gap`` = busy - receiver tokens,
        relocating share ``x`` gains ``min(x, gap - x)``, replicating an expert whose share drops
        by ``d`` to ``n`` gains ``min(d, gap - n)``, swapping ``x`` for ``y`` gains
        ``min(x - y, gap - (x - y))``."""
        tokens = self.tokens
        peak = tokens.max(axis=1)
        active = peak - self.mean > self.min_gain
        if not active.any():
            return None
        rows = self.rows[active]
        tokens = tokens[rows]
        layers = len(rows)
        min_gain = self.min_gain[rows]
        order = np.argsort(tokens, axis=1)  # [A, S] coldest first
        hot = order[:, : -pairs - 1 : -1]  # [A, P] busiest first
        row = np.arange(layers)[:, None]  # [A, 1]
        busy = tokens[row, hot]  # [A, P]
        is_open = self.is_open(allowance)
        has_slot = is_open & (self.used < self.capacity)
        candidates = order[:, : self.num_servers - pairs]  # never a busy server
        slot_receivers = _first(candidates, has_slot, 2 * pairs)  # [A, 2P], -1 = none
        slot_receivers = np.stack([slot_receivers[:, :pairs], slot_receivers[:, pairs:]], axis=2)  # [A, P, 2]
        sp = min(pairs, _SWAP_PAIRS)
        w = _first(candidates, is_open, sp)  # [A, P']

        # The busy servers' experts: [A, P, K] (-1 padded); flat indices into [L, E, S] / [L, E].
        width = max(1, int(self.filled[rows[:, None], hot].max()))
        experts = self.table[rows[:, None], hot, :width]
        valid = experts >= 0
        pair_index = rows[:, None, None] * self.num_experts + np.maximum(experts, 0)  # [A, P, K]
        share = np.where(valid, self.share.ravel()[pair_index], 0.0)
        valid &= share > min_gain[:, None, None]
        demand = self.load.ravel()[pair_index]
        count = self.count.ravel()[pair_index]
        hosts_flat = self.experts_servers.reshape(-1)
        check_spread = self.guards_spread
        if check_spread:
            onehot = self.domain_onehot
            covered = self.experts_servers.reshape(-1, self.num_servers)[pair_index] @ onehot  # [A, P, K, D]
            hot_domain = onehot[hot][:, :, None, :]  # [A, P, 1, D]

        x = share[..., None]  # [A, P, K, 1]
        partner_width = max(1, int(self.filled[rows[:, None], np.maximum(w, 0)].max()))
        block = width * 2
        flat = np.full((layers, pairs, 2 * block + width * partner_width), -np.inf)
        # Relocate or replicate e onto a cold server with a free slot: [A, P, K, 2].
        v_safe = np.maximum(slot_receivers, 0)
        gap = (busy[..., None] - tokens[row[..., None], v_safe])[:, :, None, :]
        on_v = hosts_flat[pair_index[..., None] * self.num_servers + v_safe[:, :, None, :]]  # [A, P, K, 2]
        usable = valid[..., None] & ~on_v
        usable &= (slot_receivers >= 0)[:, :, None, :]
        relocate_ok = usable
        if check_spread:
            after = covered[..., None, :] - hot_domain[..., None, :] + onehot[v_safe][:, :, None]
            relocate_ok = usable & ((after > 0).sum(axis=-1) >= self.spread)
        flat[..., :block] = np.where(relocate_ok, np.minimum(x, gap - x), -np.inf).reshape(layers, pairs, -1)
        new_share = self._per_replica(rows[:, None, None], demand, count + 1)[..., None]
        replicate = np.minimum(x - new_share, gap - new_share)
        replicate_ok = usable & (count < self.num_servers)[..., None]
        flat[..., block : 2 * block] = np.where(replicate_ok, replicate, -np.inf).reshape(layers, pairs, -1)
        # Swap e with a lighter expert f of a cold open server: [A, P', K, F].
        w_safe = np.maximum(w, 0)
        hot_s = hot[:, :sp]
        partners = self.table[rows[:, None], w_safe, :partner_width]  # [A, P', F]
        partner_index = rows[:, None, None] * self.num_experts + np.maximum(partners, 0)
        partner_ok = (partners >= 0) & (w >= 0)[..., None]
        partner_ok &= ~hosts_flat[partner_index * self.num_servers + hot_s[..., None]]
        y = np.where(partner_ok, self.share.ravel()[partner_index], np.inf)[:, :, None, :]
        gap_w = (busy[:, :sp] - tokens[row, w_safe])[:, :, None, None]
        e_on_w = hosts_flat[pair_index[:, :sp] * self.num_servers + w_safe[..., None]]  # [A, P', K]
        swap_ok = (valid[:, :sp] & ~e_on_w & is_open[hot_s][..., None])[..., None] & (y < x[:, :sp])
        z = x[:, :sp] - y
        if check_spread:
            w_domain = onehot[w_safe][:, :, None, :]
            e_after = covered[:, :sp] - hot_domain[:, :sp] + w_domain  # [A, P', K, D]
            partner_hosts = self.experts_servers.reshape(-1, self.num_servers)[partner_index]
            f_after = partner_hosts @ onehot - w_domain + hot_domain[:, :sp]  # [A, P', F, D]
            swap_ok &= ((e_after > 0).sum(-1) >= self.spread)[..., None]
            swap_ok &= ((f_after > 0).sum(-1) >= self.spread)[:, :, None, :]
        swap = np.where(swap_ok, self.swap_weight * np.minimum(z, gap_w - z), -np.inf)
        flat[:, :sp, 2 * block : 2 * block + width * partner_width] = swap.reshape(layers, sp, -1)

        best = flat.argmax(axis=2)  # [A, P]
        best_gain = flat.max(axis=2)
        keep = best_gain > min_gain[:, None]
        if not keep.any():
            return None
        layer_index, pair = np.nonzero(keep)
        best = best[layer_index, pair]
        kind = np.where(best < block, _RELOCATE, np.where(best < 2 * block, _REPLICATE, _SWAP))
        local = np.where(best < 2 * block, best % block, 0)
        swap_local = np.maximum(best - 2 * block, 0)
        e_pos = np.where(kind == _SWAP, swap_local // partner_width, local // 2)
        expert = experts[layer_index, pair, e_pos]
        swap_pair = np.minimum(pair, sp - 1)
        is_swap = kind == _SWAP
        partner = np.where(is_swap, partners[layer_index, swap_pair, swap_local % partner_width], -1)
        receiver = np.where(is_swap, w[layer_index, swap_pair], slot_receivers[layer_index, pair, local % 2])
        gain = best_gain[layer_index, pair]
        return gain, kind, rows[layer_index], expert, partner, hot[layer_index, pair], receiver

    def _failover_proposals(self, allowance: int) -> tuple[np.ndarray, ...] | None:
        """Moves against failover peaks, in every layer whose failover peak exceeds its bound by
        more than the minimum gain: for each of the layer's ``_FAILOVER_PAIRS`` survivors ``u``
        loaded most after some failure (``s`` the worst one for ``u``), one move of an expert ``e``
        both host (share ``x``; ``w`` what each other host takes over when one fails):

        - off ``u`` to ``v`` (``u`` sheds ``x + w``),
        - off ``s`` to ``v`` (``u`` sheds ``w``), or
        - onto ``v`` as another replica (every host's share and ``w`` shrink: hot experts get more
          replicas where failures would overload their partners), into a free slot or in place of
          ``v``'s lightest surplus replica in the layer,

        ``v`` among the open servers least loaded after their own worst failure. The gain is how
        far ``u``'s load after a failure falls over the bound, less any rise of the healthy peak,
        estimated from ``u`` and ``v`` alone; the round keeps the moves only if the objective
        improves. Same arrays as `_balance_proposals`."""
        limits = self._limits()
        if limits is None or self.overlap is None:
            return None
        num_servers = self.num_servers
        column = self._after_worst()  # [L, S] each survivor after its worst failure
        bound = limits * self.mean  # [L]
        rows = np.flatnonzero(column.max(axis=1) - bound > self.min_gain)
        if len(rows) == 0:
            return None
        column = column[rows]
        bound = bound[rows, None, None, None]
        peak = self.tokens[rows].max(axis=1)[:, None, None, None]
        layers, pairs = len(rows), min(_FAILOVER_PAIRS, num_servers)
        index = np.arange(layers)[:, None]  # [B, 1]
        survivor = np.argsort(-column, axis=1)[:, :pairs]  # [B, K]
        taken = self.overlap[rows[:, None], :, survivor]  # [B, K, failed s] what each survivor takes over
        failed = taken.argmax(axis=2)  # [B, K]
        top = column[index, survivor][..., None, None]  # [B, K, 1, 1]
        if num_servers > 2:  # the survivors' second worst failures: [B, K]
            second = self.tokens[rows[:, None], survivor] + np.partition(taken, -2, axis=2)[..., -2]
        else:
            second = np.full(survivor.shape, -np.inf)
        second = second[..., None, None]
        x = self.share[rows]  # [B, E]
        count = self.count[rows]
        is_open = self.is_open(allowance)
        lightest, x_dropped, has_surplus = self._lightest_surplus(rows, x, count)  # [B, S] each
        wanted = min(num_servers, _FAILOVER_RECEIVERS + 2)

        def receivers(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """The ``wanted`` servers in ``mask [B, S]`` least loaded after a failure: ids ``[B, C]``
            (-1 = none) and which may take a move of pair ``k`` ``[B, K, C]``."""
            order = np.argsort(np.where(mask, column, np.inf), axis=1)[:, :wanted]
            chosen = np.where(np.take_along_axis(mask, order, axis=1), order, -1)
            ok = (chosen[:, None, :] >= 0) & (chosen[:, None, :] != failed[..., None])
            return chosen, ok & (chosen[:, None, :] != survivor[..., None])

        with_slot, ok_slot = receivers(np.broadcast_to(is_open & (self.used < self.capacity), column.shape))
        with_surplus, ok_surplus = receivers(is_open[None, :] & has_surplus)
        # Candidates: the survivor's experts in the layer that the failed server hosts too
        # ``[B, K, W]`` (W the most a server hosts in a layer, -1 padded), not every expert.
        width = max(1, int(self.filled[rows[:, None], survivor].max()))
        candidate = self.table[rows[:, None], survivor, :width]  # [B, K, W]
        expert_at = np.maximum(candidate, 0)
        at = (index[..., None], expert_at)  # index [B, K, W] arrays of ``[B, E]``
        hosts = self.experts_servers[rows[:, None, None], expert_at]  # [B, K, W, S]
        shared = (candidate >= 0) & np.take_along_axis(hosts, failed[..., None, None], axis=3)[..., 0]
        shared &= x[at] > self.min_gain[rows, None, None]
        if self.guards_spread:
            per_domain = hosts.astype(np.float64) @ self.domain_onehot  # [B, K, W, D] replicas
            covered = (per_domain > 0).sum(axis=3)[..., None]  # [B, K, W, 1] domains
        x4 = x[at][..., None]  # [B, K, W, 1]
        w = failover_shares(x4, count[at][..., None])
        count4 = count[at][..., None]
        new_x = self._per_replica(rows[:, None, None, None], self.load[rows][at][..., None], count4 + 1)
        new_w = new_x / count4
        drop = x4 - new_x
        gains, choices, partners = [], [], []
        for chosen, ok_v, options in (
            (with_slot, ok_slot, ((_RELOCATE, survivor), (_RELOCATE, failed), (_REPLICATE, survivor))),
            (with_surplus, ok_surplus, ((_REPLACE, survivor),)),
        ):
            v = np.maximum(chosen, 0)
            v4 = v[:, None, None, :]  # [B, 1, 1, C]
            usable = shared[..., None] & ok_v[:, :, None, :]
            usable &= ~np.take_along_axis(hosts, np.broadcast_to(v4, usable.shape), axis=3)  # [B, K, W, C]
            column_v = column[index, v][:, None, None, :]  # [B, 1, 1, C]
            # [B, K, 1, C]: v's tokens after the survivor's worst failure
            failed_v = (
                self.tokens[rows[:, None, None], v[:, None, :]]
                + self.overlap[rows[:, None, None], failed[..., None], v[:, None, :]]
            )
            failed_v = failed_v[:, :, None, :]
            tokens_v = self.tokens[rows[:, None], v][:, None, None, :]
            freed = x_dropped[index, v][:, None, None, :] if options[0][0] == _REPLACE else 0.0
            for kind, source in options:
                if kind == _RELOCATE and source is survivor:
                    u_after = np.maximum(top - x4 - w, second - x4)
                    v_after = np.maximum(column_v + x4, failed_v + x4 + w)
                    v_tokens = tokens_v + x4
                elif kind == _RELOCATE:
                    u_after, v_after, v_tokens = np.maximum(top - w, second), column_v + x4 + w, tokens_v + x4
                else:
                    u_after = np.maximum(top - drop - (w - new_w), second - drop)
                    v_after = np.maximum(column_v + new_x, failed_v + new_x + new_w) - freed
                    v_tokens = tokens_v + new_x - freed
                ok = usable
                if kind != _RELOCATE:
                    ok = ok & (count4 < num_servers)
                elif self.guards_spread:
                    # Moving e from ``source`` to ``v`` keeps the spread unless it leaves a domain
                    # without adding another.
                    home, there = self.domains[source], self.domains[v]  # [B, K], [B, C]
                    shape = (*per_domain.shape[:3], len(there[0]))
                    lost = np.take_along_axis(per_domain, home[:, :, None, None], axis=3) == 1  # [B, K, W, 1]
                    won = (
                        np.take_along_axis(
                            per_domain, np.broadcast_to(there[:, None, None, :], shape), axis=3
                        )
                        == 0
                    )
                    after_move = covered - lost + won  # [B, K, W, C]
                    after_move = np.where(
                        home[:, :, None, None] == there[:, None, None, :], covered, after_move
                    )
                    ok = ok & (after_move >= self.spread)
                over_after = np.maximum(0.0, np.maximum(u_after, v_after) - bound)
                gain = (top - bound) - over_after - np.maximum(0.0, v_tokens - peak)
                gains.append(np.where(ok, gain, -np.inf))
                choices.append((kind, source, chosen))
                partners.append(lightest[index, v] if kind == _REPLACE else np.full_like(chosen, -1))
        stacked = np.stack(gains, axis=2).reshape(layers, pairs, -1)  # [B, K, options x W x C]
        best = stacked.argmax(axis=2)
        gain = np.take_along_axis(stacked, best[..., None], axis=2)[..., 0]
        keep = gain > self.min_gain[rows, None]
        if not keep.any():
            return None
        layer_index, pair = np.nonzero(keep)
        option, rest = np.divmod(best[layer_index, pair], width * wanted)
        position, column_index = np.divmod(rest, wanted)
        expert = candidate[layer_index, pair, position]
        kinds = np.array([choice[0] for choice in choices])[option]
        source = np.stack([choice[1] for choice in choices], axis=2)[layer_index, pair, option]
        receiver = np.stack([choice[2] for choice in choices], axis=2)[layer_index, column_index, option]
        partner = np.stack(partners, axis=2)[layer_index, column_index, option]
        return gain[layer_index, pair], kinds, rows[layer_index], expert, partner, source, receiver

    def _lightest_surplus(
        self, rows: np.ndarray, share: np.ndarray, count: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """In layers ``rows [B]`` (``share``, ``count``: their ``[B, E]``), each server's lightest
        surplus replica, whose drop keeps its expert's R and domain spread: expert ``[B, S]``, its
        share (0 where none) and whether there is one. Only pairs above R are looked at."""
        num_servers = self.num_servers
        lightest = np.zeros((len(rows), num_servers), dtype=np.int64)
        dropped = np.zeros((len(rows), num_servers))
        has = np.zeros((len(rows), num_servers), dtype=bool)
        pair_b, pair_e = np.nonzero(count > self.replication)
        if len(pair_b) == 0:
            return lightest, dropped, has
        hosts = self.experts_servers[rows[pair_b], pair_e]  # [N, S]
        entry, server = np.nonzero(hosts)
        if self.guards_spread:
            per_domain = hosts.astype(np.float64) @ self.domain_onehot  # [N, D]
            covered = (per_domain > 0).sum(axis=1)
            keeps = (covered[entry] > self.spread) | (per_domain[entry, self.domains[server]] > 1)
            entry, server = entry[keeps], server[keeps]
        b, e = pair_b[entry], pair_e[entry]
        order = np.argsort(share[b, e], kind="stable")  # lightest first; ties: the lowest expert
        first = order[_first_seen(b[order] * num_servers + server[order], len(rows) * num_servers)]
        b, e, server = b[first], e[first], server[first]
        lightest[b, server], dropped[b, server], has[b, server] = e, share[b, e], True
        return lightest, dropped, has

    def _grant(self, proposals: tuple[np.ndarray, ...], allowance: int) -> tuple[np.ndarray, ...]:
        """Grant proposals, largest gain first, while the servers they load have allowance left
        (and a free slot, for relocations and replications) and the move budget lasts; in a layer,
        moves of one round touch distinct servers and experts. When the proposals would load more
        than the budget has left, they are ranked by gain per load instead (a swap's unweighted
        gain over its two loads; a move that loads nothing counts as one load), so the budget buys
        the most gain. Decided in array operations, conservatively: a proposal that is turned
        down still counts against the ones after it. Returns the granted moves."""
        gain, kind, layer, expert, partner, hot, receiver = proposals
        swap = kind == _SWAP
        loads = (~self.original[layer, expert, receiver]).astype(np.int64)
        loads += swap & ~self.original[layer, np.maximum(partner, 0), hot]
        rank = gain
        left = None if self.max_moves is None else self.max_moves - self.moves
        if left is not None and int(loads.sum()) > left:
            rank = np.where(swap, gain / self.swap_weight, gain) / np.maximum(loads, 1)
        order = np.argsort(-rank, kind="stable")
        kind, layer, expert, partner = kind[order], layer[order], expert[order], partner[order]
        hot, receiver, loads, swap = hot[order], receiver[order], loads[order], swap[order]
        count = len(order)
        two_experts = swap | (kind == _REPLACE)
        # One move per (layer, server) and per (layer, expert) per round.
        servers = np.stack([layer * self.num_servers + receiver, layer * self.num_servers + hot], axis=1)
        ok = np.asarray(_first_seen(servers.reshape(-1), self.tokens.size).reshape(count, 2).all(axis=1))
        dummy = self.load.size + np.arange(count)  # a unique key for the partner of a non-swap
        pair_key = layer * self.num_experts
        experts = np.stack([pair_key + expert, np.where(two_experts, pair_key + partner, dummy)], axis=1)
        ok &= _first_seen(experts.reshape(-1), self.load.size + count).reshape(count, 2).all(axis=1)
        # Allowance: the i-th load a server gets this round needs i < allowance - new_loads.
        # Events in move order: (receiver, hot) per move, where each costs a load.
        loads_v = ok & ~self.original[layer, expert, receiver]
        loads_h = ok & swap & ~self.original[layer, np.maximum(partner, 0), hot]
        event_loads = np.stack([loads_v, loads_h], axis=1).reshape(-1)
        event_server = np.stack([receiver, hot], axis=1).reshape(-1)[event_loads]
        event_move = np.repeat(np.arange(count), 2)[event_loads]
        over = _rank_within(event_server, self.num_servers) >= self._room(allowance)[event_server]
        ok[event_move[over]] = False
        # Slots for relocations and replications (a relocation's freed slot is not reused here; a
        # replacement frees the slot it takes).
        takes_slot = np.flatnonzero(ok & ~two_experts)
        slot_server = receiver[takes_slot]
        full = _rank_within(slot_server, self.num_servers) >= (self.capacity - self.used)[slot_server]
        ok[takes_slot[full]] = False
        if left is not None and int(loads[ok].sum()) > left:  # the budget, in this order
            for move in np.flatnonzero(ok):
                if loads[move] > left:
                    ok[move] = False  # a later, smaller move may still fit
                else:
                    left -= int(loads[move])
        return kind[ok], layer[ok], expert[ok], partner[ok], hot[ok], receiver[ok]

    def _apply(self, moves: tuple[np.ndarray, ...], journal: bool = True) -> None:
        """Apply moves (in a layer they touch distinct servers and experts). Kinds: relocate e
        from h to v, replicate e onto v, swap e (on h) with f (on v), drop the replica of e on v,
        replace f on v by a new replica of e. Journaled unless taken back by `_undo`."""
        if journal:
            self._journal.append(moves)
        kind, layer, expert, partner, hot, receiver = moves
        relocate, replicate, swap = kind == _RELOCATE, kind == _REPLICATE, kind == _SWAP
        drop, replace = kind == _DROP, kind == _REPLACE
        if self.overlap is not None:
            pairs = layer * self.num_experts
            keys = np.unique(np.concatenate([pairs + expert, (pairs + partner)[swap | replace]]))
            pair_l, pair_e = np.divmod(keys, self.num_experts)
            self._add_overlap(pair_l, pair_e, -1.0)
        # Replica counts change: every host of such a pair gives up (takes over) part of its share.
        up = replicate | replace
        l = np.concatenate([layer[up], layer[drop], layer[replace]])
        e = np.concatenate([expert[up], expert[drop], partner[replace]])
        delta = np.repeat(np.array([1, -1]), [int(up.sum()), int(drop.sum() + replace.sum())])
        old = self.share[l, e]
        self.count[l, e] += delta
        new = self._per_replica(l, self.load[l, e], self.count[l, e])
        self.share[l, e] = new
        self._add_rows(l, (new - old)[:, None] * self.experts_servers[l, e])
        # Tokens each server gains (on the receiving side) or loses (on the busy side).
        moved = np.where(relocate | up, self.share[layer, expert], 0.0)
        swapped = self.share[layer, expert] - self.share[layer, np.maximum(partner, 0)]
        moved = np.where(swap, swapped, moved)
        self.tokens[layer, receiver] += moved
        self.tokens[layer, hot] -= np.where(relocate | swap, moved, 0.0)
        # A dropped replica's server had its old share (and got the share change above).
        gone_l = np.concatenate([layer[drop], layer[replace]])
        gone_e = np.concatenate([expert[drop], partner[replace]])
        gone_s = np.concatenate([receiver[drop], receiver[replace]])
        np.subtract.at(self.tokens, (gone_l, gone_s), self.share[gone_l, gone_e])
        moving = relocate | swap
        drop_l = np.concatenate([layer[moving], layer[swap], gone_l])
        drop_e = np.concatenate([expert[moving], partner[swap], gone_e])
        drop_s = np.concatenate([hot[moving], receiver[swap], gone_s])
        grows = ~drop
        add_l = np.concatenate([layer[grows], layer[swap]])
        add_e = np.concatenate([expert[grows], partner[swap]])
        add_s = np.concatenate([receiver[grows], hot[swap]])
        self._set(drop_l, drop_e, drop_s, False)
        self._set(add_l, add_e, add_s, True)
        if self.overlap is not None:
            self._add_overlap(pair_l, pair_e, 1.0)

    def _add_overlap(self, layer: np.ndarray, expert: np.ndarray, sign: float) -> None:
        """Add (``sign`` 1) or take out (-1) what pairs ``(layer, expert)`` (distinct) contribute to
        ``overlap``: the tokens each of their hosts takes over from each other one."""
        assert self.overlap is not None
        row, server = np.nonzero(self.experts_servers[layer, expert])  # [N, S] -> hosts, by pair
        weight = failover_shares(self.share[layer, expert], self.count[layer, expert])  # [N]
        cells, entry = overlap_cells(row, layer[row], server, self.num_servers)
        np.add.at(self.overlap.reshape(-1), cells, sign * weight[row[entry]])

    def _undo(self, moves: tuple[np.ndarray, ...]) -> None:
        """Take back moves applied by `_apply` (the last ones not taken back): a relocation or swap
        is the same move with its two servers exchanged; a replication is undone by a drop and the
        other way round; a replacement by the replacement the other way round."""
        if not self._journal or self._journal[-1] is not moves:
            raise AssertionError("moves are taken back in the reverse order of their application")
        self._journal.pop()
        kind, layer, expert, partner, hot, receiver = moves
        inverse = np.select([kind == _REPLICATE, kind == _DROP], [_DROP, _REPLICATE], kind)
        exchange = (kind == _RELOCATE) | (kind == _SWAP)
        replace = kind == _REPLACE
        self._apply(
            (
                inverse,
                layer,
                np.where(replace, partner, expert),
                np.where(replace, expert, partner),
                np.where(exchange, receiver, hot),
                np.where(exchange, hot, receiver),
            ),
            journal=False,
        )

    def _drops(self, allowance: int, pairs: int) -> tuple[np.ndarray, ...] | None:
        """Free slots where moves want them: on full servers with allowance left that are among
        the ``2 x pairs`` coldest of some layer, drop surplus replicas (their experts keep R
        replicas and their domain spread) whose share, spread over the other hosts, keeps them all
        below their layer's peak by the layer's minimum gain — so no peak rises. In a layer, drops
        touch distinct servers (their experts' hosts); a server gets at most as many as it may
        load this round; the replica leaving the most room below the peak first. Returns the drops
        as moves (kind ``_DROP``, server in ``receiver``), or None."""
        full = (self.used >= self.capacity) & self.is_open(allowance)
        if not full.any():
            return None
        tokens = self.tokens
        order = np.argsort(tokens, axis=1)[:, : 2 * pairs]  # [L, 2P] coldest servers per layer
        wanted = np.zeros(self.num_servers, dtype=bool)
        wanted[order.ravel()] = True
        servers = np.flatnonzero(full & wanted)
        if len(servers) == 0:
            return None
        cells = self.table[:, servers, :]  # [L, F, W]
        layer, column, slot = np.nonzero(cells >= 0)
        expert = cells[layer, column, slot]
        server = servers[column]
        count = self.count[layer, expert]
        surplus = count > self.replication
        layer, expert, server, count = layer[surplus], expert[surplus], server[surplus], count[surplus]
        if len(layer) == 0:
            return None
        hosts = self.experts_servers[layer, expert]  # [N, S]
        others = hosts.copy()
        others[np.arange(len(layer)), server] = False
        others_max = np.where(others, tokens[layer], -np.inf).max(axis=1)
        demand = self.load[layer, expert]
        rise = self._per_replica(layer, demand, count - 1) - self._per_replica(layer, demand, count)
        room = tokens.max(axis=1)[layer] - self.min_gain[layer] - (others_max + rise)
        ok = room >= 0
        if self.guards_spread:
            ok &= ((others.astype(np.float64) @ self.domain_onehot) > 0).sum(axis=1) >= self.spread
        index = np.flatnonzero(ok)
        if len(index) == 0:
            return None
        index = index[np.argsort(-room[index], kind="stable")]
        layer, expert, server, touched = layer[index], expert[index], server[index], hosts[index]
        # In a layer, keep a drop only if no drop before it touches one of its expert's hosts (so
        # each room check above still holds); per server, as many as it may load this round.
        keep = ~_overlaps_earlier(layer, touched)
        layer, expert, server = layer[keep], expert[keep], server[keep]
        keep = _rank_within(server, self.num_servers) < self._room(allowance)[server]
        layer, expert, server = layer[keep], expert[keep], server[keep]
        kind = np.full(len(layer), _DROP)
        return kind, layer, expert, np.full(len(layer), -1), server, server

    def _set(self, l: np.ndarray, e: np.ndarray, s: np.ndarray, value: bool) -> None:
        """Host (or drop) pairs ``(l, e)`` on servers ``s``, updating slots and new loads."""
        self.servers_experts[l, s, e] = value
        self.experts_servers[l, e, s] = value
        # The table keeps each cell's experts as a prefix: add at the end, remove by moving the
        # last one into the hole.
        filled = self.filled[l, s]
        if value:
            if int(filled.max(initial=0)) >= self.table.shape[2]:
                spare = np.full((*self.table.shape[:2], _SPARE_COLUMNS), -1, dtype=self.table.dtype)
                self.table = np.concatenate([self.table, spare], axis=2)
            self.table[l, s, filled] = e
            self.filled[l, s] = filled + 1
        else:
            hole = (self.table[l, s] == e[:, None]).argmax(axis=1)
            last = filled - 1
            self.table[l, s, hole] = self.table[l, s, last]
            self.table[l, s, last] = -1
            self.filled[l, s] = last
        sign = 1 if value else -1
        size = self.num_servers
        self.used += sign * np.bincount(s, minlength=size)
        self.new_loads += sign * np.bincount(s[~self.original[l, e, s]], minlength=size)

    def _add_rows(self, layers: np.ndarray, rows: np.ndarray) -> None:
        """``tokens[layers[i]] += rows[i]`` (layers may repeat)."""
        if len(layers):
            cells = (layers[:, None] * self.num_servers + np.arange(self.num_servers)).ravel()
            self.tokens += np.bincount(cells, weights=rows.ravel(), minlength=self.tokens.size).reshape(
                self.tokens.shape
            )

    # -- driver ------------------------------------------------------------------------------------

    def optimize(
        self,
        step: int = 8,
        *,
        min_step: int = 1,
        pairs_per_step: float = PAIRS_PER_STEP,
        patience: int = 2,
        patience_below: int = 3,
        tolerance: float = 2e-3,
        stop_step: int = 2,
    ) -> float:
        """Run rounds, keep the best state; returns its objective.

        Round allowance: the busiest loader's new loads plus ``step``; every layer proposes moves
        off its ``pairs_per_step x step`` (at least ``MIN_PAIRS``) busiest servers. A round that
        does not improve the objective is kept on trial: at steps below ``patience_below`` (where
        a layer with near-ties at the top may need two rounds before its peak falls) up to
        ``patience`` rounds in a row, else one. A trial that ends without a better objective is
        taken back and the step halves (or, at ``min_step``, the search stops). The step also
        halves when a round's compute gain is less than ``HALVE_BELOW`` times the movement the
        step allows, or when a round improves the objective by less than ``tolerance`` (relative),
        where at ``stop_step`` or below (by then the rounds gain about a tenth of a percent each)
        the search stops. It also stops when no layer can move or the move budget is spent, and
        ends in the best state."""
        best = self.objective()
        trial: list[list[tuple[np.ndarray, ...]]] = []  # rounds applied since the best state
        pairs_cap = max(1, self.num_servers // 2)

        def take_back() -> None:
            for applied in reversed(trial):
                for moves in reversed(applied):
                    self._undo(moves)
            trial.clear()

        while self.max_moves is None or self.moves < self.max_moves:
            allowance = self.loads_charged() + step
            if not trial:
                best = self._failover_round(allowance, best)
            before = self.compute()
            pairs = min(pairs_cap, max(MIN_PAIRS, int(pairs_per_step * step)))
            applied = []
            drops = self._drops(allowance, pairs)
            if drops is not None:
                self._apply(drops)
                applied.append(drops)
            proposals = self._balance_proposals(allowance, pairs)
            granted = None if proposals is None else self._grant(proposals, allowance)
            if granted is None or len(granted[0]) == 0:
                for moves in reversed(applied):
                    self._undo(moves)
                if step <= min_step or (proposals is None and not trial):
                    break
                take_back()
                step //= 2
                continue
            self._apply(granted)
            applied.append(granted)
            value = self.objective()
            if value >= best - 1e-12 and drops is not None:
                # A drop may lower a layer's peak for free (the server is cold in another layer);
                # keep the drops alone when they improve and the round's moves do not.
                self._undo(granted)
                alone = self.objective()
                if alone < best - 1e-12:
                    applied, value = [drops], alone
                else:
                    self._apply(granted)
            if value < best - 1e-12:
                small = value > (1 - tolerance) * best
                best = value
                trial.clear()
                if small and step <= max(min_step, stop_step):
                    break
                if step > min_step and (
                    small or before - self.compute() < HALVE_BELOW * step * self.move_cost
                ):
                    step //= 2
                continue
            trial.append(applied)
            if len(trial) < (patience if step < patience_below else 1):
                continue
            take_back()
            if step <= min_step:
                break
            step //= 2
        take_back()
        return best

    def settle(self) -> float:
        """`optimize`, and on small instances (at most ``SMALL_CELLS`` server x layer x expert
        cells, where a round costs well under a millisecond) `escape` from its local optimum."""
        if self.num_servers * self.load.size > SMALL_CELLS:
            return self.optimize()
        self.optimize(step=1, stop_step=1)
        return self.escape(ESCAPE_TRIES, step=1, stop_step=1)

    def escape(self, tries: int, seed: int = 0, **optimize_args: object) -> float:
        """Iterated local search from the current (optimized) state: ``tries`` times, *kick* it —
        relocate a random expert of a random unbalanced layer's busiest server to a random server
        with a free slot, or swap it with a random expert of a random server — and `optimize`
        again, keeping the result when the objective falls and rewinding otherwise. A kick is the
        neutral first step a local optimum needs (make room on a server, then move a hot expert
        there) that no improving move takes. Returns the best objective."""
        rng = np.random.default_rng(seed)
        best = self.objective()
        for _ in range(tries):
            mark = len(self._journal)
            if self.max_moves is not None and self.moves + 2 > self.max_moves:
                break  # a kick loads up to two experts
            if not (self.tokens.max(axis=1) - self.mean > self.min_gain).any():
                break  # nothing left to balance
            kick = self._kick(rng)
            if kick is None:  # this draw found no kick (another may)
                continue
            self._apply(kick)
            value = self.optimize(**optimize_args)  # type: ignore[arg-type]
            if value < best - 1e-12:
                best = value
            else:
                while len(self._journal) > mark:
                    self._undo(self._journal[-1])
        return best

    def _kick(self, rng: np.random.Generator) -> tuple[np.ndarray, ...] | None:
        """One random move off the busiest server of a random unbalanced layer (see `escape`)."""
        peak = self.tokens.max(axis=1)
        layers = np.flatnonzero(peak - self.mean > self.min_gain)
        if len(layers) == 0:
            return None
        l = int(rng.choice(layers))
        hot = int(self.tokens[l].argmax())
        experts = self.table[l, hot, : self.filled[l, hot]]
        if len(experts) == 0:
            return None
        e = int(rng.choice(experts))
        others = [
            v for v in range(self.num_servers)
            if v != hot and self.allowed[v] and not self.experts_servers[l, e, v]
        ]  # fmt: skip
        if not others:
            return None
        v = int(rng.choice(others))
        if self.used[v] < self.capacity[v] and self._spread_ok(l, e, hot, v):
            return _move(_RELOCATE, l, e, -1, hot, v)
        partners = [
            int(f) for f in self.table[l, v, : self.filled[l, v]]
            if not self.experts_servers[l, f, hot] and self._spread_ok(l, int(f), v, hot)
        ]  # fmt: skip
        if not partners or not self.allowed[hot] or not self._spread_ok(l, e, hot, v):
            return None
        return _move(_SWAP, l, e, int(rng.choice(partners)), hot, v)

    def _spread_ok(self, l: int, e: int, leaving: int, arriving: int) -> bool:
        """Whether (l, e) keeps its failure-domain spread when it moves from one server to another."""
        if not self.guards_spread:
            return True
        hosts = self.experts_servers[l, e].copy()
        hosts[leaving], hosts[arriving] = False, True
        return len(set(self.domains[hosts].tolist())) >= self.spread

    # -- restoring R -----------------------------------------------------------------------------

    def under_spread(self) -> list[tuple[int, int]]:
        """Pairs whose replicas cover fewer failure domains than the spread needs."""
        if self.spread <= 1:
            return []
        l, e, s = np.nonzero(self.experts_servers)
        domains = self.domain_onehot.shape[1]
        per_domain = np.bincount(
            (l * self.num_experts + e) * domains + self.domains[s], minlength=self.load.size * domains
        ).reshape(self.num_layers, self.num_experts, domains)
        short = np.argwhere((per_domain > 0).sum(axis=2) < self.spread)
        return [(int(a), int(b)) for a, b in short]

    def ensure_replicas(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Add replicas until each (l, e) in ``pairs`` has R of them over enough domains, on the
        servers that may load with the fewest charged new loads (then the least tokens in the
        layer), into a free slot or in place of the surplus replica whose loss raises its layer's
        peak least. Raises PlacementError if no server can take one."""
        for l, e in pairs:
            while True:
                hosts = self.experts_servers[l, e]
                covered = set(self.domains[hosts].tolist())
                want_domain = self.spread > 1 and len(covered) < self.spread
                if hosts.sum() >= self.replication and not want_domain:
                    break
                candidates = self.allowed & ~hosts
                if want_domain:
                    candidates &= ~np.isin(self.domains, list(covered))
                key = (
                    np.where(self.charged, self.new_loads, 0) * (self.tokens[l].max() + 1.0) + self.tokens[l]
                )
                placed = False
                for v in np.flatnonzero(candidates)[np.argsort(key[candidates], kind="stable")]:
                    slot = self._slot(int(v))
                    if slot is None:
                        continue
                    if slot != _FREE_SLOT:
                        self._apply(_move(_DROP, slot[0], slot[1], -1, int(v), int(v)))
                    self._apply(_move(_REPLICATE, l, e, -1, int(v), int(v)))
                    placed = True
                    break
                if not placed and not self._shift_and_add(l, e, covered if want_domain else set()):
                    raise PlacementError(
                        f"no server can take a replica of (layer row {l}, expert {e}): every server that "
                        "does not host it (in a new failure domain where one is needed) is full"
                    )

    def _slot(self, v: int) -> tuple[int, int] | None:
        """A slot on server ``v``: `_FREE_SLOT`, or the surplus replica (its pair keeps R and its
        spread without it) whose loss raises its layer's peak least; None if there is none."""
        if self.used[v] < self.capacity[v]:
            return _FREE_SLOT
        l, e = np.nonzero(self.servers_experts[:, v, :] & (self.count > self.replication))
        if len(l) == 0:
            return None
        others = self.experts_servers[l, e].copy()  # [N, S]
        others[:, v] = False
        if self.spread > 1:
            covered = (others.astype(np.float64) @ self.domain_onehot > 0).sum(axis=1)
            keep = covered >= self.spread
            l, e, others = l[keep], e[keep], others[keep]
            if len(l) == 0:
                return None
        count = self.count[l, e]
        rise = self._per_replica(l, self.load[l, e], count - 1) - self.share[l, e]
        highest = np.where(others, self.tokens[l], -np.inf).max(axis=1) + rise
        harm = np.maximum(0.0, highest - self.tokens.max(axis=1)[l])
        best = int(np.argmin(harm))
        return int(l[best]), int(e[best])

    def _shift_and_add(self, l: int, e: int, avoid_domains: set[int]) -> bool:
        """Make room for (l, e): move some pair f from a full server v that lacks e to a server u
        with a free slot that lacks f (keeping f's spread), then put e on v."""
        free = np.flatnonzero(self.allowed & (self.used < self.capacity))
        for v in range(self.num_servers):
            if not self.allowed[v] or self.experts_servers[l, e, v] or int(self.domains[v]) in avoid_domains:
                continue
            for l2, f in zip(*np.nonzero(self.servers_experts[:, v, :]), strict=True):
                if (l2, f) == (l, e):
                    continue
                for u in free.tolist():
                    if u == v or self.experts_servers[l2, f, u] or not self._spread_ok(int(l2), int(f), v, u):
                        continue
                    self._apply(_move(_RELOCATE, int(l2), int(f), -1, v, u))
                    self._apply(_move(_REPLICATE, l, e, -1, v, v))
                    return True
        return False

    def matrix(self) -> np.ndarray:
        """bool ``[S, L, E]`` of the current state."""
        return np.ascontiguousarray(self.servers_experts.transpose(1, 0, 2))


def _move(kind: int, l: int, e: int, f: int, h: int, v: int) -> tuple[np.ndarray, ...]:
    """One move as the arrays `Search._apply` takes."""
    return tuple(np.array([value]) for value in (kind, l, e, f, h, v))


def _first_seen(keys: np.ndarray, size: int) -> np.ndarray:
    """bool ``[N]``: ``keys[i]`` (in ``0..size-1``) does not occur in ``keys[:i]``."""
    index = np.arange(len(keys))
    first = np.full(size, len(keys))
    np.minimum.at(first, keys, index)
    return np.asarray(first[keys] == index)


def _overlaps_earlier(groups: np.ndarray, members: np.ndarray) -> np.ndarray:
    """bool ``[N]``: row ``i`` of ``members [N, S]`` (bool) shares a member with an earlier row of
    the same group (``groups [N]``)."""
    order = np.argsort(groups, kind="stable")
    counts = np.cumsum(members[order], axis=0, dtype=np.int32)  # inclusive, over all groups
    ordered = groups[order]
    start = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    before_group = np.concatenate([np.zeros((1, members.shape[1]), np.int32), counts[start[1:] - 1]])
    group_of_row = np.repeat(np.arange(len(start)), np.diff(np.append(start, len(order))))
    earlier = counts - members[order] - before_group[group_of_row]  # exclusive, within the group
    overlaps = np.empty(len(groups), dtype=bool)
    overlaps[order] = ((earlier > 0) & members[order]).any(axis=1)
    return overlaps


def _rank_within(groups: np.ndarray, size: int) -> np.ndarray:
    """For events in ``groups [N]`` (in order, values in ``0..size-1``): how many events of the
    same group come before each one."""
    order = np.argsort(groups.astype(np.min_scalar_type(size)), kind="stable")  # a radix sort
    counts = np.bincount(groups, minlength=size)
    starts = np.cumsum(counts) - counts
    rank = np.empty(len(groups), dtype=np.int64)
    rank[order] = np.arange(len(groups)) - starts[groups[order]]
    return rank


def _first(order: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    """Per row of ``order [A, N]`` (server ids), the first ``k`` servers with ``mask[server]``:
    ``[A, k]``, -1 where a row has fewer."""
    ok = mask[order]
    rank = np.cumsum(ok, axis=1) - 1  # [A, N] rank of each allowed server in its row
    result = np.full((order.shape[0], k + 1), -1, dtype=np.int64)
    rows, columns = np.nonzero(ok & (rank < k))
    result[rows, rank[rows, columns]] = order[rows, columns]
    return result[:, :k]


def search_for(
    current: Placement,
    load: np.ndarray,
    cost: CostModel,
    horizon_steps: int,
    *,
    servers: Sequence[Server] | None = None,
    matrix: np.ndarray | None = None,
    replication: int | None = None,
    **options: Any,
) -> Search:
    """A `Search` for ``current``'s layers and experts: over ``servers`` (default its own; ordinal
    order, the columns of ``matrix``, default its hosting matrix) with their capacities, failure
    domains and the spread ``replication`` (default ``current.replication``) needs. ``options``
    go to `Search` (``load_allowed``, ``charged``, ``tokens``, ``max_moves``, ...)."""
    servers = list(current.servers if servers is None else servers)
    hosting = current.hosting_matrix() if matrix is None else matrix
    if matrix is None and servers == list(current.servers):
        options.setdefault("entries", current.hosted_entries())
    replicas = replication or current.replication
    domains, _ = domain_ids(servers)
    spread = required_spread(servers, len(current.layers) * current.num_experts, replicas)
    capacities = [s.capacity for s in servers]
    return Search(hosting, load, capacities, domains, replicas, spread, cost, horizon_steps, **options)
