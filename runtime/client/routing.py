"""The routing table: which server computes each (token, expert) entry. Pure logic over tensors.

Built from a ``Placement`` (server ordinal → hosted (layer, expert) pairs, replicas allowed).
Replica choice is deterministic and spreads load two ways:

- an expert with few tokens in the batch goes whole to one live replica, number
  ``(layer + e + turn) mod live_replicas`` of its replica list, where ``turn`` counts the layer's
  batches: experts spread over servers, each expert's weights are read by one server per batch
  (decode is bound by reading weights; splitting a small group would read them twice), and over
  successive batches an expert's load is shared evenly by its replicas — what the placement
  planner assumes when it weighs a server's load (without the turn, each cold expert's whole load
  would stay on one replica, and a rebalance could move load where the planner did not expect it);
- an expert with more than ``spread_threshold`` tokens (a hot expert, or a prefill) is split:
  its t-th token goes to replica ``(t + e) mod live_replicas``, so its replicas share the compute.

An expert's replica list is ordered so that, in every batch, each server gets about as many of a
layer's whole experts as another with the same number of them (``_balanced_order``): ordered by
ordinal, the lowest ordinal would be replica 0 of all its experts and get, in one batch, every one
whose ``e`` has one parity (with R = 2) — all of them or none, depending on the placement.

Legend: T = tokens, K = top-k, E = experts, S = servers, R = max replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaas.runtime.client.errors import ExpertUnavailable
from eaas.runtime.placement import Placement


@dataclass(frozen=True)
class Share:
    """One server's part of a layer's work."""

    server: int  # server index (position in ``RoutingTable.ordinals``)
    rows: torch.Tensor  # [T_s] int64: tokens sent to this server (each at most once)
    expert_ids: torch.Tensor  # [T_s, K] int64: experts this server applies, -1 = elsewhere


class RoutingTable:
    def __init__(self, placement: Placement, spread_threshold: int = 32) -> None:
        self.spread_threshold = spread_threshold
        self.ordinals: tuple[int, ...] = placement.ordinals
        self.num_experts = placement.num_experts
        table = placement.routing_table()  # layer -> per expert, ordinals hosting it
        index = {ordinal: i for i, ordinal in enumerate(self.ordinals)}
        width = max(len(hosts) for per_expert in table.values() for hosts in per_expert)
        self._replicas: dict[int, torch.Tensor] = {}  # layer -> [E, R] server index, -1 = none
        self._device_replicas: dict[tuple[int, str], torch.Tensor] = {}
        self._turns: dict[int, int] = {}  # layer -> batches routed (rotates cold experts' replicas)
        for layer, per_expert in table.items():
            replicas = torch.full((self.num_experts, width), -1, dtype=torch.int64)
            for expert, hosts in enumerate(_balanced_order(per_expert)):
                replicas[expert, : len(hosts)] = torch.tensor([index[o] for o in hosts], dtype=torch.int64)
            self._replicas[layer] = replicas

    @property
    def layers(self) -> list[int]:
        return sorted(self._replicas)

    def replicas(self, layer: int, expert: int) -> list[int]:
        """Ordinals hosting (layer, expert)."""
        return [self.ordinals[i] for i in self._replicas[layer][expert].tolist() if i >= 0]

    def unserved(self, live: torch.Tensor) -> list[tuple[int, int]]:
        """(layer, expert) pairs with no live replica, given live [S] bool."""
        missing = []
        for layer, replicas in sorted(self._replicas.items()):
            alive = (replicas >= 0) & live[replicas.clamp(min=0)]  # [E, R]
            missing += [(layer, int(e)) for e in (~alive.any(-1)).nonzero().squeeze(1).tolist()]
        return missing

    def assign(
        self,
        layer: int,
        expert_ids: torch.Tensor,  # [T, K] int, -1 = nothing to do for this entry
        live: torch.Tensor,  # [S] bool, on expert_ids' device
        check: bool = True,
    ) -> torch.Tensor:  # [T, K] int64 server index, -1 where expert_ids is -1
        """Picks a live replica for every entry; ``ExpertUnavailable`` if an expert has none.

        Runs where ``expert_ids`` is. With ``check=False`` it never synchronises with the host
        (capturable in a CUDA graph): an entry without a live replica then gets -1.
        """
        ids = expert_ids.to(torch.int64)
        active = ids >= 0
        replicas = self._replicas_on(layer, ids.device)[ids.clamp(min=0)]  # [T, K, R]
        alive = (replicas >= 0) & live[replicas.clamp(min=0)]
        counts = alive.sum(-1)  # [T, K]
        missing = active & (counts == 0)
        if check and bool(missing.any()):
            expert = int(ids[missing][0])
            raise ExpertUnavailable(layer, expert, self.replicas(layer, expert))
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)  # [E]
        tokens_per_expert.scatter_add_(0, ids.clamp(min=0).reshape(-1), active.reshape(-1).to(torch.int64))
        hot = tokens_per_expert[ids.clamp(min=0)] > self.spread_threshold  # [T, K]
        tokens = torch.arange(ids.shape[0], device=ids.device)[:, None]  # [T, 1]
        turn = self._turns.get(layer, 0)
        self._turns[layer] = turn + 1
        salt = torch.where(hot, tokens, layer + turn)  # split hot experts by token, rotate others whole
        pick = (salt + ids) % counts.clamp(min=1)  # [T, K]: which live replica
        rank = alive.cumsum(-1) - 1  # [T, K, R]: rank of each live replica
        chosen = (alive & (rank == pick[..., None])).to(torch.int8).argmax(-1)  # [T, K]
        servers = replicas.gather(-1, chosen[..., None]).squeeze(-1)
        return torch.where(active & ~missing, servers, -1)

    def _replicas_on(self, layer: int, device: torch.device) -> torch.Tensor:
        """The [E, R] replica table of ``layer`` on ``device`` (copied there once)."""
        if device.type == "cpu":
            return self._replicas[layer]
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        key = (layer, str(device))
        table = self._device_replicas.get(key)
        if table is None:
            table = self._device_replicas[key] = self._replicas[layer].to(device)
        return table

    def prepare(self, device: torch.device) -> None:
        """Copies every layer's replica table to ``device`` now (a CUDA-graph capture cannot)."""
        for layer in self._replicas:
            self._replicas_on(layer, device)

    def servers_of_layer(self, layer: int) -> list[int]:
        """Server indices hosting at least one expert of ``layer``."""
        table = self._replicas[layer]
        return sorted(int(s) for s in torch.unique(table[table >= 0]).tolist())

    @staticmethod
    def split(assignment: torch.Tensor, expert_ids: torch.Tensor) -> list[Share]:
        """Per server: the tokens it gets (once each) and, per token, the experts it applies."""
        shares = []
        for server in torch.unique(assignment[assignment >= 0]).tolist():
            mine = assignment == server  # [T, K]
            rows = mine.any(dim=1).nonzero().squeeze(1)  # [T_s]
            ids = torch.where(mine[rows], expert_ids[rows].to(torch.int64), -1)  # [T_s, K]
            shares.append(Share(int(server), rows, ids))
        return shares


def _balanced_order(hosts_of: list[list[int]]) -> list[list[int]]:
    """Each expert's hosts (one layer), in the order the whole-expert rotation uses them.

    In a batch the rotation sends expert ``e`` (n replicas) to position ``(layer + turn + e) mod n``
    of its list, so the host at position ``j`` gets it in the batches where ``layer + turn`` is
    ``(j - e) mod n`` — its *phase*. Filling positions greedily with the host that has the fewest
    experts at that phase spreads each server's experts evenly over the phases, so its share of a
    batch stays near its share of the layer. Deterministic: every client orders alike.
    """
    count: dict[tuple[int, int, int], int] = {}  # (ordinal, replicas, phase) -> experts so far
    ordered = []
    for expert, hosts in enumerate(hosts_of):
        n, left, order = len(hosts), sorted(hosts), []
        for position in range(n):
            phase = (position - expert) % n
            host = min(left, key=lambda o: (count.get((o, n, phase), 0), o))
            count[(host, n, phase)] = count.get((host, n, phase), 0) + 1
            left.remove(host)
            order.append(host)
        ordered.append(order)
    return ordered
