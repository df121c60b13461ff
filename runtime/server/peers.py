"""Weights from peers: experts a server must host that live servers already hold are fetched
from those servers' control ports instead of read from the checkpoint.

A replacement server (or a survivor taking over a lost server's experts) needs weights that sit,
converted and stacked, in the memory of the live replicas; storage is usually the slowest path a
cluster has to them (a shared filesystem or an object store, shared by every server loading at
once). So a server fetches what the committed placement says another server holds from that
server, and reads from the checkpoint only what no live server holds, or what a peer failed to
deliver intact.

The wire (``GET /v1/experts?pairs=L:E,L:E,...`` on the control port, behind the data token like
the slot routes): ``MAGIC``, the header's length (8 bytes, big-endian), the header (JSON: the
server's ``instance`` and one entry per tensor: ``pair``, ``name``, ``dtype``, ``shape``), the
tensors' bytes in that order, then one SHA-256 digest (32 bytes) per tensor in that order. Pairs
the server does not host are left out. The receiver checks every tensor against what it would
have loaded (name, dtype and shape, from the stack it is filling), reads the bytes straight into
that stack, hashes them as they arrive, and compares the digests; a peer that declares anything
else, stops mid-transfer, or sends bytes that do not match its digests gives nothing, and its
pairs go to the next peer that holds them, then to the checkpoint.

Tensors per pair, in order: ``w13``, ``w2``, then ``b13`` and ``b2`` (experts with biases), then
``s13`` and ``s2`` (block-scaled FP8 experts' scales) — the layout :class:`ExpertStack` serves,
so a fetched expert is used as it arrives, with no conversion.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import struct
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BufferedIOBase
from typing import Any, BinaryIO

import torch

from eaas.runtime.auth import Tokens
from eaas.runtime.model import ExpertStack, MoEConfig
from eaas.runtime.model.expert_side import ExpertKey
from eaas.runtime.placement import Placement

log = logging.getLogger("eaas.server.peers")

MAGIC = b"EAASEXP1"
DIGEST_BYTES = 32
MAX_PAIRS = 4096  # per request
MAX_HEADER_BYTES = 8 << 20
CHUNK_BYTES = 8 << 20  # one read or write of a tensor's bytes


def holders_in(committed: Placement | None, pending: Placement | None) -> dict[ExpertKey, tuple[int, ...]]:
    """The servers to fetch each pair from: those the committed placement says hold it (they
    have loaded it and serve it), less any a pending placement leaves out (a lost or leaving
    server is not asked)."""
    if committed is None:
        return {}
    staying = set(pending.ordinals) if pending is not None else set(committed.ordinals)
    return {
        (layer, expert): tuple(n for n in hosts if n in staying)
        for layer, experts in committed.routing_table().items()
        for expert, hosts in enumerate(experts)
    }


class PeerError(Exception):
    """A peer that did not deliver (unreachable, refused, malformed, short, or wrong bytes)."""


def parse_pairs(query: str) -> list[ExpertKey]:
    """The ``pairs`` of a ``/v1/experts`` query (``L:E`` comma-separated); raises ``ValueError``."""
    values = urllib.parse.parse_qs(query).get("pairs", [""])
    pairs = []
    for part in ",".join(values).split(","):
        layer, sep, expert = part.strip().partition(":")
        if not sep or not layer.isdigit() or not expert.isdigit():
            raise ValueError(f"pairs: expected L:E[,L:E...] of non-negative integers, got {part!r}")
        pairs.append((int(layer), int(expert)))
    if not pairs or len(pairs) > MAX_PAIRS:
        raise ValueError(f"pairs: 1 to {MAX_PAIRS} (layer, expert) pairs, got {len(pairs)}")
    return pairs


def tensors_of(stack: ExpertStack, group: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors of group `group` of `stack`, named and in wire order."""
    named = [("w13", stack.w13), ("w2", stack.w2), ("b13", stack.b13), ("b2", stack.b2)]
    if stack.scales is not None:
        named += [("s13", stack.scales.w13), ("s2", stack.scales.w2)]
    return [(name, tensor[group]) for name, tensor in named if tensor is not None]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data


