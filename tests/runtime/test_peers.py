"""Weights from peers: a server fetches the experts live servers hold from them (behind the data
token, checked against its own layout and the peer's digests) and reads from the checkpoint only
what no peer delivers intact; the result is the stack the checkpoint would have given."""

from __future__ import annotations

import http.server
import json
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datapath_helpers import in_process_servers

from eaas.runtime.auth import Tokens
from eaas.runtime.model import CheckpointReader, ExpertStack
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.server import ExpertServer
from eaas.runtime.server.peers import MAGIC, Offer, PeerSource, holders_in
from eaas.runtime.server.restack import load_experts, restack

FAMILY = "deepseek_v3"
TOKEN = "peer-token-0123456789"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints[FAMILY]


@pytest.fixture(scope="module")
def placement(checkpoint: Path) -> Placement:
    config = CheckpointReader(checkpoint).config
    return round_robin(config.moe_layers, config.num_experts, 3, replication=2)


@pytest.fixture(scope="module")
def servers(checkpoint: Path, placement: Placement) -> Iterator[dict[int, ExpertServer]]:
    with in_process_servers(checkpoint, placement, data_tokens=Tokens((TOKEN,))) as running:
        yield running


def source(
    servers: dict[int, ExpertServer], placement: Placement, ordinal: int = 9, **more: Any
) -> PeerSource:
    peers = PeerSource(lambda n: servers[n].url if n in servers else None, ordinal, Tokens((TOKEN,)), **more)
    peers.follow(holders_in(placement, None))
    return peers


def assert_same(stack: ExpertStack, want: ExpertStack) -> None:
    assert stack.pairs == want.pairs
    for name in ("w13", "w2", "b13", "b2"):
        mine, theirs = getattr(stack, name), getattr(want, name)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name


