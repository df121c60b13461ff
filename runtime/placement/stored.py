"""The placement as the operator stores it (the pool's ConfigMap) and the pods read it (its mount).

The placement ConfigMap holds two keys, :data:`~eaas.runtime.contract.PLACEMENT_KEY` (committed)
and :data:`~eaas.runtime.contract.PENDING_KEY` (being loaded), each in ``binaryData`` in the
*packed* form :func:`pack` writes: gzip of one JSON header line (the placement without its
experts) followed by the hosting bitmap, bool ``[S, L·E]`` (S = servers by ordinal, L = MoE
layers in ``layers`` order, E = experts) packed eight to a byte, each server's row padded to whole
bytes. ``Placement.to_json`` lists every hosted ``[layer, expert]``: 0.78 MiB for Kimi-K2
(60 × 384, R=4) and twice that with a pending placement, past the 1 MiB the API server stores in
a ConfigMap; packed, the same placements take about a tenth of that (the tests check DeepSeek-V3
and Kimi-K2 at R = 2, 3, 4 on 64 and 320 servers).

Every reader goes through :func:`unpack` (and :func:`read_file`, :func:`read_config_map`), which
also reads the JSON of ``Placement.to_json``: what an older operator wrote to ``data``, and what
the local launcher and hand-written files hold.
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.placement.placement import SCHEMA_VERSION, Placement, PlacementError, parse_dict

CONFIG_MAP_LIMIT_BYTES = 1024 * 1024
"""What the API server stores in one ConfigMap: ``data`` and ``binaryData`` values together."""

GZIP_MAGIC = b"\x1f\x8b"
HOSTING = "bitmap"  # the header's ``hosting``: how the bytes after the header line encode it


class PlacementTooLarge(PlacementError):
    """The packed placements do not fit in one ConfigMap."""

    def __init__(self, size: int, limit: int = CONFIG_MAP_LIMIT_BYTES) -> None:
        self.size, self.limit = size, limit
        super().__init__(
            f"the placement ConfigMap would hold {size} bytes; the API server stores at most {limit}"
        )


def pack(placement: Placement) -> bytes:
    """The packed form of `placement` (see the module docstring); deterministic."""
    header = {
        "schema_version": SCHEMA_VERSION,
        "version": placement.version,
        "num_experts": placement.num_experts,
        "layers": list(placement.layers),
        "replication": placement.replication,
        "servers": [server.to_dict() for server in placement.servers],
        "hosting": HOSTING,
    }
    matrix = placement.hosting_matrix()  # bool [S, L, E]
    bits = np.packbits(matrix.reshape(matrix.shape[0], -1), axis=1)  # uint8 [S, ceil(L·E / 8)]
    line = json.dumps(header, separators=(",", ":")).encode() + b"\n"
    return gzip.compress(line + bits.tobytes(), compresslevel=9, mtime=0)


def unpack(raw: bytes | str) -> Placement:
    """A placement from its packed form or from ``Placement.to_json`` text; `PlacementError`
    names what is wrong."""
    if isinstance(raw, str):
        raw = raw.encode()
    if not raw.startswith(GZIP_MAGIC):
        return Placement.from_json(raw)
    try:
        content = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        raise PlacementError(f"packed placement: not readable gzip ({error})") from None
    line, newline, bits = content.partition(b"\n")
    if not newline:
        raise PlacementError("packed placement: no header line")
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlacementError(f"packed placement: the header is not JSON ({error})") from None
    if not isinstance(header, dict) or header.get("hosting") != HOSTING:
        hosting = header.get("hosting") if isinstance(header, dict) else None
        raise PlacementError(f"packed placement: hosting must be {HOSTING!r}, got {hosting!r}")
    fields, _ = parse_dict(header, extra_keys=frozenset({"hosting"}))
    num_servers, num_pairs = len(fields.servers), len(fields.layers) * fields.num_experts
    row = (num_pairs + 7) // 8
    if len(bits) != num_servers * row:
        raise PlacementError(
            f"packed placement: the bitmap has {len(bits)} bytes; {num_servers} servers x "
            f"{num_pairs} pairs need {num_servers * row}"
        )
    packed = np.frombuffer(bits, dtype=np.uint8).reshape(num_servers, row)
    matrix = np.unpackbits(packed, axis=1, count=num_pairs).astype(bool)  # [S, L·E]
    return Placement.from_matrix(
        fields.layers,
        fields.num_experts,
        fields.servers,
        matrix.reshape(num_servers, len(fields.layers), fields.num_experts),
        fields.replication,
        fields.version,
    )


def read_file(path: Path) -> Placement | None:
    """The placement in `path` (a mounted ConfigMap key, or a file a person wrote); None when the
    file does not exist. `PlacementError` names the file and what is wrong."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return unpack(raw)
    except PlacementError as error:
        raise PlacementError(f"{path}: {error}") from error


def config_map_data(committed: Placement | None, pending: Placement | None) -> dict[str, str]:
    """The ConfigMap's ``binaryData`` (key → base64 of the packed form; a key is absent when there
    is no such placement). Raises :class:`PlacementTooLarge` when they do not fit in a ConfigMap."""
    packed = {
        key: pack(placement)
        for key, placement in ((PLACEMENT_KEY, committed), (PENDING_KEY, pending))
        if placement is not None
    }
    size = sum(len(value) for value in packed.values())
    if size > CONFIG_MAP_LIMIT_BYTES:
        raise PlacementTooLarge(size, CONFIG_MAP_LIMIT_BYTES)
    return {key: base64.b64encode(value).decode() for key, value in packed.items()}


def read_config_map(config_map: Mapping[str, Any]) -> tuple[Placement | None, Placement | None]:
    """(committed, pending) of a placement ConfigMap as the API returns it: ``binaryData`` (base64
    of the packed form) or, as an older operator wrote it, ``data`` (JSON). `PlacementError` names
    the ConfigMap, the key and what is wrong."""
    binary = config_map.get("binaryData") or {}
    data = config_map.get("data") or {}
    name = (config_map.get("metadata") or {}).get("name", "")
    placements: list[Placement | None] = []
    for key in (PLACEMENT_KEY, PENDING_KEY):
        try:
            if key in binary:
                placements.append(unpack(base64.b64decode(binary[key], validate=True)))
            elif key in data:
                placements.append(unpack(data[key]))
            else:
                placements.append(None)
        except (PlacementError, ValueError) as error:
            raise PlacementError(f"ConfigMap {name} key {key}: {error}") from error
    return placements[0], placements[1]