@dataclass(frozen=True)
class Offer:
    """What a server sends for a request: the header, the body's length, and the tensors."""

    header: bytes
    tensors: list[torch.Tensor]

    @classmethod
    def of(cls, stack: ExpertStack, pairs: Sequence[ExpertKey], instance: str) -> Offer:
        hosted = {pair: group for group, pair in enumerate(stack.pairs)}
        entries, tensors = [], []
        for pair in pairs:
            if pair not in hosted:
                continue
            for name, tensor in tensors_of(stack, hosted[pair]):
                entries.append(
                    {
                        "pair": list(pair),
                        "name": name,
                        "dtype": dtype_name(tensor.dtype),
                        "shape": list(tensor.shape),
                    }
                )
                tensors.append(tensor)
        header = json.dumps({"instance": instance, "tensors": entries}).encode()
        return cls(header, tensors)

    @property
    def length(self) -> int:
        data = sum(t.numel() * t.element_size() for t in self.tensors)
        return len(MAGIC) + 8 + len(self.header) + data + DIGEST_BYTES * len(self.tensors)

    def write(self, out: BinaryIO | BufferedIOBase) -> None:
        """Writes the body (a tensor on a GPU is copied to the host one at a time)."""
        out.write(MAGIC + struct.pack(">Q", len(self.header)) + self.header)
        digests = []
        for tensor in self.tensors:
            data = _bytes_of(tensor.cpu())
            digest = hashlib.sha256()
            for start in range(0, len(data), CHUNK_BYTES):
                chunk = data[start : start + CHUNK_BYTES]
                digest.update(chunk)
                out.write(chunk)
            digests.append(digest.digest())
        out.write(b"".join(digests))


@dataclass
class Fetched:
    """What peers delivered: a stack of the pairs they held (None: none), the pairs left for the
    checkpoint, and per peer URL the pairs it gave."""

    stack: ExpertStack | None
    missing: list[ExpertKey]
    given: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class PeerSource:
    """Where a server fetches experts from: the servers of the committed placement (`url_of` an
    ordinal, None where unknown), asking with the first of `tokens`."""

    url_of: Callable[[int], str | None]
    ordinal: int  # this server (never asked)
    tokens: Tokens = field(default_factory=Tokens)
    timeout_s: float = 5.0  # connecting, and between two reads (then the next holder is asked)
    parallel: int = 8  # peers fetched from at once
    holders: Mapping[ExpertKey, tuple[int, ...]] = field(default_factory=dict)

    def follow(self, servers_of: Mapping[ExpertKey, Sequence[int]]) -> None:
        """The servers that hold each pair now (from the committed placement)."""
        self.holders = {
            pair: tuple(n for n in hosts if n != self.ordinal) for pair, hosts in servers_of.items()
        }

    def fetch(
        self,
        config: MoEConfig,
        pairs: Sequence[ExpertKey],
        dtype: torch.dtype,
        fp8_block: tuple[int, int] | None = None,
    ) -> Fetched:
        """Fetches `pairs` from the peers that hold them, into a stack of `dtype` (FP8 weights
        with their scales when `fp8_block` is given), as :meth:`ExpertStack.load` would have
        loaded them. Each pair goes to its holders in turn, spread so that peers share the work
        (up to :attr:`parallel` peers at once); the bytes land in the stack as they arrive."""
        started = time.perf_counter()
        wanted = sorted(set(pairs))
        tries: dict[ExpertKey, list[str]] = {}
        for index, pair in enumerate(wanted):
            urls = [u for n in self.holders.get(pair, ()) if (u := self.url_of(n))]
            if urls:
                shift = index % len(urls)
                tries[pair] = urls[shift:] + urls[:shift]
        held = sorted(tries)
        stack = ExpertStack.empty(config, len(held), dtype, held, fp8_block)
        group_of = {pair: group for group, pair in enumerate(held)}
        got: set[ExpertKey] = set()
        result = Fetched(None, [])
        while tries:
            by_peer: dict[str, list[ExpertKey]] = {}
            for pair, urls in tries.items():
                by_peer.setdefault(urls[0], []).append(pair)
            # One connection per peer, all at once: each fills its own groups of the stack.
            with ThreadPoolExecutor(max_workers=min(self.parallel, len(by_peer))) as pool:
                answers = dict(
                    zip(
                        by_peer,
                        pool.map(lambda item: self._try(item[0], stack, group_of, item[1]), by_peer.items()),
                        strict=True,
                    )
                )
            for url, asked in by_peer.items():
                delivered, failure = answers[url]
                if failure:
                    result.failures.append(f"{url}: {failure}")
                    log.warning("fetching %d experts from peer %s failed: %s", len(asked), url, failure)
                got |= delivered
                result.given[url] = result.given.get(url, 0) + len(delivered)
                for pair in asked:
                    if pair in delivered:
                        del tries[pair]
                    else:
                        tries[pair] = tries[pair][1:]
                        if not tries[pair]:
                            del tries[pair]
        result.missing = [p for p in wanted if p not in got]
        if got == set(held):
            result.stack = stack if held else None
        elif got:  # some peers failed: keep what the others gave
            kept = sorted(got)
            result.stack = ExpertStack.gather(
                config, kept, [(stack, group_of[p]) for p in kept], stack.w13.device
            )
        result.seconds = time.perf_counter() - started
        return result

    def _try(
        self, url: str, stack: ExpertStack, group_of: Mapping[ExpertKey, int], pairs: list[ExpertKey]
    ) -> tuple[set[ExpertKey], str]:
        try:
            return self._fetch_one(url, stack, group_of, pairs), ""
        except PeerError as error:
            return set(), str(error)

    def _fetch_one(
        self, url: str, stack: ExpertStack, group_of: Mapping[ExpertKey, int], pairs: list[ExpertKey]
    ) -> set[ExpertKey]:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise PeerError(f"not an http URL: {url!r}")
        query = urllib.parse.urlencode({"pairs": ",".join(f"{layer}:{e}" for layer, e in pairs)})
        headers = {}
        try:
            token = self.tokens.presented()
        except (OSError, ValueError) as error:
            raise PeerError(f"no data token to present: {error}") from error
        if token:
            headers["Authorization"] = f"Bearer {token}"
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.timeout_s)
        try:
            connection.request("GET", f"/v1/experts?{query}", headers=headers)
            response = connection.getresponse()
            if response.status != 200:
                text = response.read(2048).decode(errors="replace")
                raise PeerError(f"HTTP {response.status}: {text.strip()}")
            return _receive(response, stack, group_of, set(pairs))
        except (OSError, http.client.HTTPException) as error:
            raise PeerError(f"{type(error).__name__}: {error}") from error
        finally:
            connection.close()