def test_experts_from_peers_equal_the_checkpoints(
    checkpoint: Path, placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    reader = CheckpointReader(checkpoint)
    pairs = placement.experts_of(0) + placement.experts_of(1)[:3]  # what a replacement of 0 needs, and more
    stack, from_peers = load_experts(reader, pairs, peers=source(servers, placement))
    assert from_peers == len(set(pairs))
    assert_same(stack, ExpertStack.load(reader, pairs))


def test_pairs_no_peer_holds_come_from_the_checkpoint(
    checkpoint: Path, placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    reader = CheckpointReader(checkpoint)
    peers = source(servers, placement)
    pairs = placement.experts_of(2)[:4]
    peers.holders = {pairs[0]: (0, 1, 2), pairs[1]: ()}  # the others: unknown
    stack, from_peers = load_experts(reader, pairs, peers=peers)
    assert from_peers == 1
    assert_same(stack, ExpertStack.load(reader, pairs))


def test_without_the_data_token_a_peer_gives_nothing_and_the_checkpoint_does(
    checkpoint: Path, placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    url = f"{servers[0].url}/v1/experts?pairs=" + ",".join(f"{l}:{e}" for l, e in placement.experts_of(0)[:2])
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)
    assert refused.value.code == 401
    reader = CheckpointReader(checkpoint)
    peers = source(servers, placement)
    peers.tokens = Tokens(("not-the-token",))
    pairs = placement.experts_of(0)[:3]
    fetched = peers.fetch(reader.config, pairs, torch.float32)
    assert fetched.stack is None and fetched.missing == sorted(pairs)
    assert fetched.failures and all("HTTP 401" in f for f in fetched.failures)
    assert set(fetched.given) == {servers[n].url for n in (0, 1, 2)}  # every holder was asked
    stack, from_peers = load_experts(reader, pairs, peers=peers)
    assert from_peers == 0
    assert_same(stack, ExpertStack.load(reader, pairs))


def test_a_bad_request_names_the_problem(placement: Placement, servers: dict[int, ExpertServer]) -> None:
    request = urllib.request.Request(
        f"{servers[0].url}/v1/experts?pairs=3:x", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=5)
    assert bad.value.code == 400 and "pairs" in json.loads(bad.value.read())["error"]


class Impostor:
    """A peer that answers with `body(offer_bytes)` for whatever it is asked: a corrupted copy of
    a real server's answer, a truncated one, one with another declaration."""

    def __init__(self, real: ExpertServer, mangle: Any) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = self.path.split("?", 1)[1]
                request = urllib.request.Request(
                    f"{real.url}/v1/experts?{query}", headers={"Authorization": f"Bearer {TOKEN}"}
                )
                with urllib.request.urlopen(request, timeout=10) as answer:
                    body = mangle(answer.read())
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def flip_last_data_byte(body: bytes) -> bytes:
    tensors = len(json.loads(body[16 : 16 + struct.unpack(">Q", body[8:16])[0]])["tensors"])
    at = len(body) - 32 * tensors - 1
    return body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :]


def rewrite_entries(body: bytes, field: str, value: Any) -> bytes:
    """The answer with every header entry's `field` set to `value`."""
    length = struct.unpack(">Q", body[8:16])[0]
    header = json.loads(body[16 : 16 + length])
    for entry in header["tensors"]:
        entry[field] = value
    new = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(new)) + new + body[16 + length :]


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (flip_last_data_byte, "SHA-256 of the bytes received differs"),
        (lambda body: body[: len(body) // 2], "stopped"),
        (lambda body: rewrite_entries(body, "dtype", "float16"), "float16"),
        (lambda body: rewrite_entries(body, "pair", [[1], [2]]), "malformed header"),
        (lambda body: b"NOTEXPERTS" + body[10:], "bad magic"),
    ],
    ids=["corrupted", "cut-off", "another-dtype", "garbled-pair", "not-an-answer"],
)
def test_a_peer_that_delivers_wrong_bytes_is_passed_over_for_the_next_holder(
    checkpoint: Path, placement: Placement, servers: dict[int, ExpertServer], mangle: Any, why: str
) -> None:
    reader = CheckpointReader(checkpoint)
    impostor = Impostor(servers[0], mangle)
    try:
        pairs = placement.experts_of(0)[:3]
        holders = {pair: [n for n in placement.servers_of(*pair) if n != 0] for pair in pairs}
        urls = {0: impostor.url} | {n: servers[n].url for n in (1, 2)}
        peers = PeerSource(urls.get, 9, Tokens((TOKEN,)), timeout_s=2.0)
        peers.holders = {pair: (0, *holders[pair]) for pair in pairs}  # the impostor is asked first
        stack, from_peers = load_experts(reader, pairs, peers=peers)
        assert from_peers == len(pairs)  # the next holder gave them
        assert_same(stack, ExpertStack.load(reader, pairs))
        fetched = peers.fetch(reader.config, pairs, torch.float32)
        assert any(why in failure for failure in fetched.failures), fetched.failures
        assert fetched.given[impostor.url] == 0
    finally:
        impostor.close()


def test_a_server_takes_over_experts_from_its_peers_when_the_placement_changes(
    checkpoint: Path, placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    """The re-placement after a loss: a survivor's new experts come from the other survivor."""
    reader = CheckpointReader(checkpoint)
    survivor = ExpertServer.from_placement(checkpoint, placement, 2)
    try:
        peers = source(servers, placement, ordinal=2)
        new = sorted(set(placement.experts_of(2)) | set(placement.experts_of(0)))
        stack, loaded = restack(survivor.stack, reader, new, peers)
        assert loaded == len(set(new) - set(placement.experts_of(2)))
        assert_same(stack, ExpertStack.load(reader, new))
    finally:
        survivor.stop()


def test_an_offer_leaves_out_what_the_server_does_not_host(
    placement: Placement, servers: dict[int, ExpertServer]
) -> None:
    hosted = placement.experts_of(0)
    elsewhere = next(p for p in placement.experts_of(1) if p not in hosted)
    offer = Offer.of(servers[0].stack, [hosted[0], elsewhere], "x")
    header = json.loads(offer.header)
    assert {tuple(t["pair"]) for t in header["tensors"]} == {hosted[0]}
    assert [t["name"] for t in header["tensors"]] == ["w13", "w2"]
