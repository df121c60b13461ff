"""A running expert server follows its placement directory (the mounted placement ConfigMap)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.client.connection import ServerConnection
from eaas.runtime.model import CheckpointReader, ExpertStack, LocalExperts
from eaas.runtime.placement import Placement, Server, stored
from eaas.runtime.protocol import Status
from eaas.runtime.server.placement_watch import Target, target_for
from eaas.runtime.server.restack import restack
from eaas.runtime.transport import RemoteError
from eaas.runtime.transport.shm_segment import remove_segments_of

Pair = tuple[int, int]


def placement(layers: list[int], num_experts: int, mine: list[Pair], version: int) -> Placement:
    """Server 0 hosts ``mine``; server 1 hosts everything (so every pair keeps a replica)."""
    everything = [(layer, e) for layer in layers for e in range(num_experts)]
    servers = [Server(n, capacity=len(everything)) for n in (0, 1)]
    return Placement(layers, num_experts, servers, {0: mine, 1: everything}, replication=1, version=version)


def write_atomically(path: Path, text: str | bytes) -> None:
    """As kubelet does: the reader sees the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    tmp.replace(path)


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read()


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def model(tiny_checkpoints: dict[str, Path]) -> tuple[Path, list[int], int]:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    return checkpoint, list(config.moe_layers), config.num_experts


@contextlib.contextmanager
def server_process(
    model: tuple[Path, list[int], int], tmp_path: Path, *extra: str
) -> Iterator[tuple[str, Path, subprocess.Popen[bytes], Callable[[], str]]]:
    """Server 0 as a process following ``tmp_path/placement`` (it hosts the even experts, server
    1 everything): (url, directory, process, log)."""
    checkpoint, layers, num_experts = model
    directory = tmp_path / "placement"
    directory.mkdir()
    first = [(layer, e) for layer in layers for e in range(num_experts) if e % 2 == 0]
    write_atomically(directory / "placement.json", placement(layers, num_experts, first, 1).to_json())
    ready, log_path = tmp_path / "ready.json", tmp_path / "server.log"
    command = [
        sys.executable, "-m", "eaas.runtime.server", "--checkpoint", str(checkpoint),
        "--placement-dir", str(directory), "--placement-poll-seconds", "0.1", "--ordinal", "0",
        "--transports", "tcp", "--threads", "1", "--ready-file", str(ready),
        "--exit-with-parent", str(os.getpid()), *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready.exists() or process.poll() is not None, "the server to start", 60)
        assert process.poll() is None, log_path.read_text()
        url = json.loads(ready.read_text())["url"]
        yield url, directory, process, log_path.read_text
    finally:
        process.send_signal(signal.SIGINT)  # at once (SIGTERM would start a drain)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        remove_segments_of(process.pid)


@pytest.fixture
def started(
    model: tuple[Path, list[int], int], tmp_path: Path
) -> Iterator[tuple[str, Path, Path, Callable[[], str]]]:
    """Server 0 as a process following ``tmp_path/placement``: (url, directory, checkpoint, log)."""
    with server_process(model, tmp_path) as (url, directory, _, log):
        yield url, directory, model[0], log


def info(url: str) -> dict[str, Any]:
    return json.loads(get(f"{url}/v1/info")[1])


def hosted(url: str) -> set[Pair]:
    return {(layer, expert) for layer, expert in info(url)["hosted"]}


def ask(url: str, layer: int, experts: list[int]) -> torch.Tensor:
    """One request applying ``experts`` (one per token) of ``layer``, answered by the server."""
    connection = ServerConnection(0, url, "tcp", "test", 5.0, 2.0)
    connection.connect()
    try:
        assert connection.channel is not None
        connection.channel.send(layer, *inputs(experts))
        return connection.channel.receive(time.monotonic() + 5)
    finally:
        connection.close()


