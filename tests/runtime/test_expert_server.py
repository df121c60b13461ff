"""The expert server: control port, statistics, batching across clients and layers, bounded waits."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datapath_helpers import PROMPTS, generate_concurrently, in_process_servers, urls

from eaas.runtime.client import ClientOptions
from eaas.runtime.client.connection import ServerConnection
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.model import CheckpointReader, ExpertStack, LocalExperts, MoEConfig
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.protocol import slot_capacity_bytes
from eaas.runtime.server import ExpertServer, LoopOptions
from eaas.runtime.server import loop as loop_module
from eaas.runtime.transport import Channel, ChannelError, RemoteError, get_transport


def http(method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoints: dict[str, Path]) -> tuple[Path, Placement]:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    return checkpoint, round_robin(config.moe_layers, config.num_experts, 2, replication=1)


@pytest.fixture
def server(mixtral: tuple[Path, Placement]) -> Iterator[ExpertServer]:
    checkpoint, placement = mixtral
    with in_process_servers(checkpoint, placement, max_clients=2) as servers:
        yield servers[0]


def test_health_readiness_info_and_metrics(server: ExpertServer, mixtral: tuple[Path, Placement]) -> None:
    assert http("GET", f"{server.url}/healthz") == (200, b"ok\n")
    assert http("GET", f"{server.url}/readyz") == (200, b"ready\n")
    status, body = http("GET", f"{server.url}/v1/info")
    info = json.loads(body)
    assert status == 200 and info["ordinal"] == 0 and info["instance"] == server.instance
    assert [tuple(p) for p in info["hosted"]] == mixtral[1].experts_of(0)
    assert set(info["transports"]) == {"shm", "tcp"} and info["transports"]["tcp"]["port"] == server.tcp_port
    status, body = http("GET", f"{server.url}/metrics")
    text = body.decode()
    assert status == 200
    for name in ("eaas_expert_server_tokens_total", "eaas_expert_server_batch_tokens_bucket",
                 "eaas_expert_server_step_seconds_bucket", "eaas_expert_server_hosted_experts"):  # fmt: skip
        assert name in text
    assert "expert=" not in text and "layer=" not in text  # no per-expert series in Prometheus
    assert http("GET", f"{server.url}/nope")[0] == 404


def test_slot_handshake_errors_name_the_problem(server: ExpertServer) -> None:
    status, body = http("POST", f"{server.url}/v1/slots", {"client_id": "a", "transport": "carrier-pigeon"})
    assert status == 400 and b"transport: this server offers shm, tcp" in body
    assert http("POST", f"{server.url}/v1/slots", {"transport": "shm"})[0] == 400
    request = urllib.request.Request(f"{server.url}/v1/slots", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    assert error.value.code == 400
    first = json.loads(http("POST", f"{server.url}/v1/slots", {"client_id": "a", "transport": "shm"})[1])
    http("POST", f"{server.url}/v1/slots", {"client_id": "b", "transport": "shm"})
    status, body = http("POST", f"{server.url}/v1/slots", {"client_id": "c", "transport": "shm"})
    assert status == 503 and b"all 2 shm slots are attached" in body
    assert http("DELETE", f"{server.url}/v1/slots/shm/{first['slot']}")[0] == 204
    assert http("DELETE", f"{server.url}/v1/slots/shm/{first['slot']}")[0] == 404
    slots = json.loads(http("GET", f"{server.url}/v1/slots")[1])["slots"]
    assert {
        "transport": "shm",
        "slot": first["slot"],
        "client_id": "a",
        "state": "OFFLINE",
        "requests": 0,
    } in slots


def test_stats_count_tokens_per_layer_and_expert(
    tiny_checkpoints: dict[str, Path], mixtral: tuple[Path, Placement]
) -> None:
    checkpoint, placement = mixtral
    with in_process_servers(checkpoint, placement) as servers:
        generate_concurrently(checkpoint, placement, urls(servers), ["tcp"], PROMPTS, 3)
        stats = [json.loads(http("GET", f"{s.url}/v1/stats")[1]) for s in servers.values()]
    config = CheckpointReader(checkpoint).config
    total_entries = (sum(len(p) for p in PROMPTS) + 2 * len(PROMPTS)) * config.num_layers * config.top_k
    assert sum(s["total_tokens"] for s in stats) == total_entries
    for s in stats:
        assert s["layers"] == config.moe_layers and len(s["tokens"]) == config.num_layers
        hosted = {tuple(p) for p in placement.experts_of(s["ordinal"])}
        for row, layer in enumerate(s["layers"]):
            for expert, count in enumerate(s["tokens"][row]):
                assert count == 0 or (layer, expert) in hosted


def test_one_step_batches_requests_of_several_clients_and_layers(mixtral: tuple[Path, Placement]) -> None:
    checkpoint, _ = mixtral
    reader = CheckpointReader(checkpoint)
    config = reader.config
    everything = [(layer, e) for layer in config.moe_layers for e in range(config.num_experts)]
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    server = ExpertServer.from_placement(checkpoint, placement, 0)  # not started: we drive its loop
    reference = LocalExperts(ExpertStack.load(reader, everything))
    try:
        channels = []
        for transport in ("shm", "tcp", "shm"):
            handle = server.transports[transport].attach(f"client-{transport}")
            channels.append(get_transport(transport).channel.connect(handle, "127.0.0.1", 5.0))
        generator = torch.Generator().manual_seed(0)
        sent = []
        for index, channel in enumerate(channels):
            layer = config.moe_layers[index % len(config.moe_layers)]
            x = torch.randn(3 + index, config.hidden_size, generator=generator)
            ids = torch.stack(
                [torch.randperm(config.num_experts, generator=generator)[:2] for _ in range(3 + index)]
            )
            weights = torch.rand(3 + index, 2, generator=generator)
            channel.send(layer, x, ids, weights)
            sent.append((layer, x, ids, weights))
        answered = 0
        deadline = time.monotonic() + 10
        while answered < 3 and time.monotonic() < deadline:
            answered += server.loop.step()
        assert answered == 3
        batches = server.metrics.batches._value.get()  # type: ignore[attr-defined]
        assert batches <= 2  # the tcp frame may land a poll later; never one batch per request
        for channel, (layer, x, ids, weights) in zip(channels, sent, strict=True):
            y = channel.receive(time.monotonic() + 5)
            torch.testing.assert_close(y, reference(layer, x, ids, weights), rtol=1e-5, atol=1e-5)
            channel.close()
    finally:
        server.close()


def test_a_silent_client_delays_others_by_at_most_the_batch_wait(mixtral: tuple[Path, Placement]) -> None:
    checkpoint, placement = mixtral
    with in_process_servers(checkpoint, placement, loop=LoopOptions(batch_wait_s=0.05)) as servers:
        server = servers[0]
        layer, expert = placement.experts_of(0)[0]
        x, ids, weights = torch.randn(1, 64), torch.tensor([[expert, -1]]), torch.ones(1, 2)
        silent = ServerConnection(0, server.url, "shm", "silent", 5.0, 2.0)
        busy = ServerConnection(0, server.url, "shm", "busy", 5.0, 2.0)
        silent.connect()
        busy.connect()
        try:
            assert silent.channel is not None and busy.channel is not None
            silent.channel.send(layer, x, ids, weights)  # makes it an "active" client ...
            silent.channel.receive(time.monotonic() + 5)  # ... that then goes quiet
            latencies = []
            for _ in range(5):
                start = time.monotonic()
                busy.channel.send(layer, x, ids, weights)
                busy.channel.receive(time.monotonic() + 5)
                latencies.append(time.monotonic() - start)
            assert max(latencies) < 0.05 + 0.5
        finally:
            silent.close()
            busy.close()


def one_server_and_reference(checkpoint: Path) -> tuple[MoEConfig, Placement, LocalExperts]:
    """The model's config, a placement of every expert on one server, and every expert in-process."""
    reader = CheckpointReader(checkpoint)
    config = reader.config
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    everything = [(layer, e) for layer in config.moe_layers for e in range(config.num_experts)]
    return config, placement, LocalExperts(ExpertStack.load(reader, everything))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_requests_are_exact(mixtral: tuple[Path, Placement], transport: str) -> None:
    """300 tokens x 64 float32 = 75 KiB: tcp sends x scatter-gather and reads with a low-water mark."""
    checkpoint, _ = mixtral
    config, placement, reference = one_server_and_reference(checkpoint)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, config.hidden_size, generator=generator)
    ids = torch.stack([torch.randperm(config.num_experts, generator=generator)[:2] for _ in range(300)])
    weights = torch.rand(300, 2, generator=generator)
    with in_process_servers(checkpoint, placement, max_tokens=512) as servers:
        connection = ServerConnection(0, servers[0].url, transport, "big", 10.0, 2.0)
        connection.connect()
        try:
            assert connection.channel is not None
            for layer in config.moe_layers:
                connection.channel.send(layer, x, ids, weights)
                y = connection.channel.receive(time.monotonic() + 10)
                torch.testing.assert_close(y, reference(layer, x, ids, weights), rtol=1e-5, atol=1e-5)
        finally:
            connection.close()


