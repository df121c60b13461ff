"""One attention client's link to one expert server: the HTTP handshake and the data channel."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from eaas.runtime.auth import Tokens
from eaas.runtime.client.errors import HandshakeError
from eaas.runtime.transport import Channel, ChannelError, get_transport

log = logging.getLogger("eaas.client")

# Control ports are reached directly, never through an HTTP proxy configured in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 2.0,
    token: str | None = None,
) -> Any:
    """A JSON request to a control port (with a bearer ``token`` if given); ``HandshakeError`` on
    any failure."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            text = response.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read().decode(errors="replace").strip()
        except (OSError, http.client.HTTPException) as cut:  # the peer went away mid-answer
            detail = f"(its body was cut short: {cut!r})"
        raise HandshakeError(f"{method} {url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        # HTTPException: a reply cut short (IncompleteRead) or garbled, by a peer dying mid-answer
        raise HandshakeError(f"{method} {url}: {exc!r}") from exc
    try:
        return json.loads(text) if text.strip() else None
    except ValueError as exc:  # something else answers at that address
        raise HandshakeError(f"{method} {url}: the answer is not JSON ({exc})") from None


@dataclass(frozen=True)
class Expected:
    """What a client needs from a server: its model's shape and the pairs the placement routes there."""

    hidden_size: int
    num_experts: int
    top_k: int
    pairs: frozenset[tuple[int, int]]
    revision: str | None = None  # the checkpoint's revision; None: any

    def check(self, ordinal: int, info: dict[str, Any]) -> None:
        """Raises ``HandshakeError`` unless ``info`` (the server's ``/v1/info``) satisfies this."""
        model = info.get("model", {})
        # A server that names no revision (an older runtime) is taken: it predates blue/green.
        if self.revision is not None and model.get("revision") not in (None, self.revision):
            raise HandshakeError(
                f"server {ordinal} serves model revision {model.get('revision')!r}, this client's is "
                f"{self.revision!r}: an answer must come from one revision"
            )
        for field in ("hidden_size", "num_experts", "top_k"):
            if model.get(field) != getattr(self, field):
                raise HandshakeError(
                    f"server {ordinal} serves a model with {field}={model.get(field)}, "
                    f"this client's has {getattr(self, field)}"
                )
        hosted = {(int(layer), int(expert)) for layer, expert in info.get("hosted", [])}
        missing = sorted(self.pairs - hosted)
        if missing:
            raise HandshakeError(
                f"server {ordinal} does not host {len(missing)} (layer, expert) pair(s) that this client's "
                f"placement routes to it, e.g. {missing[:3]} (server placement version "
                f"{info.get('placement_version')})"
            )


class ServerConnection:
    """Attaches to a slot of the server at ``url`` and holds the resulting channel.

    With ``expected``, every handshake first checks (``GET /v1/info``) that the server serves
    this model and hosts the pairs the placement routes to it, so a server started with another
    checkpoint or placement is never used (it counts as down and its share goes to replicas).
    """

    def __init__(
        self,
        ordinal: int,
        url: str,
        transport: str,
        client_id: str,
        request_timeout_s: float,
        connect_timeout_s: float,
        expected: Expected | None = None,
        tokens: Tokens | None = None,
        placement_version: int | None = None,
        lease: str | None = None,
    ) -> None:
        get_transport(transport)
        self.lease = lease  # named at the handshake: the server frees the slot when this Lease expires
        # The placement this client routes by: the server keeps that placement's experts while
        # a slot attached under it is open, even after a newer one is committed.
        self.placement_version = placement_version
        self.tokens = tokens or Tokens()
        self.ordinal = ordinal
        self.url = url.rstrip("/")
        self.host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
        self.transport = transport
        self.client_id = client_id
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.expected = expected
        self.channel: Channel | None = None
        self.handle: dict[str, Any] = {}

    @property
    def max_tokens(self) -> int:
        return int(self.handle["max_tokens"])

    @property
    def instance(self) -> str:
        return str(self.handle.get("instance", ""))

    def open(self) -> tuple[Channel, dict[str, Any]]:
        """Handshake and connect; returns the channel and handle without installing them."""
        info = None
        if self.expected is not None:
            info = http_json("GET", f"{self.url}/v1/info", timeout_s=self.connect_timeout_s)
            self.expected.check(self.ordinal, info)
        spec = get_transport(self.transport)
        body: dict[str, Any] = {"client_id": self.client_id, "transport": self.transport}
        if self.placement_version is not None:
            body["placement_version"] = self.placement_version
        if self.lease is not None:
            body["lease"] = self.lease
        offer = None
        if spec.channel.needs_offer:  # the server must know our memory before it grants a slot
            if info is None:
                info = http_json("GET", f"{self.url}/v1/info", timeout_s=self.connect_timeout_s)
            capacity = info.get("capacity_bytes") if isinstance(info, dict) else None
            if type(capacity) is not int or capacity < 1:
                raise HandshakeError(f"server {self.ordinal}: /v1/info gave no capacity_bytes ({capacity!r})")
            described = info.get("transports") if isinstance(info, dict) else None
            server = described.get(self.transport) if isinstance(described, dict) else None
            offer = spec.channel.offer(capacity, server if isinstance(server, dict) else None)
            body["offer"] = offer.body
        try:
            handle = http_json(
                "POST", f"{self.url}/v1/slots", body, timeout_s=self.connect_timeout_s, token=self._token()
            )
            if str(handle.get("transport")) != self.transport:
                self.release_remote(handle)
                raise HandshakeError(
                    f"server {self.ordinal}: asked for transport {self.transport}, "
                    f"granted {handle.get('transport')!r}"
                )
        except BaseException:
            if offer is not None:
                offer.close()
            raise
        try:
            channel = spec.channel.connect(handle, self.host, self.request_timeout_s, offer)
        except ChannelError:
            self.release_remote(handle)
            raise
        return channel, handle

    def install(self, channel: Channel, handle: dict[str, Any]) -> None:
        self.channel, self.handle = channel, handle

    def connect(self) -> None:
        self.install(*self.open())

    def drop(self) -> dict[str, Any]:
        """Closes the channel locally (never blocks on the server); returns the old handle."""
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.close()
        self.channel = None
        handle, self.handle = self.handle, {}
        return handle

    def probe(self, timeout_s: float) -> str | None:
        """None if the server answers ``/healthz`` with 200 within ``timeout_s``, else why not.
        Safe from any thread (it touches no channel)."""
        try:
            with _OPENER.open(f"{self.url}/healthz", timeout=timeout_s) as response:
                return None if response.status == 200 else f"/healthz answered {response.status}"
        except OSError as exc:  # refused, reset, timed out, or an HTTP error status
            return f"/healthz: {exc}"

    def release_remote(self, handle: dict[str, Any]) -> None:
        """Best-effort DELETE of a slot on the server (it also reaps slots of vanished clients)."""
        if not handle:
            return
        try:
            query = urllib.parse.urlencode({"client_id": self.client_id})
            url = f"{self.url}/v1/slots/{handle['transport']}/{handle['slot']}?{query}"
            http_json("DELETE", url, timeout_s=0.5, token=self._token())
        except HandshakeError as exc:
            log.debug("server %d: releasing slot %s failed: %s", self.ordinal, handle.get("slot"), exc)

    def close(self) -> None:
        self.release_remote(self.drop())

    def _token(self) -> str | None:
        try:
            return self.tokens.presented()
        except (OSError, ValueError) as exc:  # the token file went away or is empty
            raise HandshakeError(f"server {self.ordinal}: no data token to present: {exc}") from exc
