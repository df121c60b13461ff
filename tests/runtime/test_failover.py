"""Failover with real processes: SIGKILL or SIGSTOP an expert server mid-generation → the same output;
a restarted server rejoins; no live replica → ExpertUnavailable; a killed client's slot goes OFFLINE."""

from __future__ import annotations

import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datapath_helpers import (
    MAX_NEW_TOKENS,
    PROMPTS,
    drill_cluster,
    generate_concurrently,
    in_process_servers,
    urls,
)

from e2e.waiting import wait_until
from eaas.runtime.client import AttentionClient, ClientOptions, ExpertUnavailable, HandshakeError
from eaas.runtime.client.connection import http_json
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.local.session import StepHook
from eaas.runtime.model import CheckpointReader
from eaas.runtime.placement import Placement, round_robin

FAMILY = "deepseek_v3"  # dense layer + shared expert + grouped routing: the most moving parts


@pytest.fixture(scope="module")
def cluster(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with drill_cluster(tiny_checkpoints[FAMILY], tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def healthy(cluster: LocalCluster) -> LocalCluster:
    """The cluster with every server running (tests may kill some)."""
    for ordinal in cluster.servers:
        if not cluster.is_alive(ordinal):
            cluster.restart(ordinal)
    return cluster


def client_for(
    cluster: LocalCluster, transport: str, timeout_s: float = 5.0, **more: float
) -> AttentionClient:
    options = ClientOptions(
        transport=transport, request_timeout_s=timeout_s, rejoin_min_s=0.1, rejoin_max_s=0.5, **more
    )
    return AttentionClient(cluster.checkpoint, cluster.placement, cluster.urls, options).connect()


def kill_at_step(client: AttentionClient, step: int = -1, action: object = None) -> list[float]:
    """Runs ``action`` when a forward pass of `client` reaches its first MoE layer at decode step
    `step`. Returns the times each pass reached it (the list fills as the client generates)."""
    first_moe = client.config.moe_layers[0]
    times: list[float] = []

    def on_step(current: int) -> None:
        times.append(time.monotonic())
        if current == step:
            action()  # type: ignore[operator]

    client.decoder.experts = StepHook(client.experts, first_moe, on_step)
    return times


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_sigkill_mid_generation_gives_the_same_output_and_the_server_rejoins(
    healthy: LocalCluster, transport: str, reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    want_tokens, want_logits = reference_outputs[FAMILY]
    client = client_for(healthy, transport)
    told: list[tuple[int, ...]] = []  # what the client's heartbeat would say, each time it is nudged
    experts = client.experts
    experts.on_liveness = lambda: told.append(experts.failed_servers)
    try:
        kill_at_step(client, 2, lambda: healthy.kill(1))
        tokens, logits = client.generate(PROMPTS, MAX_NEW_TOKENS)
        assert tokens == want_tokens  # no request lost, no wrong answer
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert client.experts.counters.failovers == 1 and client.experts.counters.resent_entries > 0
        assert 1 not in client.experts.live_servers
        assert told == [(1,)] and experts.failed_servers == (1,)  # said at the failover itself

        # The restarted server (same ports) is re-attached by handshake and used again.
        restarted = healthy.restart(1)
        deadline = time.monotonic() + 30
        while 1 not in client.experts.live_servers:
            assert time.monotonic() < deadline, "the restarted server never rejoined"
            client.generate(PROMPTS[:1], 1)  # rejoins are applied between layers
            time.sleep(0.05)
        tokens, logits = client.generate(PROMPTS, MAX_NEW_TOKENS)
        assert tokens == want_tokens
        stats = http_json("GET", f"{restarted.url}/v1/stats")
        assert stats["instance"] == restarted.instance and stats["total_tokens"] > 0
        assert [e.kind for e in client.experts.events if e.server == 1][-1] == "rejoined"
        assert told[-1] == () and experts.failed_servers == ()
    finally:
        client.close()


@pytest.mark.slow
def test_a_hung_server_times_out_and_its_share_goes_to_replicas(
    healthy: LocalCluster, reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    # The hard bound alone (no probe before it): request_timeout_s fails the server.
    client = client_for(healthy, "shm", timeout_s=0.5, suspect_floor_s=10.0)
    try:
        kill_at_step(client, 1, lambda: healthy.kill(2, signal.SIGSTOP))
        tokens, _ = client.generate(PROMPTS, MAX_NEW_TOKENS)
        assert tokens == reference_outputs[FAMILY][0]
        assert any(e.kind == "failed" and "no response" in e.detail for e in client.experts.events)
    finally:
        healthy.kill(2, signal.SIGCONT)
        client.close()
        healthy.kill(2)  # leave no half-served slots behind; `healthy` restarts it for the next test


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_a_hung_server_fails_alone_within_two_seconds(
    healthy: LocalCluster, transport: str, reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    # Server 0 is the first the client waits on: it hangs (SIGSTOP) while the answers of servers 1
    # and 2 are already there. Only server 0 may be failed over; with R = 2 every expert keeps a
    # live replica, so no request fails. The default 30 s request timeout stays: the hang is found
    # by the liveness probe, within 2 s of the send.
    # The stall is the hung step's time less a healthy decode step's, both timed at the first MoE
    # layer: the other steps' times, which swing with whatever else the machine runs, stay out of it.
    client = client_for(healthy, transport, timeout_s=30.0)
    try:
        healthy_at = kill_at_step(client)  # nothing done: the times only
        assert client.generate(PROMPTS, MAX_NEW_TOKENS)[0] == reference_outputs[FAMILY][0]
        healthy_step_s = statistics.median(b - a for a, b in itertools.pairwise(healthy_at[1:]))
        faulted_at = kill_at_step(client, 1, lambda: healthy.kill(0, signal.SIGSTOP))
        tokens, _ = client.generate(PROMPTS, MAX_NEW_TOKENS)
        stall_s = faulted_at[2] - faulted_at[1] - healthy_step_s
        assert tokens == reference_outputs[FAMILY][0]
        failed = [(event.server, event.detail) for event in client.experts.events if event.kind == "failed"]
        assert [server for server, _ in failed] == [0], failed
        assert "liveness probe" in failed[0][1]
        print(f"{transport}: hung server failed over after a stall of {stall_s:.2f} s")
        assert stall_s < 2.0, f"the hang stalled generation for {stall_s:.2f} s (target <= 2 s)"
    finally:
        healthy.kill(0, signal.SIGCONT)
        client.close()
        healthy.kill(0)  # leave no half-served slots behind; `healthy` restarts it for the next test


def test_a_slow_server_that_answers_its_probe_is_not_failed(
    tiny_checkpoints: dict[str, Path], reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    # A batch that takes far longer than the server's usual round trip (a big prefill, a placement
    # change loading weights) is slowness, not a hang: the probe answers and the client waits.
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    with in_process_servers(checkpoint, placement) as servers:
        options = ClientOptions(transport="tcp", request_timeout_s=30.0, suspect_floor_s=0.1)
        client = AttentionClient(checkpoint, placement, urls(servers), options).connect()
        try:
            assert client.generate(PROMPTS, 2)[0] == [t[:2] for t in reference_outputs[FAMILY][0]]
            loop = servers[1].loop
            compute = loop._compute
            slowed = []

            def slow_once(jobs: list) -> None:  # type: ignore[type-arg]
                if not slowed:
                    slowed.append(True)
                    time.sleep(1.5)  # 15x the floor, far past this server's usual round trip
                compute(jobs)

            loop._compute = slow_once  # type: ignore[method-assign]
            tokens, _ = client.generate(PROMPTS, MAX_NEW_TOKENS)
            assert slowed and tokens == reference_outputs[FAMILY][0]
            assert client.experts.counters.failovers == 0, list(client.experts.events)
            assert client.experts.counters.probes >= 1
        finally:
            client.close()


def test_no_live_replica_raises_expert_unavailable_naming_layer_and_expert(
    tiny_checkpoints: dict[str, Path],
) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    with in_process_servers(checkpoint, placement) as servers:
        options = ClientOptions(transport="tcp", unavailable_wait_s=0.5)
        client = AttentionClient(checkpoint, placement, urls(servers), options).connect()
        try:
            servers[0].stop()
            servers[1].stop()
            started = time.monotonic()
            with pytest.raises(
                ExpertUnavailable, match=r"expert unavailable: \(layer \d+, expert \d+\)"
            ) as error:
                client.generate(PROMPTS, 3)
            assert sorted(error.value.replicas) == [0, 1]
            assert time.monotonic() - started >= 0.5  # the replicas were given time to rejoin
        finally:
            client.close()


def test_every_slot_freed_at_once_fails_no_request(
    tiny_checkpoints: dict[str, Path], reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    """A client that hung past its Lease finds, when it resumes, every slot freed by every server:
    no expert has a live replica, yet the servers are all there. It re-attaches and the step goes
    on with the same tokens, instead of failing with ExpertUnavailable."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=2)
    with in_process_servers(checkpoint, placement) as servers:
        options = ClientOptions(transport="tcp", lease="m-attention-x")
        with AttentionClient(checkpoint, placement, urls(servers), options) as client:
            for server in servers.values():
                assert len(server.reap_expired_leases(lambda name, _: name == "m-attention-x")) == 1
            tokens, _ = client.generate(PROMPTS, MAX_NEW_TOKENS)
            assert client.experts.counters.rejoins == 2
    assert tokens == reference_outputs["mixtral"][0]


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from eaas.runtime.client.connection import ServerConnection
    url, transport, layer, expert = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    conn = ServerConnection(0, url, transport, "doomed-client", 5.0, 2.0)
    conn.connect()
    conn.channel.send(layer, torch.randn(2, 64), torch.tensor([[expert, -1]] * 2), torch.ones(2, 2))
    conn.channel.receive(time.monotonic() + 10)
    print("slot", conn.handle["slot"], flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_a_killed_client_slot_goes_offline_and_others_keep_being_served(
    tiny_checkpoints: dict[str, Path], transport: str
) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement: Placement = round_robin(config.moe_layers, config.num_experts, 1)
    with in_process_servers(checkpoint, placement, transports=("shm", "tcp", "nixl")) as servers:
        server = servers[0]
        layer, expert = placement.experts_of(0)[0]
        args = [server.url, transport, str(layer), str(expert)]
        doomed = subprocess.Popen(
            [sys.executable, "-c", CLIENT_SCRIPT, *args], stdout=subprocess.PIPE, text=True
        )
        try:
            assert doomed.stdout is not None
            line = doomed.stdout.readline()  # bounded: the script exits (EOF) if anything fails
            assert line.startswith("slot"), line
            slot = int(line.split()[1])
            doomed.kill()
            doomed.wait(timeout=10)
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(timeout=10)
        deadline = time.monotonic() + 10
        while True:
            rows = http_json("GET", f"{server.url}/v1/slots")["slots"]
            mine = [r for r in rows if r["client_id"] == "doomed-client" and r["transport"] == transport]
            if mine and mine[0]["state"] == "OFFLINE":
                break
            assert time.monotonic() < deadline, f"slot of the killed client still {mine}"
            time.sleep(0.05)
        assert mine[0]["slot"] == slot
        # The server keeps serving others, and the released slot is reused (nixl: once no slot is
        # free that was released before it, or never used; here, the others are never used).
        [(tokens, _)] = generate_concurrently(checkpoint, placement, urls(servers), [transport], PROMPTS, 2)
        assert len(tokens) == len(PROMPTS)
        rows = http_json("GET", f"{server.url}/v1/slots")["slots"]
        reused = [r for r in rows if r["transport"] == transport and r["slot"] == slot]
        if transport == "nixl":
            assert reused and reused[0]["client_id"] == "doomed-client" and reused[0]["state"] == "OFFLINE"
        else:
            assert reused and reused[0]["client_id"] != "doomed-client"  # went to the next client
        assert json.dumps(server.info())  # still answering its control port


def test_a_server_with_another_placement_is_never_used(tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    served = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    swapped = {0: served.experts_of(1), 1: served.experts_of(0)}  # the client believes the opposite
    routed = Placement(served.layers, served.num_experts, served.servers, swapped, version=served.version + 1)
    with in_process_servers(checkpoint, served) as servers:
        client = AttentionClient(checkpoint, routed, urls(servers), ClientOptions(transport="shm"))
        with pytest.raises(HandshakeError, match=r"does not host \d+ \(layer, expert\) pair"):
            client.connect()


def test_a_server_of_another_model_revision_is_never_used(tiny_checkpoints: dict[str, Path]) -> None:
    """Blue/green: an attention client of revision r2 refuses the servers of r1 (an answer must
    come from one revision) and uses those of its own; a client without a revision uses any, and
    a server that names none (an older runtime) is taken by any client."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    with in_process_servers(checkpoint, placement, revision="r1") as servers:
        assert servers[0].info()["model"]["revision"] == "r1"
        other = AttentionClient(checkpoint, placement, urls(servers), ClientOptions("shm", revision="r2"))
        with pytest.raises(
            HandshakeError, match=r"server \d serves model revision 'r1', this client's is 'r2'"
        ):
            other.connect()
        for revision in ("r1", None):
            client = AttentionClient(
                checkpoint, placement, urls(servers), ClientOptions("shm", revision=revision)
            )
            client.connect()
            assert bool(client.experts.live.all())
            client.close()
    with in_process_servers(checkpoint, placement) as servers:
        client = AttentionClient(checkpoint, placement, urls(servers), ClientOptions("shm", revision="r2"))
        client.connect()
        client.close()


def test_swapping_placements_never_waits_on_a_handshake_with_a_hung_server(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """The decoding thread closes the old placement's channels when it swaps in a new one; the
    old placement's rejoin thread may then be inside a handshake with a hung (or vanished) server
    for its whole connect timeout. The swap must not wait for it (a drill saw a 4 s stall)."""
    import socket

    from eaas.runtime.client.remote_experts import RemoteExperts

    config = CheckpointReader(tiny_checkpoints[FAMILY]).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=2)
    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        options = ClientOptions(transport="tcp", connect_timeout_s=3.0, rejoin_min_s=0.0)
        experts = RemoteExperts(config, placement, dict.fromkeys(placement.ordinals, url), options)
        experts.connect(require_all=False)  # both dead: the rejoin thread retries at once
        assert experts.failed_servers == placement.ordinals
        time.sleep(0.3)  # the rejoin thread is inside a handshake now
        started = time.monotonic()
        slots = experts.close_channels()
        assert time.monotonic() - started < 0.5
        assert slots is not None and experts.failed_servers == ()


PAGE = b"<html>502 Bad Gateway</html>"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 61\r\n\r\n{", "127.0.0.1"),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 61\r\n\r\n{", "127.0.0.1"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE), "not JSON"),
    ],
    ids=["cut-short-200", "cut-short-404", "not-json"],
)
def test_a_control_answer_cut_short_or_not_json_is_a_handshake_error(answer: bytes, said: str) -> None:
    """A peer that dies mid-answer (headers sent, the body cut short), or something else at a dead
    server's address answering a page that is not JSON (a proxy's error page), is a
    `HandshakeError` like any other failure of the control port, not an `IncompleteRead` or a
    `ValueError` escaping it: in a client's rejoin thread, either ended the thread (the first, a CI
    run's warning), and the client would never have taken a server back."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(answer)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    with pytest.raises(HandshakeError, match=said):
        http_json("DELETE", f"http://127.0.0.1:{port}/v1/slots/tcp/1", timeout_s=2)
    thread.join(5)
    listener.close()


def _layer_inputs(config: Any, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=generator)
    weights, ids = torch.rand(tokens, config.num_experts, generator=generator).topk(config.top_k, dim=-1)
    return x, ids, weights


def _rejoined(experts: RemoteExperts, index: int) -> bool:
    experts.refresh()
    return bool(experts.live[index])


def test_a_server_that_fails_again_before_answering_backs_off_and_one_that_answered_does_not(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """A server whose control port answers but whose data path does not (its loop stuck) passes
    every rejoin handshake: re-attached each rejoin_min_s, it cost every step a full timeout. Its
    backoff now grows until it answers a request; one that served since it was attached is tried
    again soon."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=2)
    options = ClientOptions(transport="shm", rejoin_min_s=0.1, rejoin_max_s=5.0)
    with in_process_servers(checkpoint, placement) as servers:
        experts = RemoteExperts(config, placement, urls(servers), options).connect()
        try:
            index = experts.table.ordinals.index(0)

            def backoff_after_failure() -> float:
                experts._mark_dead(index, "the drill")
                return experts._retry_at[index] - time.monotonic()

            assert backoff_after_failure() <= 0.1  # it had served (connected): soon
            wait_until(lambda: _rejoined(experts, index), 10, "server 0 rejoined")
            assert backoff_after_failure() > 0.15  # attached, failed again without an answer: 0.2 s
            wait_until(lambda: _rejoined(experts, index), 10, "server 0 rejoined again")
            assert backoff_after_failure() > 0.35  # and again: 0.4 s
            wait_until(lambda: _rejoined(experts, index), 10, "server 0 rejoined a third time")
            layer = config.moe_layers[0]
            while not experts._answered[index]:  # both replicas serve: it answers some share
                experts(layer, *_layer_inputs(config, 32))
            assert backoff_after_failure() <= 0.1  # it answered since: soon again
        finally:
            experts.close()


def test_a_replica_in_a_long_backoff_is_tried_at_once_when_a_layer_has_no_other(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """A rolling restart: server 0 was down long enough for its backoff to grow, is back, and
    then server 1, the other replica of every expert, goes. The layer waits for a rejoin; server
    0 is tried at once, not when its backoff ends (ExpertUnavailable before)."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=2)
    options = ClientOptions(transport="shm", rejoin_min_s=0.1, rejoin_max_s=30.0, unavailable_wait_s=3.0)
    layer, (x, ids, weights) = config.moe_layers[0], _layer_inputs(config, 16)
    with in_process_servers(checkpoint, placement) as servers:
        experts = RemoteExperts(config, placement, urls(servers), options).connect()
        try:
            first = experts.table.ordinals.index(0)
            expected = experts(layer, x, ids, weights)
            experts._mark_dead(first, "restarting")
            with experts._lock:  # down for a while: its next attempt is far off
                experts._retry_at[first] = time.monotonic() + 30.0
            servers[1].stop()  # the next one of the rolling restart: only server 0 can serve now
            started = time.monotonic()
            assert torch.allclose(experts(layer, x, ids, weights), expected, rtol=1e-4, atol=1e-5)
            assert time.monotonic() - started < 3.0 and bool(experts.live[first])
        finally:
            experts.close()


def test_a_step_with_an_expert_no_live_server_hosts_is_not_captured(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """A replayed step cannot raise for an unserved expert: it would add nothing for it, silently.
    Capturing it is refused (the caller steps eagerly, which waits for a rejoin or raises)."""
    from eaas.runtime.client.captured import CapturedExperts

    config = CheckpointReader(tiny_checkpoints["mixtral"]).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    nowhere = {ordinal: "http://127.0.0.1:9" for ordinal in placement.ordinals}  # never connected
    experts = RemoteExperts(config, placement, nowhere, ClientOptions(transport="cuda_ipc"))
    with pytest.raises(ExpertUnavailable, match=r"layer \d+, expert \d+"):
        CapturedExperts(experts, device="cpu")


def test_a_server_hung_in_its_handshake_does_not_hold_back_the_others_rejoins(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """Server 0 is gone and its control port accepts but never answers; servers 1 and 2 only
    freed this client's slots (its Lease lapsed). Their rejoins do not wait behind server 0's
    handshake (the whole connect timeout, here 10 s): the layer is served by them at once."""
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    options = ClientOptions(
        transport="tcp", lease="m-attention-x", connect_timeout_s=10.0, unavailable_wait_s=8.0
    )
    layer, (x, ids, weights) = config.moe_layers[0], _layer_inputs(config, 16)
    with in_process_servers(checkpoint, placement, transports=("tcp",)) as servers:
        experts = RemoteExperts(config, placement, urls(servers), options).connect()
        hung = socket.socket()
        try:
            expected = experts(layer, x, ids, weights)
            port = int(servers[0].url.rsplit(":", 1)[1])
            servers[0].stop()
            hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hung.bind(("127.0.0.1", port))
            hung.listen(64)
            experts._mark_dead(experts.table.ordinals.index(0), "gone")
            hung.settimeout(10)
            held, _ = hung.accept()  # server 0's rejoin handshake is under way, and hangs
            for server in (servers[1], servers[2]):  # they free this client's slots
                assert len(server.reap_expired_leases(lambda name, _: name == "m-attention-x")) == 1
            started = time.monotonic()
            assert torch.allclose(experts(layer, x, ids, weights), expected, rtol=1e-4, atol=1e-5)
            assert time.monotonic() - started < 5.0, "the others' rejoins waited for the hung handshake"
        finally:
            experts.close()
            if "held" in locals():
                held.close()
            hung.close()