@pytest.mark.parametrize("transport", ["shm", "nixl", "tcp"])
def test_a_request_gathered_into_the_channels_staging_area_is_answered_exactly(
    mixtral: tuple[Path, Placement], transport: str
) -> None:
    """``staging``: shm and nixl let x be gathered straight into the memory they send from (the
    client does so: one copy of x fewer); tcp streams x from wherever it is and offers none. A tensor
    passed in from elsewhere is still copied in, over what the area held."""
    checkpoint, _ = mixtral
    config, placement, reference = one_server_and_reference(checkpoint)
    generator = torch.Generator().manual_seed(2)
    hidden, layer = config.hidden_size, config.moe_layers[0]
    source = torch.randn(40, hidden, generator=generator)
    rows = torch.randperm(40, generator=generator)[:24]
    ids = torch.stack([torch.randperm(config.num_experts, generator=generator)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=generator)
    cpu = torch.device("cpu")
    with in_process_servers(
        checkpoint, placement, max_tokens=32, transports=("shm", "tcp", "nixl")
    ) as servers:
        connection = ServerConnection(0, servers[0].url, transport, "staged", 10.0, 2.0)
        connection.connect()
        try:
            channel = connection.channel
            assert channel is not None
            staged = channel.staging(24, hidden, torch.float32, cpu)
            if transport == "tcp":
                assert staged is None
                return
            assert staged is not None and staged.shape == (24, hidden)
            too_many = channel.capacity_bytes // (hidden * 4) + 1  # x alone over the slot's bytes
            assert channel.staging(too_many, hidden, torch.float32, cpu) is None
            assert channel.staging(24, hidden, torch.float64, cpu) is None  # not a protocol dtype
            assert channel.staging(24, hidden, torch.float32, torch.device("meta")) is None
            x = torch.index_select(source, 0, rows, out=staged)
            assert x.data_ptr() == staged.data_ptr()
            channel.send(layer, x, ids, weights)
            assert channel.staging(24, hidden, torch.float32, cpu) is None  # a request is outstanding
            y = channel.receive(time.monotonic() + 10)
            want = reference(layer, source[rows], ids, weights)
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            # x from the caller's own memory overwrites what the staging area held
            staged = channel.staging(24, hidden, torch.float32, cpu)
            assert staged is not None
            staged.fill_(7.0)
            other = torch.randn(24, hidden, generator=generator)
            channel.send(layer, other, ids, weights)
            y = channel.receive(time.monotonic() + 10)
            torch.testing.assert_close(y, reference(layer, other, ids, weights), rtol=1e-5, atol=1e-5)
        finally:
            connection.close()


@pytest.mark.parametrize("grad", [False, True], ids=["gathered in place", "x in an autograd graph"])
@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_the_client_gathers_each_share_into_the_staging_area_in_slot_sized_chunks(
    mixtral: tuple[Path, Placement], transport: str, grad: bool
) -> None:
    """RemoteExperts over a staging transport: 40 tokens through slots of 16 (three chunks, each
    gathered straight into the send memory), equal to the experts run here; x that is part of an
    autograd graph (which ``index_select(out=...)`` refuses) is copied in instead."""
    checkpoint, _ = mixtral
    config, placement, reference = one_server_and_reference(checkpoint)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, config.hidden_size, generator=generator).requires_grad_(grad)
    ids = torch.stack([torch.randperm(config.num_experts, generator=generator)[:2] for _ in range(40)])
    weights = torch.softmax(torch.randn(40, 2, generator=generator), dim=-1)
    transports = ("shm", "tcp", "nixl")
    with in_process_servers(checkpoint, placement, max_tokens=16, transports=transports) as servers:
        options = ClientOptions(transport=transport)
        with RemoteExperts(config, placement, urls(servers), options) as remote:
            for layer in config.moe_layers:
                got = remote(layer, x, ids, weights)
                want = reference(layer, x.detach(), ids, weights)
                torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
            assert remote.counters.requests == 3 * len(config.moe_layers)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_release_never_frees_a_slot_handed_to_another_client(
    server: ExpertServer, transport: str
) -> None:
    """A client whose connection broke releases its slot late (it closes locally first): by then the
    server may have handed the slot to another client. A release that names its client frees the
    slot only while that client holds it."""
    url = f"{server.url}/v1/slots"
    first = json.loads(http("POST", url, {"client_id": "old", "transport": transport})[1])
    assert http("DELETE", f"{url}/{transport}/{first['slot']}")[0] == 204  # gone (as its connection broke)
    again = json.loads(http("POST", url, {"client_id": "new", "transport": transport})[1])
    assert again["slot"] == first["slot"]  # handed on
    late = http("DELETE", f"{url}/{transport}/{first['slot']}?client_id=old")
    assert late[0] == 404 and b"held by old" in late[1]
    holders = {(r["transport"], r["slot"]): (r["client_id"], r["state"]) for r in server.slots()}
    assert holders[(transport, again["slot"])] == ("new", "IDLE")  # still the new client's
    assert http("DELETE", f"{url}/{transport}/{again['slot']}?client_id=new")[0] == 204


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_an_answer_for_a_client_that_left_never_lands_on_the_next_holders_request(
    mixtral: tuple[Path, Placement], transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the loop computes a request, its client gives up (its deadline passed) and leaves, and
    the slot goes to another client, which writes its request straight into the slot's memory. The
    answer for the client that left must not be written over that request: the next step answers
    the new client exactly."""
    checkpoint, _ = mixtral
    reader = CheckpointReader(checkpoint)
    config = reader.config
    everything = [(layer, e) for layer in config.moe_layers for e in range(config.num_experts)]
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    server = ExpertServer.from_placement(checkpoint, placement, 0, transports=(transport,), max_clients=1)
    reference = LocalExperts(ExpertStack.load(reader, everything))
    spec, slots = get_transport(transport), server.transports[transport]
    capacity = slot_capacity_bytes(server.config.max_tokens, config.top_k, config.hidden_size)

    def open_channel(client_id: str) -> Channel:
        """Connects on another thread while this one makes the server's progress (the loop does not
        run: a nixl channel's claim completes once the server took it)."""
        offer = spec.channel.offer(capacity, slots.describe()) if spec.channel.needs_offer else None
        handle = slots.attach(client_id, None if offer is None else offer.body)
        connected: list[Channel] = []
        thread = threading.Thread(
            target=lambda: connected.append(spec.channel.connect(handle, "127.0.0.1", 5.0, offer))
        )
        thread.start()
        while thread.is_alive():
            slots.wait(1e-3)
        assert connected, f"{client_id} did not connect"
        return connected[0]

    def wait_for_answer(channel: Channel, deadline_s: float, into: list[object]) -> threading.Thread:
        """Waits for the answer on a thread, as a client does (a nixl client's notices leave while
        it waits); ``into`` gets y or the error."""

        def run() -> None:
            try:
                into.append(channel.receive(time.monotonic() + deadline_s))
            except Exception as exc:
                into.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    layer = config.moe_layers[0]
    generator = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(config.num_experts, generator=generator)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=generator)
    x1, x2 = torch.randn(2, 3, config.hidden_size, generator=generator)
    first, first_got, second_got = open_channel("first"), [], []  # type: ignore[var-annotated]
    handed_over: list[threading.Thread] = []
    compute = loop_module.compute_batch

    def hand_over_then_compute(*args: Any, **kwargs: Any) -> Any:
        if not handed_over:  # (the first request's compute)
            first_waiting.join()  # its client gave up ...
            first.close()
            slots.detach(0)  # ... and released its slot: the next client gets it
            second = open_channel("second")
            second.send(layer, x2, ids, weights)
            handed_over.append(wait_for_answer(second, 20.0, second_got))
            deadline = time.monotonic() + 10  # its request is in the slot (nixl: once the notice came)
            while time.monotonic() < deadline and "REQUEST_READY" not in {
                row["state"] for row in slots.slots() if row["client_id"] == "second"
            }:
                slots.wait(0.01)
        return compute(*args, **kwargs)

    monkeypatch.setattr(loop_module, "compute_batch", hand_over_then_compute)
    watchdog = threading.Timer(30.0, server.loop.stop_event.set)  # (a step waits for a request)
    watchdog.start()
    try:
        first.send(layer, x1, ids, weights)
        first_waiting = wait_for_answer(first, 1.0, first_got)
        assert server.loop.step() == 1  # the first request: computed, its client gone
        assert server.loop.step() == 1  # the second's
        handed_over[0].join(10.0)
        assert len(first_got) == 1 and isinstance(first_got[0], ChannelError)  # (it gave up)
        assert len(second_got) == 1 and isinstance(second_got[0], torch.Tensor), second_got
        torch.testing.assert_close(second_got[0], reference(layer, x2, ids, weights), rtol=1e-5, atol=1e-5)
    finally:
        watchdog.cancel()
        server.close()


