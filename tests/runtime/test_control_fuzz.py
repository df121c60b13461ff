"""The expert server's control port under malformed requests: every one gets a 4xx (never a 5xx,
a hang or a crash), nothing is allocated without the data token, and the server keeps serving."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from datapath_helpers import in_process_servers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaas.runtime.auth import Tokens
from eaas.runtime.model import CheckpointReader
from eaas.runtime.placement import round_robin
from eaas.runtime.server.expert_server import ExpertServer

TOKEN = "fuzz-token-0123456789"


@pytest.fixture(scope="module")
def server(tiny_checkpoints: dict[str, Path]) -> Iterator[ExpertServer]:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1, replication=1)
    with in_process_servers(checkpoint, placement, data_tokens=Tokens((TOKEN,))) as servers:
        yield servers[0]


def send(server: ExpertServer, method: str, path: str, headers: dict[str, str], body: bytes) -> int | str:
    """The answer's status, or "reset" when the server refused before reading the whole body
    (it answers and closes; the unread body makes the kernel reset the connection)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.control.port, timeout=10)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders()
        try:
            connection.send(body)
            return connection.getresponse().status
        except (BrokenPipeError, ConnectionResetError):
            return "reset"
    finally:
        connection.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "client_id": json_values,
            "transport": st.sampled_from(["tcp", "shm", "x", ""]) | json_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
)
paths = st.sampled_from(
    [
        "/v1/slots",
        "/v1/slots/tcp/0",
        "/v1/slots/tcp/x",
        "/v1/slots/shm/99999",
        "/v1/slots/",
        "/v1/info",
        "/nope",
    ]
) | st.text(alphabet="/abcdefv1slots0123456789%?.-_", max_size=40).map(lambda p: "/" + p)
authorizations = st.sampled_from([None, f"Bearer {TOKEN}", "Bearer wrong", "Basic abc", "Bearer ", TOKEN])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]), paths, authorizations, bodies)
def test_malformed_requests_get_a_4xx_and_nothing_without_the_token(
    server: ExpertServer, method: str, path: str, authorization: str | None, body: bytes
) -> None:
    before = [row for row in server.slots() if row["state"] != "OFFLINE"]
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    status = send(server, method, path, headers, body)
    assert isinstance(status, int) and status < 500, (method, path, authorization, body[:80], status)
    if authorization != f"Bearer {TOKEN}" and path.startswith("/v1/slots"):
        assert status == 401
        assert [row for row in server.slots() if row["state"] != "OFFLINE"] == before
    for row in server.slots():  # slots a valid fuzzed request did take are given back
        if row["state"] != "OFFLINE":
            server.detach(row["transport"], row["slot"])


def test_oversized_bodies_and_headers_are_refused(server: ExpertServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    assert send(server, "POST", "/v1/slots", auth, b"{" + b" " * (1 << 20) + b"}") in (400, "reset")
    assert send(server, "POST", "/v1/slots", auth, b"{" + b" " * (70 << 10) + b"}") in (400, "reset")
    assert send(server, "GET", "/v1/info", {"X-Big": "a" * 70000}, b"") in (400, 431)
    assert send(server, "GET", "/healthz", {}, b"") == 200
