"""The placement as stored in the pool's ConfigMap: packed, read back exactly, old JSON still read."""

from __future__ import annotations

import base64
import gzip
from pathlib import Path

import numpy as np
import pytest

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.placement import Placement, PlacementError, Server, stored
from eaas.runtime.placement.builders import round_robin


def placement(version: int = 3) -> Placement:
    servers = [Server(n, 30, f"p-experts-{n}", "node-a" if n % 2 else None) for n in range(6)]
    return round_robin(range(3, 8), 16, servers, 2, version=version)


def test_packed_placement_reads_back_exactly() -> None:
    original = placement()
    packed = stored.pack(original)
    assert packed.startswith(stored.GZIP_MAGIC)
    copy = stored.unpack(packed)
    assert copy == original  # the version and every server's experts
    assert copy.servers == original.servers and copy.replication == original.replication
    assert stored.pack(copy) == packed  # deterministic: an unchanged placement is an unchanged key


def test_the_json_an_older_operator_wrote_is_read(tmp_path: Path) -> None:
    original = placement()
    assert stored.unpack(original.to_json()) == original
    (tmp_path / PLACEMENT_KEY).write_text(original.to_json())
    (tmp_path / PENDING_KEY).write_bytes(stored.pack(original.with_version(4)))
    assert stored.read_file(tmp_path / PLACEMENT_KEY) == original
    assert stored.read_file(tmp_path / PENDING_KEY) == original.with_version(4)
    assert stored.read_file(tmp_path / "absent.json") is None
    old = {"metadata": {"name": "p-placement"}, "data": {PLACEMENT_KEY: original.to_json()}}
    assert stored.read_config_map(old) == (original, None)


def test_config_map_data_holds_both_keys_and_reads_back() -> None:
    committed, pending = placement(3), placement(4)
    binary = stored.config_map_data(committed, pending)
    assert set(binary) == {PLACEMENT_KEY, PENDING_KEY}
    config_map = {"metadata": {"name": "p-placement"}, "binaryData": binary}
    assert stored.read_config_map(config_map) == (committed, pending)
    assert stored.read_config_map({"metadata": {"name": "p-placement"}}) == (None, None)


def test_placements_past_the_limit_are_refused_naming_size_and_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    size = len(stored.pack(placement(3))) + len(stored.pack(placement(4)))
    monkeypatch.setattr(stored, "CONFIG_MAP_LIMIT_BYTES", size - 1)
    with pytest.raises(stored.PlacementTooLarge, match=f"would hold {size} bytes; .* at most {size - 1}"):
        stored.config_map_data(placement(3), placement(4))


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"\x1f\x8b\x08garbage", "not readable gzip"),
        (gzip.compress(b'{"hosting": "bitmap"}'), "no header line"),
        (gzip.compress(b"{not json\n"), "header is not JSON"),
        (gzip.compress(b'{"hosting": "list"}\n'), "hosting must be 'bitmap', got 'list'"),
        (b'{"schema_version": 1, "layers": [', "not valid JSON"),
    ],
)
def test_garbled_input_names_the_problem(raw: bytes, error: str) -> None:
    with pytest.raises(PlacementError, match=error):
        stored.unpack(raw)


def test_a_bitmap_of_the_wrong_length_or_an_under_replicated_one_is_refused() -> None:
    content = gzip.decompress(stored.pack(placement()))
    header, _, bits = content.partition(b"\n")
    with pytest.raises(PlacementError, match=r"bitmap has 59 bytes; 6 servers x 80 pairs need 60"):
        stored.unpack(gzip.compress(header + b"\n" + bits[:-1]))
    with pytest.raises(PlacementError, match="replica"):  # the checks of Placement apply
        stored.unpack(gzip.compress(header + b"\n" + bytes(len(bits))))


def test_binary_data_that_is_not_base64_names_the_config_map_and_key() -> None:
    config_map = {"metadata": {"name": "p-placement"}, "binaryData": {PENDING_KEY: "***"}}
    with pytest.raises(PlacementError, match=f"ConfigMap p-placement key {PENDING_KEY}"):
        stored.read_config_map(config_map)
    good = base64.b64encode(stored.pack(placement())).decode()
    assert stored.read_config_map({"binaryData": {PENDING_KEY: good}})[1] == placement()


def test_an_unstructured_placement_packs_to_about_its_information() -> None:
    """Random hosting (no planner's regularity to exploit): Kimi-K2 at R=4 on 320 servers."""
    layers, experts, replication, num_servers = 60, 384, 4, 320
    matrix = random_hosting(num_servers, layers, experts, replication)
    capacity = int(matrix.sum(axis=(1, 2)).max())
    servers = [Server(n, capacity, f"kimi-experts-{n}") for n in range(num_servers)]
    random = Placement.from_matrix(range(1, layers + 1), experts, servers, matrix, replication, 1)
    assert len(random.to_json()) > 700 * 1024
    assert len(stored.pack(random)) < 160 * 1024
    assert stored.unpack(stored.pack(random)) == random


def random_hosting(num_servers: int, layers: int, experts: int, replication: int) -> np.ndarray:
    """bool ``[S, L, E]``: each (layer, expert) on `replication` servers drawn at random."""
    keys = np.random.default_rng(0).random((layers * experts, num_servers))
    chosen = np.argpartition(keys, replication, axis=1)[:, :replication]  # [L·E, R]
    matrix = np.zeros((layers * experts, num_servers), dtype=bool)
    np.put_along_axis(matrix, chosen, True, axis=1)
    return matrix.T.reshape(num_servers, layers, experts)