def test_a_request_that_fails_validation_unexpectedly_is_answered_and_the_slot_serves_on(
    mixtral: tuple[Path, Placement], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in checking a request (any exception, not a refusal) is answered with INTERNAL: left
    unanswered, the slot would stay busy and its client wait out its deadline."""
    checkpoint, _ = mixtral
    reader = CheckpointReader(checkpoint)
    config = reader.config
    placement = round_robin(config.moe_layers, config.num_experts, 1)
    server = ExpertServer.from_placement(checkpoint, placement, 0, transports=("shm",))
    channel = get_transport("shm").channel.connect(
        server.transports["shm"].attach("client"), "127.0.0.1", 5.0
    )
    check = loop_module.check_experts
    calls = []

    def fails_once(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return check(*args)

    monkeypatch.setattr(loop_module, "check_experts", fails_once)
    layer = config.moe_layers[0]
    x, ids, weights = torch.randn(2, config.hidden_size), torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2)
    try:
        channel.send(layer, x, ids, weights)
        assert server.loop.step() == 1
        with pytest.raises(RemoteError, match="INTERNAL: validating the request failed: a bug"):
            channel.receive(time.monotonic() + 5)
        channel.send(layer, x, ids, weights)  # the same slot, answered as usual
        assert server.loop.step() == 1
        assert channel.receive(time.monotonic() + 5).shape == x.shape
        channel.close()
    finally:
        server.close()


def test_a_new_server_runs_every_hosted_expert_before_it_serves(
    mixtral: tuple[Path, Placement], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that joins must not stall its clients' first steps with first-use costs (weights
    paged in from the memory-mapped checkpoint, kernels compiled): it runs each hosted expert once
    before it answers, and again for experts a placement change brings (before the loop adopts them)."""
    checkpoint, placement = mixtral
    seen: list[set[int]] = []
    forward = ExpertStack.forward

    def spy(
        self: ExpertStack, x: torch.Tensor, group_of: torch.Tensor, *args: object, **kw: object
    ) -> torch.Tensor:
        seen.append({int(g) for g in group_of.flatten() if g >= 0})
        return forward(self, x, group_of, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ExpertStack, "forward", spy)
    caplog.set_level("INFO", logger="eaas.server")
    server = ExpertServer.from_placement(checkpoint, placement, 0)
    assert set().union(*seen) == set(range(len(server.stack.pairs))), seen  # not started yet
    assert any("warm-up ran each of" in r.getMessage() for r in caplog.records)
    seen.clear()
    with server:
        more = sorted(set(placement.experts_of(0)) | set(placement.experts_of(1)))
        assert server.rehost(more, placement.version + 1)
        assert set().union(*seen) == set(range(len(more))), seen  # the new stack, every group