def _read_exactly(source: BinaryIO, into: memoryview, digest: Any) -> None:
    """Fills `into` from `source`, hashing the bytes as they arrive."""
    filled = 0
    while filled < len(into):
        piece = into[filled : filled + CHUNK_BYTES]
        n = source.readinto(piece)  # type: ignore[attr-defined]
        if not n:
            raise PeerError(f"the peer stopped after {filled} of {len(into)} bytes of a tensor")
        digest.update(piece[:n])
        filled += n


def _receive(
    source: BinaryIO, stack: ExpertStack, group_of: Mapping[ExpertKey, int], asked: set[ExpertKey]
) -> set[ExpertKey]:
    """Reads one answer into `stack` (the group of each pair): every tensor checked against what
    the stack holds there (name, dtype, shape) and against the peer's digest. Returns the pairs
    delivered; raises ``PeerError`` (and nothing of the answer counts) otherwise."""
    prefix = source.read(len(MAGIC) + 8)
    if len(prefix) != len(MAGIC) + 8 or not prefix.startswith(MAGIC):
        raise PeerError("not an experts answer (bad magic)")
    (length,) = struct.unpack(">Q", prefix[len(MAGIC) :])
    if length > MAX_HEADER_BYTES:
        raise PeerError(f"header of {length} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(source.read(length))
        entries = [
            (
                (int(e["pair"][0]), int(e["pair"][1])),
                str(e["name"]),
                str(e["dtype"]),
                [int(x) for x in e["shape"]],
            )
            for e in header["tensors"]
        ]
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise PeerError(f"malformed header: {error}") from error
    expected = [name for name, _ in tensors_of(stack, 0)] if len(stack.pairs) else []
    targets: list[torch.Tensor] = []  # where each entry's bytes go, in the answer's order
    names: dict[ExpertKey, list[str]] = {}
    for pair, name, dtype, shape in entries:
        if pair not in asked:
            raise PeerError(f"sent (layer, expert) {pair}, which was not asked for")
        target = dict(tensors_of(stack, group_of[pair])).get(name)
        if target is None:
            raise PeerError(f"{pair}: unknown tensor {name!r}")
        if (dtype, shape) != (dtype_name(target.dtype), list(target.shape)):
            raise PeerError(
                f"{pair} {name}: {dtype} {shape}, expected {dtype_name(target.dtype)} {list(target.shape)}"
            )
        targets.append(target)
        names.setdefault(pair, []).append(name)
    for pair, named in names.items():
        if named != expected:
            raise PeerError(f"{pair}: tensors {named}, expected {expected}")
    digests = []
    for target in targets:
        digest = hashlib.sha256()
        _read_exactly(source, _bytes_of(target), digest)
        digests.append(digest.digest())
    declared = source.read(DIGEST_BYTES * len(entries))
    if len(declared) != DIGEST_BYTES * len(entries):
        raise PeerError("the peer stopped before its digests")
    for index, (pair, name, _, _) in enumerate(entries):
        if declared[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES] != digests[index]:
            raise PeerError(f"{pair} {name}: SHA-256 of the bytes received differs from the peer's")
    return set(names)
