"""`Placement`: which expert server hosts which (layer, expert) pairs — THE one definition.

Everything that needs "servers → hosted (layer, expert)" imports this type: the local launcher,
the attention client's routing table, the expert server (``experts_of(its ordinal)``), the planners
and the operator's placement ConfigMap (``to_json()``).

Legend for array shapes: S = servers (in ``placement.servers`` order, sorted by ordinal),
L = MoE layers (in ``placement.layers`` order), E = experts per layer.

Invariants checked on construction (a violation raises `PlacementError` naming the problem):

- every server hosts at most ``capacity`` pairs, each pair at most once;
- every (layer, expert) is hosted at least ``replication`` times (on distinct servers, since a
  server hosts a pair at most once);
- where servers have failure domains (e.g. a node), the replicas of every (layer, expert) cover at
  least ``min(replication, number of domains)`` distinct domains, or as many as the domains' slots
  allow (`required_spread`). A server without a domain is its own domain.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
"""Version of the JSON form written by `Placement.to_dict`; `from_dict` reads only this one."""

LayerExpert = tuple[int, int]
"""A (MoE layer id, expert id) pair."""


class PlacementError(ValueError):
    """A placement, its JSON form or a planner input is invalid; the message says what and why."""


@dataclass(frozen=True)
class Server:
    """One expert server.

    ordinal: stable integer id (the StatefulSet ordinal on Kubernetes), >= 0.
    capacity: how many (layer, expert) weight slots it holds, over all layers. Servers need not be
        equal.
    name: optional human name (e.g. the Pod name).
    domain: optional failure domain (e.g. the node); replicas are spread over domains.
    """

    ordinal: int
    capacity: int
    name: str | None = None
    domain: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.ordinal) or self.ordinal < 0:
            raise PlacementError(f"server ordinal must be an int >= 0, got {self.ordinal!r}")
        if not _is_int(self.capacity) or self.capacity < 0:
            raise PlacementError(
                f"server {self.ordinal}: capacity must be an int >= 0 (expert slots), got {self.capacity!r}"
            )
        for field in ("name", "domain"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise PlacementError(
                    f"server {self.ordinal}: {field} must be a non-empty string or None, got {value!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"ordinal": self.ordinal, "name": self.name, "domain": self.domain, "capacity": self.capacity}


class Placement:
    """Servers → hosted (layer, expert) pairs, with capacities, replication factor and a version.

    Immutable. Build one with the constructor (from a mapping ordinal → pairs), with
    `Placement.from_matrix` (planners), with `round_robin` (launcher, tests) or with
    `Placement.from_json` (the operator's ConfigMap).

    Args:
        layers: the MoE layer ids of the model, e.g. ``range(3, 61)`` for DeepSeek-V3 (layers 0-2
            are dense). Unique ints >= 0; order is kept and defines the row order of load arrays.
        num_experts: routed experts per MoE layer (E).
        servers: the expert servers; stored sorted by ordinal.
        hosted: ordinal → the (layer id, expert id) pairs that server hosts. Servers missing from
            the mapping host nothing.
        replication: R, the minimum number of replicas of every (layer, expert).
        version: monotonically increasing version (>= 0); planners return ``version + 1``.
    """

    __slots__ = (
        "_entries",
        "_hosted",
        "_layer_index",
        "_layers",
        "_matrix",
        "_num_experts",
        "_ordinal_index",
        "_replication",
        "_servers",
        "_shares",
        "_version",
    )

    def __init__(
        self,
        layers: Iterable[int],
        num_experts: int,
        servers: Iterable[Server],
        hosted: Mapping[int, Iterable[LayerExpert]],
        replication: int = 1,
        version: int = 0,
    ) -> None:
        self._init_header(layers, num_experts, servers, replication, version)
        if not isinstance(hosted, Mapping):
            raise PlacementError(
                f"hosted must be a mapping ordinal -> [(layer, expert), ...], got {type(hosted)}"
            )
        matrix = np.zeros((len(self._servers), len(self._layers), self._num_experts), dtype=bool)
        for ordinal, pairs in hosted.items():
            if ordinal not in self._ordinal_index:
                raise PlacementError(
                    f"hosted names server {ordinal!r}, which is not among the servers {list(self.ordinals)}"
                )
            column = self._ordinal_index[ordinal]
            for pair in pairs:
                layer, expert = _check_pair(pair, f"server {ordinal}")
                if layer not in self._layer_index:
                    raise PlacementError(
                        f"server {ordinal} hosts (layer {layer}, expert {expert}) but the MoE layers are "
                        f"{_short(self._layers)}"
                    )
                if not 0 <= expert < self._num_experts:
                    raise PlacementError(
                        f"server {ordinal} hosts (layer {layer}, expert {expert}); expert ids are "
                        f"0..{self._num_experts - 1}"
                    )
                row = self._layer_index[layer]
                if matrix[column, row, expert]:
                    raise PlacementError(
                        f"server {ordinal} lists (layer {layer}, expert {expert}) twice; a server hosts a "
                        "pair at most once (replicas live on distinct servers)"
                    )
                matrix[column, row, expert] = True
        self._finish(matrix)

    @classmethod
    def from_matrix(
        cls,
        layers: Iterable[int],
        num_experts: int,
        servers: Iterable[Server],
        matrix: np.ndarray,
        replication: int = 1,
        version: int = 0,
    ) -> Placement:
        """Build from a hosting matrix: bool ``[S, L, E]``, ``matrix[s, l, e]`` = server ``s`` (in
        ordinal order) hosts expert ``e`` of layer ``layers[l]``."""
        self = cls.__new__(cls)
        self._init_header(layers, num_experts, servers, replication, version)
        array = np.asarray(matrix)
        expected = (len(self._servers), len(self._layers), self._num_experts)
        if array.shape != expected:
            raise PlacementError(f"hosting matrix has shape {array.shape}; expected [S, L, E] = {expected}")
        if array.dtype != bool and not np.isin(array, (0, 1)).all():
            raise PlacementError("hosting matrix must hold only 0/1 (or bool) values")
        self._finish(array.astype(bool, copy=True))
        return self

    # -- construction helpers -------------------------------------------------------------------

    def _init_header(
        self,
        layers: Iterable[int],
        num_experts: int,
        servers: Iterable[Server],
        replication: int,
        version: int,
    ) -> None:
        layer_tuple = tuple(layers)
        if not layer_tuple:
            raise PlacementError("layers must list at least one MoE layer id")
        for layer in layer_tuple:
            if not _is_int(layer) or layer < 0:
                raise PlacementError(f"layer ids must be ints >= 0, got {layer!r}")
        if len(set(layer_tuple)) != len(layer_tuple):
            raise PlacementError(f"layer ids must be unique, got {_short(layer_tuple)}")
        if not _is_int(num_experts) or num_experts < 1:
            raise PlacementError(f"num_experts must be an int >= 1, got {num_experts!r}")
        if not _is_int(replication) or replication < 1:
            raise PlacementError(f"replication must be an int >= 1, got {replication!r}")
        if not _is_int(version) or version < 0:
            raise PlacementError(f"version must be an int >= 0, got {version!r}")
        server_list = list(servers)
        for server in server_list:
            if not isinstance(server, Server):
                raise PlacementError(f"servers must be Server objects, got {type(server).__name__}")
        if not server_list:
            raise PlacementError("a placement needs at least one server")
        server_list.sort(key=lambda server: server.ordinal)
        ordinals = [server.ordinal for server in server_list]
        if len(set(ordinals)) != len(ordinals):
            duplicates = sorted({o for o in ordinals if ordinals.count(o) > 1})
            raise PlacementError(f"server ordinals must be unique, duplicated: {duplicates}")
        names = [server.name for server in server_list if server.name is not None]
        if len(set(names)) != len(names):
            raise PlacementError(f"server names must be unique, got {names}")
        self._layers = tuple(int(layer) for layer in layer_tuple)
        self._num_experts = int(num_experts)
        self._servers = tuple(server_list)
        self._replication = int(replication)
        self._version = int(version)
        self._layer_index = {layer: row for row, layer in enumerate(self._layers)}
        self._ordinal_index = {server.ordinal: column for column, server in enumerate(self._servers)}
        self._hosted: tuple[tuple[LayerExpert, ...], ...] | None = None
        self._shares: np.ndarray | None = None
        self._entries: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _finish(self, matrix: np.ndarray) -> None:
        matrix.setflags(write=False)
        self._matrix = matrix
        self._validate()

    def _validate(self) -> None:
        num_servers = len(self._servers)
        replication = self._replication
        check_feasible(len(self._layers), self._num_experts, self._servers, replication)
        used = _count_true(self._matrix.reshape(num_servers, -1), axis=1)
        for column, server in enumerate(self._servers):
            if used[column] > server.capacity:
                raise PlacementError(
                    f"server {server.ordinal} hosts {int(used[column])} (layer, expert) pairs but its "
                    f"capacity is {server.capacity}"
                )
        counts = _count_true(self._matrix, axis=0)  # [L, E]
        short = np.argwhere(counts < replication)
        if len(short):
            row, expert = (int(v) for v in short[0])
            raise PlacementError(
                f"(layer {self._layers[row]}, expert {expert}) is hosted {int(counts[row, expert])} "
                f"time(s); replication={replication} needs at least {replication} replicas on distinct "
                f"servers ({len(short)} pair(s) short)"
            )
        domain_ids, num_domains = self.domain_ids()
        needed = self.required_spread
        if needed > 1 and num_domains < num_servers:
            one_hot = np.zeros((num_domains, num_servers), dtype=np.int32)
            one_hot[domain_ids, np.arange(num_servers)] = 1
            covered = (np.tensordot(one_hot, self._matrix.astype(np.int32), axes=1) > 0).sum(axis=0)
            bad = np.argwhere(covered < needed)
            if len(bad):
                row, expert = (int(v) for v in bad[0])
                hosts = self.servers_of(self._layers[row], expert)
                domains = sorted(
                    {self._servers[self._ordinal_index[o]].domain or f"<server {o}>" for o in hosts}
                )
                raise PlacementError(
                    f"(layer {self._layers[row]}, expert {expert}) has replicas in {len(domains)} failure "
                    f"domain(s) {domains}; replication={replication} needs them spread over {needed} "
                    f"domains ({num_domains} available; {len(bad)} pair(s) affected)"
                )

    # -- read access ---------------------------------------------------------------------------

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layer ids, in the row order of load arrays (L)."""
        return self._layers

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def servers(self) -> tuple[Server, ...]:
        """Servers sorted by ordinal (the column order S of matrices)."""
        return self._servers

    @property
    def ordinals(self) -> tuple[int, ...]:
        return tuple(server.ordinal for server in self._servers)

    @property
    def replication(self) -> int:
        return self._replication

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    @property
    def required_spread(self) -> int:
        """Failure domains every pair's replicas must cover (see `required_spread`)."""
        return required_spread(self._servers, len(self._layers) * self._num_experts, self._replication)

    def server(self, ordinal: int) -> Server:
        """The `Server` with this ordinal."""
        return self._servers[self.server_index(ordinal)]

    def server_index(self, ordinal: int) -> int:
        """Column of ``ordinal`` in matrices (position in ``servers``)."""
        try:
            return self._ordinal_index[ordinal]
        except KeyError:
            raise PlacementError(
                f"no server with ordinal {ordinal!r}; servers are {list(self.ordinals)}"
            ) from None

    def layer_index(self, layer: int) -> int:
        """Row of MoE layer id ``layer`` in load arrays."""
        try:
            return self._layer_index[layer]
        except KeyError:
            raise PlacementError(
                f"layer {layer!r} is not a MoE layer; layers are {_short(self._layers)}"
            ) from None

    def experts_of(self, server: int) -> list[LayerExpert]:
        """The (layer id, expert id) pairs hosted by server ``server`` (an ordinal), sorted."""
        return list(self._hosted_tuples()[self.server_index(server)])

    def servers_of(self, layer: int, expert: int) -> list[int]:
        """Ordinals of the servers hosting ``expert`` of MoE layer ``layer``, ascending."""
        row = self.layer_index(layer)
        if not _is_int(expert) or not 0 <= expert < self._num_experts:
            raise PlacementError(f"expert must be in 0..{self._num_experts - 1}, got {expert!r}")
        columns = np.flatnonzero(self._matrix[:, row, expert])
        return [self._servers[int(column)].ordinal for column in columns]

    def routing_table(self) -> dict[int, list[list[int]]]:
        """layer id → for each expert id, the ordinals hosting it (what an attention client routes by)."""
        ordinals = np.array(self.ordinals)
        table: dict[int, list[list[int]]] = {}
        for row, layer in enumerate(self._layers):
            hosting = self._matrix[:, row, :].T  # [E, S]
            table[layer] = [ordinals[hosting[expert]].tolist() for expert in range(self._num_experts)]
        return table

    def hosting_matrix(self) -> np.ndarray:
        """Read-only bool ``[S, L, E]``: ``[s, l, e]`` = server ``servers[s]`` hosts (layers[l], e)."""
        return self._matrix

    def replica_shares(self) -> np.ndarray:
        """Read-only float64 ``[L, E, S]``: the share of (l, e)'s tokens server s serves (an expert's
        tokens are spread evenly over its replicas: 1/replicas, or 0 where s does not host it)."""
        if self._shares is None:
            counts = np.maximum(self.replica_counts(), 1)  # [L, E]
            shares = np.transpose(self._matrix, (1, 2, 0)) / counts[:, :, None]
            shares.setflags(write=False)
            self._shares = shares
        return self._shares

    def replica_counts(self) -> np.ndarray:
        """int ``[L, E]``: number of replicas of each (layer, expert)."""
        return self.hosted_entries()[3]

    def hosted_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every hosted pair as index arrays (cached, read-only): layer row, server column and
        expert, int64 ``[N]`` each in (layer, server, expert) order, and the replica counts int
        ``[L, E]``."""
        if self._entries is None:
            num_servers, num_layers, num_experts = self._matrix.shape
            flat = np.flatnonzero(np.ascontiguousarray(self._matrix.transpose(1, 0, 2)))
            layer_server, expert = np.divmod(flat, num_experts)
            layer, server = np.divmod(layer_server, num_servers)
            counts = np.bincount(layer * num_experts + expert, minlength=num_layers * num_experts)
            entries = (layer, server, expert, counts.reshape(num_layers, num_experts))
            for array in entries:
                array.setflags(write=False)
            self._entries = entries
        return self._entries

    def used_slots(self) -> dict[int, int]:
        """ordinal → number of hosted pairs."""
        used = self._matrix.sum(axis=(1, 2))
        return {server.ordinal: int(used[column]) for column, server in enumerate(self._servers)}

    def domain_ids(self) -> tuple[np.ndarray, int]:
        """(int ``[S]`` failure-domain index per server, number of domains); see `domain_ids`."""
        return domain_ids(self._servers)

    def same_assignment(self, other: Placement) -> bool:
        """True when both host the same pairs on the same servers (versions may differ)."""
        return (
            self._layers == other._layers
            and self._num_experts == other._num_experts
            and self._servers == other._servers
            and self._replication == other._replication
            and np.array_equal(self._matrix, other._matrix)
        )

    def with_version(self, version: int) -> Placement:
        """The same assignment with another version."""
        return Placement.from_matrix(
            self._layers, self._num_experts, self._servers, self._matrix, self._replication, version
        )

    def _hosted_tuples(self) -> tuple[tuple[LayerExpert, ...], ...]:
        if self._hosted is None:
            columns, rows, experts = np.nonzero(self._matrix)
            per_server: list[list[LayerExpert]] = [[] for _ in self._servers]
            layers = self._layers
            for column, row, expert in zip(columns.tolist(), rows.tolist(), experts.tolist(), strict=True):
                per_server[column].append((layers[row], expert))
            self._hosted = tuple(tuple(sorted(pairs)) for pairs in per_server)
        return self._hosted

    # -- JSON form -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON-ready form (what the operator's placement ConfigMap stores)::

        {"schema_version": 1, "version": 7, "num_experts": 256, "layers": [3, 4, ...],
         "replication": 1,
         "servers": [{"ordinal": 0, "name": "expert-0", "domain": "node-a", "capacity": 261,
                      "experts": [[3, 0], [3, 64], ...]}, ...]}
        """
        hosted = self._hosted_tuples()
        return {
            "schema_version": SCHEMA_VERSION,
            "version": self._version,
            "num_experts": self._num_experts,
            "layers": list(self._layers),
            "replication": self._replication,
            "servers": [
                {**server.to_dict(), "experts": [[layer, expert] for layer, expert in hosted[column]]}
                for column, server in enumerate(self._servers)
            ],
        }

    def to_json(self) -> str:
        """Compact, deterministic JSON text of `to_dict`."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> Placement:
        """Parse `to_dict` output; malformed input raises `PlacementError` naming the field."""
        header, hosted = parse_dict(data)
        return cls(
            header.layers,
            header.num_experts,
            header.servers,
            hosted,
            replication=header.replication,
            version=header.version,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Placement:
        """Parse `to_json` output."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PlacementError(f"placement is not valid JSON: {error}") from None
        return cls.from_dict(data)

    # -- dunder --------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._version == other._version and self.same_assignment(other)

    def __hash__(self) -> int:
        key = (self._layers, self._num_experts, self._servers, self._replication, self._version)
        return hash((key, self._matrix.tobytes()))

    def __repr__(self) -> str:
        return (
            f"Placement(version={self._version}, layers={_short(self._layers)}, "
            f"num_experts={self._num_experts}, servers={len(self._servers)}, "
            f"replication={self._replication}, pairs={int(self._matrix.sum())})"
        )


@dataclass(frozen=True)
class Header:
    """A placement's fields other than who hosts what (see `Placement`)."""

    layers: list[int]
    num_experts: int
    servers: list[Server]
    replication: int
    version: int


def parse_dict(
    data: Any, extra_keys: frozenset[str] = frozenset()
) -> tuple[Header, dict[int, list[LayerExpert]]]:
    """The header and ordinal → hosted pairs of `to_dict` output (a server's ``experts`` may be
    absent: none); `extra_keys` are top-level keys also allowed. Malformed input raises
    `PlacementError` naming the field."""
    if not isinstance(data, Mapping):
        raise PlacementError(f"placement must be a JSON object, got {type(data).__name__}")
    allowed = {"schema_version", "version", "num_experts", "layers", "replication", "servers"}
    _check_keys(data, allowed | extra_keys, "placement")
    schema = data.get("schema_version")
    if schema != SCHEMA_VERSION:
        raise PlacementError(
            f"placement.schema_version is {schema!r}; this build reads schema_version {SCHEMA_VERSION}"
        )
    version = _need_int(data, "version", "placement")
    num_experts = _need_int(data, "num_experts", "placement")
    replication = _need_int(data, "replication", "placement")
    layers = data.get("layers")
    if not isinstance(layers, list) or not all(_is_int(layer) for layer in layers):
        raise PlacementError(f"placement.layers must be a list of ints, got {layers!r:.80}")
    raw_servers = data.get("servers")
    if not isinstance(raw_servers, list):
        raise PlacementError(f"placement.servers must be a list, got {type(raw_servers).__name__}")
    servers: list[Server] = []
    hosted: dict[int, list[LayerExpert]] = {}
    for i, raw in enumerate(raw_servers):
        where = f"placement.servers[{i}]"
        if not isinstance(raw, Mapping):
            raise PlacementError(f"{where} must be an object, got {type(raw).__name__}")
        _check_keys(raw, {"ordinal", "name", "domain", "capacity", "experts"}, where)
        ordinal = _need_int(raw, "ordinal", where)
        capacity = _need_int(raw, "capacity", where)
        name = raw.get("name")
        domain = raw.get("domain")
        for field, value in (("name", name), ("domain", domain)):
            if value is not None and not isinstance(value, str):
                raise PlacementError(f"{where}.{field} must be a string or null, got {value!r}")
        experts = raw.get("experts", [])
        if not isinstance(experts, list):
            raise PlacementError(f"{where}.experts must be a list of [layer, expert] pairs")
        pairs = [_check_pair(pair, f"{where}.experts[{j}]") for j, pair in enumerate(experts)]
        if ordinal in hosted:
            raise PlacementError(f"{where}: ordinal {ordinal} appears twice")
        servers.append(Server(ordinal=ordinal, capacity=capacity, name=name, domain=domain))
        hosted[ordinal] = pairs
    return Header(layers, num_experts, servers, replication, version), hosted


def domain_ids(servers: Sequence[Server]) -> tuple[np.ndarray, int]:
    """(int ``[S]`` failure-domain index of each server, number of domains). A server with no domain
    is its own domain; named domains are numbered in sorted order, then the unnamed ones."""
    names = sorted({server.domain for server in servers if server.domain is not None})
    index = {name: i for i, name in enumerate(names)}
    ids = np.empty(len(servers), dtype=np.int64)
    next_id = len(names)
    for column, server in enumerate(servers):
        if server.domain is None:
            ids[column] = next_id
            next_id += 1
        else:
            ids[column] = index[server.domain]
    return ids, next_id


def check_feasible(num_layers: int, num_experts: int, servers: Sequence[Server], replication: int) -> None:
    """Raise `PlacementError` unless ``servers`` can hold ``replication`` replicas (on distinct
    servers) of each of ``num_layers x num_experts`` pairs."""
    if replication > len(servers):
        raise PlacementError(
            f"replication={replication} needs at least {replication} servers (replicas live on "
            f"distinct servers), got {len(servers)}"
        )
    total_capacity = sum(server.capacity for server in servers)
    needed = replication * num_layers * num_experts
    if total_capacity < needed:
        raise PlacementError(
            f"total capacity {total_capacity} slots < replication {replication} x {num_layers} "
            f"layers x {num_experts} experts = {needed}"
        )
    pairs = num_layers * num_experts
    if replication > 1 and sum(min(server.capacity, pairs) for server in servers) < needed:
        raise PlacementError(
            f"replication={replication}: a server holds at most one replica of each of the {pairs} "
            f"pairs, so the servers' usable capacity is below the {needed} slots needed"
        )


def required_spread(servers: Sequence[Server], num_pairs: int, replication: int) -> int:
    """How many distinct failure domains the replicas of every pair must cover: ``min(R, domains)``
    where the domains' slots allow it, else the largest ``k`` they allow (a domain can give each
    pair at most one replica towards the spread). 1 when no two servers share a domain and R = 1."""
    ids, num_domains = domain_ids(servers)
    slots = np.zeros(num_domains, dtype=np.int64)
    np.add.at(slots, ids, [server.capacity for server in servers])
    usable = int(np.minimum(slots, num_pairs).sum())
    return max(1, min(replication, num_domains, usable // max(num_pairs, 1)))


def _count_true(matrix: np.ndarray, axis: int) -> np.ndarray:
    """``matrix.sum(axis)`` of a bool matrix, summed in the narrowest unsigned type that cannot
    overflow (several times faster than numpy's default int64 sum of bools)."""
    total = np.add.reduce(matrix.view(np.uint8), axis=axis, dtype=np.min_scalar_type(matrix.shape[axis]))
    return total.astype(np.int64)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _short(values: Sequence[int]) -> str:
    items = list(values)
    if len(items) <= 8:
        return str(items)
    return f"[{items[0]}, {items[1]}, ..., {items[-1]}] ({len(items)} layers)"


def _check_pair(pair: object, where: str) -> LayerExpert:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not _is_int(pair[0]) or not _is_int(pair[1]):
        raise PlacementError(f"{where}: expected a [layer, expert] pair of ints, got {pair!r}")
    return int(pair[0]), int(pair[1])


def _check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlacementError(f"{where} has unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _need_int(data: Mapping[str, Any], key: str, where: str) -> int:
    if key not in data:
        raise PlacementError(f"{where}.{key} is missing")
    value = data[key]
    if not _is_int(value):
        raise PlacementError(f"{where}.{key} must be an int, got {value!r}")
    return int(value)
