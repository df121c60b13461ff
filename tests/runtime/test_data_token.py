"""The data token: an expert server with one refuses the slot handshake to a rogue client (no
token, a wrong one, a stolen slot id) and allocates nothing; legitimate clients are unaffected; a
token file is read again when it changes (rotation without restarts)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from datapath_helpers import PROMPTS, in_process_servers, urls

from eaas.runtime.auth import Tokens
from eaas.runtime.client import AttentionClient, ClientOptions, HandshakeError
from eaas.runtime.model import CheckpointReader, load_reference
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.server.expert_server import ExpertServer
from eaas.runtime.transport.tcp_socket import HELLO, HELLO_MAGIC

TOKEN = "tok-" + "a" * 40


@pytest.fixture(scope="module")
def placement(tiny_checkpoints: dict[str, Path]) -> Placement:
    config = CheckpointReader(tiny_checkpoints["mixtral"]).config
    return round_robin(config.moe_layers, config.num_experts, 2, replication=1)


@pytest.fixture
def servers(tiny_checkpoints: dict[str, Path], placement: Placement) -> Iterator[dict[int, ExpertServer]]:
    with in_process_servers(tiny_checkpoints["mixtral"], placement, data_tokens=Tokens((TOKEN,))) as running:
        yield running


def request(method: str, url: str, token: str | None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        call = urllib.request.Request(url, body, headers, method=method)
        with urllib.request.urlopen(call, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def attached(server: ExpertServer) -> list[dict]:  # type: ignore[type-arg]
    return [row for row in server.slots() if row["state"] != "OFFLINE"]


def test_a_rogue_client_is_refused_and_nothing_is_allocated(
    tiny_checkpoints: dict[str, Path], placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    options = ClientOptions(transport="tcp", data_tokens=Tokens((TOKEN,)))
    legit = AttentionClient(checkpoint, placement, urls(servers), options).connect()
    try:
        before = {o: attached(s) for o, s in servers.items()}
        slots_url = f"{servers[0].url}/v1/slots"
        body = b'{"client_id": "rogue", "transport": "tcp"}'
        for token in (None, "wrong", TOKEN + "x", TOKEN[:-1], ""):
            status, answer = request("POST", slots_url, token, body)
            assert status == 401 and b"data token" in answer, (token, status, answer)
        assert request("GET", slots_url, None)[0] == 401  # who is attached is not revealed either
        handle_slot = before[0][0]["slot"]
        assert request("DELETE", f"{slots_url}/tcp/{handle_slot}", "wrong")[0] == 401
        assert {o: attached(s) for o, s in servers.items()} == before, "a refused handshake allocated"

        # A stolen slot id without the slot's own token gets the connection closed, nothing else.
        with socket.create_connection(("127.0.0.1", servers[0].tcp_port), timeout=5) as sock:
            sock.sendall(HELLO.pack(HELLO_MAGIC, handle_slot, 12345))
            assert sock.recv(1) == b""
        # The open routes stay open (probes, Prometheus, the operator's view).
        for path in ("/healthz", "/readyz", "/metrics", "/v1/info", "/v1/stats"):
            assert request("GET", f"{servers[0].url}{path}", None)[0] == 200, path

        tokens, _ = legit.generate(PROMPTS[:2], 3)
        assert tokens == load_reference(checkpoint).generate(PROMPTS[:2], 3)[0]
        assert legit.experts.counters.failovers == 0
    finally:
        legit.close()


def test_a_client_without_the_token_cannot_attach(
    tiny_checkpoints: dict[str, Path], placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    options = ClientOptions(transport="tcp")
    with pytest.raises(HandshakeError, match="HTTP 401"):
        AttentionClient(tiny_checkpoints["mixtral"], placement, urls(servers), options).connect()
    assert all(not attached(s) for s in servers.values())


def test_a_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("old\n")
    tokens = Tokens(path=path)
    assert tokens.allows("Bearer old") and not tokens.allows("Bearer new")
    replacement = tmp_path / "tokens.new"
    replacement.write_text("new old")  # rotation step 1: both accepted, clients present the new one
    replacement.replace(path)  # an atomic swap, as the kubelet updates a Secret volume
    assert tokens.allows("Bearer new") and tokens.allows("Bearer old") and tokens.presented() == "new"
    replacement.write_text("new")
    replacement.replace(path)
    assert not tokens.allows("Bearer old")
    assert not tokens.allows("old") and not tokens.allows(None)  # the scheme is required
    path.write_text("")
    for _ in range(2):  # an emptied file never means "no token required"
        with pytest.raises(ValueError, match="no token"):
            tokens.accepted()
