"""The placement a pod follows: the newer of its mounted files and its ConfigMap watch, never older
than what it read before (``eaas.runtime.placement.source``). No API server here: the watch's state
is set the way its watch events set it (``_set`` with the ConfigMap as the API returns it)."""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import pytest

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.placement import Placement, PlacementError, Server, stored
from eaas.runtime.placement.source import (
    ConfigMapWatch,
    MountedFiles,
    PlacementSource,
    config_map_bytes,
    newness,
)


def placement(version: int, servers: int = 2) -> Placement:
    """Two layers of four experts, every server hosting all of them (placements differ by version)."""
    everything = [(layer, e) for layer in (0, 1) for e in range(4)]
    return Placement(
        [0, 1],
        4,
        [Server(n, capacity=len(everything)) for n in range(servers)],
        {n: everything for n in range(servers)},
        replication=1,
        version=version,
    )


def config_map(committed: Placement | None, pending: Placement | None) -> dict[str, object]:
    """The ConfigMap as the API returns it: packed placements base64-encoded in binaryData."""
    return {"metadata": {"name": "pool-placement"}, "binaryData": stored.config_map_data(committed, pending)}


def write(directory: Path, committed: Placement | None, pending: Placement | None) -> None:
    """As the kubelet projects the ConfigMap (a key that is gone is a file that is gone)."""
    for key, value in ((PLACEMENT_KEY, committed), (PENDING_KEY, pending)):
        path = directory / key
        if value is None:
            path.unlink(missing_ok=True)
        else:
            tmp = path.with_name(f".{key}.tmp")
            tmp.write_bytes(stored.pack(value))
            tmp.replace(path)


def versions(source: PlacementSource) -> tuple[int | None, int | None]:
    committed, pending = source.read().parse()
    return (
        committed.version if committed is not None else None,
        pending.version if pending is not None else None,
    )


@pytest.fixture
def files(tmp_path: Path) -> MountedFiles:
    return MountedFiles.directory(tmp_path)


def test_newness_grows_with_every_placement_the_operator_publishes() -> None:
    # propose v2, commit it, propose v3, replace it by v4 (a server was lost), commit v4
    steps = [(1, None), (1, 2), (2, None), (2, 3), (2, 4), (4, None)]
    keys = [newness(placement(c), placement(p) if p else None) for c, p in steps]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert newness(None, placement(1)) == (1, 0)  # the first placement, before its commit
    assert newness(None, None) is None


def test_config_map_bytes_are_the_file_bytes(tmp_path: Path) -> None:
    committed, pending = placement(3), placement(4, servers=3)
    texts = config_map_bytes(config_map(committed, pending), "ConfigMap ns/pool-placement")
    write(tmp_path, committed, pending)
    assert texts.committed == (tmp_path / PLACEMENT_KEY).read_bytes()
    assert texts.pending == (tmp_path / PENDING_KEY).read_bytes()
    older = {"data": {PLACEMENT_KEY: committed.to_json()}}  # what an older operator wrote
    assert config_map_bytes(older, "x").parse()[0] == committed
    assert config_map_bytes(None, "x").empty  # deleted
    written_by_hand = config_map_bytes({"binaryData": {PLACEMENT_KEY: "not base64!"}}, "ConfigMap ns/p")
    with pytest.raises(PlacementError, match="ConfigMap ns/p placement"):  # reported, not a watch failure
        written_by_hand.parse()


def test_the_watch_wins_while_the_files_lag_and_never_goes_back(tmp_path: Path, files: MountedFiles) -> None:
    write(tmp_path, placement(1), None)
    watch = ConfigMapWatch("ns", "pool-placement")
    source = PlacementSource(files, watch)
    assert versions(source) == (1, None)  # no watch state yet: the files
    watch._set(config_map(placement(1), placement(2)))  # proposed: the files do not show it yet
    assert versions(source) == (1, 2)
    assert source.read().origin == "ConfigMap ns/pool-placement"
    watch._set(config_map(placement(2), None))  # committed
    assert versions(source) == (2, None)
    write(tmp_path, placement(1), placement(2))  # the kubelet catches up with the proposal only
    assert versions(source) == (2, None)  # older than what was read: not taken
    write(tmp_path, placement(2), None)
    assert versions(source) == (2, None)


def test_the_files_win_when_the_watch_is_behind(tmp_path: Path, files: MountedFiles) -> None:
    watch = ConfigMapWatch("ns", "pool-placement")
    watch._set(config_map(placement(1), placement(2)))  # then the API server went away
    source = PlacementSource(files, watch)
    write(tmp_path, placement(1), None)
    assert versions(source) == (1, 2)  # the files are older
    write(tmp_path, placement(2), None)  # committed meanwhile: the files show it first
    assert versions(source) == (2, None)
    assert source.read().origin == str(tmp_path)


def test_without_a_watch_the_files_are_followed_as_they_change(tmp_path: Path, files: MountedFiles) -> None:
    source = PlacementSource(files)
    assert source.read().empty  # nothing mounted yet (a client before the first commit)
    write(tmp_path, None, placement(1))
    assert versions(source) == (None, 1)
    first = source.read()
    assert source.read() is first  # unchanged: the same object (readers skip it without hashing)
    write(tmp_path, placement(1), None)
    assert versions(source) == (1, None)


def test_a_broken_placement_is_handed_on_only_when_nothing_as_new_parses(
    tmp_path: Path, files: MountedFiles
) -> None:
    watch = ConfigMapWatch("ns", "pool-placement")
    source = PlacementSource(files, watch)
    (tmp_path / PLACEMENT_KEY).write_bytes(b"not a placement")
    with pytest.raises(PlacementError, match=PLACEMENT_KEY):  # the reader reports it, naming the key
        source.read().parse()
    watch._set(config_map(placement(1), None))
    assert versions(source) == (1, None)  # the watch's good one, though the files are broken
    watch._set({"binaryData": {PLACEMENT_KEY: base64.b64encode(b"\x1f\x8bjunk").decode()}})
    texts = source.read()  # both broken: the reader is told (and keeps serving v1)
    with pytest.raises(PlacementError, match=r"ConfigMap ns/pool-placement placement\.json"):
        texts.parse()
    watch._set(config_map(placement(2), None))
    assert versions(source) == (2, None)


def test_a_deleted_config_map_keeps_the_last_placement(tmp_path: Path, files: MountedFiles) -> None:
    watch = ConfigMapWatch("ns", "pool-placement")
    source = PlacementSource(files, watch)
    watch._set(config_map(placement(3), None))
    assert versions(source) == (3, None)
    watch._set(None)  # DELETED
    assert versions(source) == (3, None)
    watch._set(config_map(placement(4), None))  # created again, newer
    assert versions(source) == (4, None)


def test_a_reader_waiting_between_polls_is_woken_by_a_watched_change(files: MountedFiles) -> None:
    watch = ConfigMapWatch("ns", "pool-placement")
    source = PlacementSource(files, watch)
    timer = threading.Timer(0.1, watch._set, [config_map(placement(2), None)])
    started = time.monotonic()
    timer.start()
    source.wait(30.0)  # the poll interval: cut short by the change
    assert time.monotonic() - started < 5.0
    assert versions(source) == (2, None)
    source.wake()  # a stopping reader: at once, too
    started = time.monotonic()
    source.wait(30.0)
    assert time.monotonic() - started < 5.0