def inputs(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(len(experts))
    x = torch.randn(len(experts), 64, generator=generator)  # [T, H]
    ids = torch.tensor([[e, -1] for e in experts], dtype=torch.int32)  # [T, K]
    weights = torch.rand(len(experts), 2, generator=generator)  # [T, K]
    return x, ids, weights


def test_a_running_server_loads_moved_experts_and_drops_old_ones(
    started: tuple[str, Path, Path, Callable[[], str]], model: tuple[Path, list[int], int]
) -> None:
    url, directory, checkpoint, log = started
    _, layers, num_experts = model
    reader = CheckpointReader(checkpoint)
    reference = LocalExperts(ExpertStack.load(reader, [(la, e) for la in layers for e in range(num_experts)]))
    evens = {(layer, e) for layer in layers for e in range(num_experts) if e % 2 == 0}
    odds = {(layer, e) for layer in layers for e in range(num_experts) if e % 2 == 1}
    assert info(url)["placement_version"] == 1 and hosted(url) == evens
    layer = layers[1]

    # v2 moves every expert of server 0: the odd ones are loaded, the even ones dropped.
    write_atomically(directory / "placement.json", placement(layers, num_experts, sorted(odds), 2).to_json())
    wait_for(lambda: info(url)["placement_version"] == 2, "placement v2 to be loaded")
    assert hosted(url) == odds
    y = ask(url, layer, [1, 3, 5, 7])
    torch.testing.assert_close(y, reference(layer, *inputs([1, 3, 5, 7])), rtol=1e-5, atol=1e-5)
    with pytest.raises(RemoteError) as refused:
        ask(url, layer, [1, 2])
    assert refused.value.status == Status.NOT_HOSTED and "expert 2" in str(refused.value)
    assert "eaas_expert_server_placement_version 2.0" in get(f"{url}/metrics")[1].decode()

    # Pending v3 (experts 0-3), packed as the operator writes it: served together with the
    # committed v2 (JSON, as an older operator wrote it) until v3 is committed.
    low = {(la, e) for la in layers for e in range(4)}
    write_atomically(directory / "pending.json", stored.pack(placement(layers, num_experts, sorted(low), 3)))
    wait_for(lambda: info(url)["placement_version"] == 3, "pending placement v3 to be loaded")
    assert hosted(url) == odds | low
    # Commit: placement.json = v3, pending.json removed -> the experts only v2 had are dropped.
    write_atomically(
        directory / "placement.json", stored.pack(placement(layers, num_experts, sorted(low), 3))
    )
    (directory / "pending.json").unlink()
    wait_for(lambda: hosted(url) == low, "the experts of v2 alone to be dropped")
    assert info(url)["placement_version"] == 3
    y = ask(url, layer, [0, 2, 3])
    torch.testing.assert_close(y, reference(layer, *inputs([0, 2, 3])), rtol=1e-5, atol=1e-5)

    # A corrupt file: logged with its name, the server keeps serving v3.
    write_atomically(directory / "placement.json", '{"schema_version": 1, "layers": [')
    wait_for(lambda: info(url)["placement_error"], "the placement error to be reported")
    assert "placement.json" in info(url)["placement_error"]
    wait_for(lambda: "placement.json" in log() and "still serving placement v3" in log(), "the log line")
    assert info(url)["placement_version"] == 3 and hosted(url) == low
    assert "eaas_expert_server_placement_errors_total 1.0" in get(f"{url}/metrics")[1].decode()
    torch.testing.assert_close(ask(url, layer, [0, 2, 3]), y)

    # A valid placement of another model (layer 9 does not exist here): cannot be loaded.
    alien = placement([*layers, 9], num_experts, [(9, 0)], 5)
    write_atomically(directory / "placement.json", alien.to_json())
    wait_for(lambda: "cannot load its experts" in (info(url)["placement_error"] or ""), "the load error")
    assert "layer=9" in info(url)["placement_error"]
    assert info(url)["placement_version"] == 3 and hosted(url) == low

    # A placement without this server (it is being drained): it keeps serving what it has. (Newer
    # than v5: a placement older than one already read is not taken, as the operator never
    # publishes one.)
    drained = Placement(layers, num_experts, [Server(1, len(evens | odds))], {1: sorted(evens | odds)}, 1, 6)
    write_atomically(directory / "placement.json", drained.to_json())
    wait_for(lambda: "being drained" in log(), "the drain to be noticed")
    assert info(url)["placement_version"] == 3 and hosted(url) == low and info(url)["placement_error"] is None
    assert get(f"{url}/readyz") == (200, b"ready\n")


def test_restack_reads_only_new_experts(model: tuple[Path, list[int], int]) -> None:
    checkpoint, layers, _ = model
    read: list[str] = []

    class CountingReader(CheckpointReader):
        def iter_load_slices(
            self,
            refs: list[tuple[str, int | None]],
            dtype: torch.dtype | None = None,
            progress: str | None = None,
            dequantize: bool = True,
        ) -> Iterator[tuple[tuple[str, int | None], torch.Tensor]]:
            read.extend(name for name, _ in refs)
            return super().iter_load_slices(refs, dtype, progress, dequantize)

    reader = CountingReader(checkpoint)
    old = ExpertStack.load(reader, [(layers[0], 0), (layers[0], 1), (layers[1], 5)])
    read.clear()
    wanted = [(layers[0], 1), (layers[1], 5), (layers[2], 7)]
    new, num_loaded = restack(old, reader, wanted)
    expected = ExpertStack.load(CheckpointReader(checkpoint), wanted)
    assert num_loaded == 1 and len(read) == 3 and all(f".{layers[2]}." in n and ".7." in n for n in read)
    assert new.pairs == expected.pairs
    torch.testing.assert_close(new.w13, expected.w13, rtol=0, atol=0)
    torch.testing.assert_close(new.w2, expected.w2, rtol=0, atol=0)
    assert old.pairs == [(layers[0], 0), (layers[0], 1), (layers[1], 5)]  # untouched: may still serve
    empty, _ = restack(old, reader, [])
    assert empty.pairs == [] and empty.w13.shape[0] == 0


def test_target_is_the_union_while_pending_and_none_when_drained(model: tuple[Path, list[int], int]) -> None:
    _, layers, num_experts = model
    a, b = [(layers[0], 0), (layers[0], 1)], [(layers[0], 1), (layers[1], 2)]
    committed, pending = placement(layers, num_experts, a, 5), placement(layers, num_experts, b, 6)
    assert target_for(0, committed, None) == Target(5, frozenset(a))
    assert target_for(0, committed, pending) == Target(6, frozenset(a) | frozenset(b))
    assert target_for(0, None, pending) == Target(6, frozenset(b))
    without_0 = Placement(layers, num_experts, [Server(1, 99)], {1: pending.experts_of(1)}, 1, 7)
    assert target_for(0, committed, without_0) == Target(5, frozenset(a))  # draining: keeps its set
    assert target_for(0, without_0, None) is None


def test_experts_of_an_older_placement_stay_while_a_client_routes_by_it(
    started: tuple[str, Path, Path, Callable[[], str]], model: tuple[Path, list[int], int]
) -> None:
    """The drill that found it: a request that started on v1 still routes an expert to this server
    after v2 (which moves it away) is committed. Its slot said v1, so the expert stays until that
    slot is released; a client that says nothing, or v2, holds nothing back."""
    url, directory, _, log = started
    _, layers, num_experts = model
    evens = {(layer, e) for layer in layers for e in range(num_experts) if e % 2 == 0}
    odds = {(layer, e) for layer in layers for e in range(num_experts) if e % 2 == 1}
    old_client = ServerConnection(0, url, "tcp", "old", 5.0, 2.0, placement_version=1)
    new_client = ServerConnection(0, url, "tcp", "new", 5.0, 2.0, placement_version=2)
    old_client.connect()
    try:
        write_atomically(
            directory / "placement.json", placement(layers, num_experts, sorted(odds), 2).to_json()
        )
        wait_for(lambda: info(url)["placement_version"] == 2, "placement v2 to be loaded")
        assert hosted(url) == evens | odds  # v1's experts kept for the client on v1
        assert "keeping" in log() and "clients still on v1" in log()
        new_client.connect()  # a v2 client changes nothing while the v1 one is there
        assert old_client.channel is not None
        old_client.channel.send(layers[0], *inputs([0, 2]))  # even: v1 only
        old_client.channel.receive(time.monotonic() + 5)
    finally:
        old_client.close()
    wait_for(lambda: hosted(url) == odds, "v1's experts to be dropped once its client left")
    assert info(url)["placement_version"] == 2
    new_client.close()


def test_a_bad_placement_version_is_refused(started: tuple[str, Path, Path, Callable[[], str]]) -> None:
    url = started[0]
    for bad in (-1, "1", 1.5, True):
        request = urllib.request.Request(
            f"{url}/v1/slots",
            data=json.dumps({"client_id": "c", "transport": "tcp", "placement_version": bad}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 400 and b"placement_version" in refused.value.read()


def without_server_0(layers: list[int], num_experts: int, version: int) -> Placement:
    """The placement after server 0 was drained: server 1 alone hosts everything."""
    everything = [(layer, e) for layer in layers for e in range(num_experts)]
    return Placement(layers, num_experts, [Server(1, len(everything))], {1: everything}, 1, version)


def probe(url: str, path: str) -> int:
    try:
        return get(f"{url}{path}")[0]
    except urllib.error.HTTPError as error:
        return error.code


def test_sigterm_drains_until_no_placement_names_the_server_and_no_client_holds_a_slot(
    model: tuple[Path, list[int], int], tmp_path: Path
) -> None:
    """SIGTERM, as a deleted or evicted pod gets: the server reports not ready and says by when it
    will be gone, but serves on (answers, new attaches) while a placement names it; once none does
    it still waits for the client holding a slot, and exits 0 as soon as that one lets go."""
    _, layers, num_experts = model
    with server_process(model, tmp_path, "--drain-timeout-seconds", "60") as (url, directory, process, log):
        client = ServerConnection(0, url, "tcp", "c1", 5.0, 2.0, placement_version=1)
        client.connect()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: probe(url, "/readyz") == 503, "readiness to turn false")
        assert probe(url, "/healthz") == 200
        assert info(url)["leaving_by"] is not None
        late = ServerConnection(0, url, "tcp", "c2", 5.0, 2.0, placement_version=1)
        late.connect()  # a client that read the placement naming it late still gets a slot
        late.close()
        assert client.channel is not None
        client.channel.send(layers[0], *inputs([0, 2]))
        client.channel.receive(time.monotonic() + 5)
        time.sleep(0.5)  # named by placement.json: it stays
        assert process.poll() is None
        write_atomically(directory / "placement.json", without_server_0(layers, num_experts, 2).to_json())
        time.sleep(0.5)  # no placement names it, but a client still holds a slot: it stays
        assert process.poll() is None, log()
        client.channel.send(layers[0], *inputs([0]))  # and still answers it
        client.channel.receive(time.monotonic() + 5)
        left = time.monotonic()
        client.close()
        assert process.wait(timeout=10) == 0, log()
        assert time.monotonic() - left < 3.0
        assert "no placement names this server and no client holds a slot; exiting" in log()


def test_sigterm_exits_by_the_drain_timeout_whatever_holds_it(
    model: tuple[Path, list[int], int], tmp_path: Path
) -> None:
    """Nobody drains it (no operator, a client that never lets go): it goes at its deadline."""
    with server_process(model, tmp_path, "--drain-timeout-seconds", "1") as (url, _, process, log):
        client = ServerConnection(0, url, "tcp", "c1", 5.0, 2.0, placement_version=1)
        client.connect()
        try:
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0, log()
            assert time.monotonic() - signalled >= 1.0
            assert "exiting anyway" in log()
        finally:
            client.close()


def test_a_second_sigterm_or_sigint_stops_at_once(model: tuple[Path, list[int], int], tmp_path: Path) -> None:
    with server_process(model, tmp_path, "--drain-timeout-seconds", "60") as (url, _, process, log):
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: probe(url, "/readyz") == 503, "readiness to turn false")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0, log()
