"""The expert server's control port (HTTP, stdlib): health, metrics, stats and the slot handshake.

| method | path | answer |
|---|---|---|
| GET | ``/healthz`` | 200 while the process serves (liveness) |
| GET | ``/readyz`` | 200 once experts are loaded and the loop runs, else 503 |
| GET | ``/metrics`` | Prometheus text |
| GET | ``/v1/info`` | identity, model shape, hosted (layer, expert) pairs, transports, limits |
| GET | ``/v1/stats`` | tokens per (layer, expert) since start (the placement planner's input) |
| GET | ``/v1/slots`` | attached slots and their states |
| POST | ``/v1/slots`` | ``{"client_id", "transport", "placement_version"?, "lease"?, "offer"?}`` → 201 |
| DELETE | ``/v1/slots/<transport>/<slot>[?client_id=<id>]`` | release a slot → 204 (404 if not attached) |
| GET | ``/v1/experts?pairs=L:E,...`` | the weights of the pairs it hosts, for a peer (see ``peers.py``) |

A DELETE that names ``client_id`` frees the slot only while that client holds it (404 otherwise): a
release that arrives after the client's connection broke and the slot went to another client
frees nothing. A POST answers 503 when every slot is taken, 400 when a field (or the transport's
offer) is wrong.

With data tokens configured, the three ``/v1/slots`` routes and ``/v1/experts`` need
``Authorization: Bearer <token>``: without it they answer 401 and allocate, release and reveal
nothing. The handle a granted slot
returns carries what its transport needs to use that slot only (the tcp hello's per-slot token),
so a slot id alone is worth nothing. ``offer`` is what a transport needs from the client before it
grants a slot (``nixl``: the client's agent metadata and answer area); one that cannot be used is
a 400 naming the field. ``lease`` names the client's Lease in the server's namespace:
the slot is freed when that Lease expires (:mod:`eaas.runtime.server.client_leases`). Probes,
metrics, ``/v1/info`` and ``/v1/stats`` stay open (the operator and Prometheus read them; the
NetworkPolicy decides who reaches the port).
"""

from __future__ import annotations

import re
import urllib.parse
from http import HTTPStatus
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from eaas.runtime.auth import Tokens
from eaas.runtime.httpd import BackgroundServer, HttpError, JsonHandler
from eaas.runtime.server.peers import Offer, parse_pairs

# A Kubernetes object name (DNS subdomain): what a client may give as its Lease.
LEASE_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class ControlError(HttpError):
    """An error answered as ``{"error": message}``."""


class ControlTarget(Protocol):
    """What the control port needs from the server it fronts."""

    def is_healthy(self) -> bool: ...
    def is_ready(self) -> bool: ...
    def metrics_text(self) -> bytes: ...
    def info(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def slots(self) -> list[dict[str, Any]]: ...
    def attach(
        self,
        client_id: str,
        transport: str,
        placement_version: int | None = None,
        lease: str | None = None,
        offer: dict[str, Any] | None = None,
    ) -> dict[str, Any]: ...
    def detach(self, transport: str, slot: int, client_id: str | None = None) -> bool: ...
    def experts(self, pairs: list[tuple[int, int]]) -> Offer: ...


def _handler(target: ControlTarget, tokens: Tokens) -> type[JsonHandler]:
    class Handler(JsonHandler):
        server_version = "eaas-expert-server"
        error_type = ControlError

        def _body(self) -> dict[str, Any]:
            body = self.read_json()
            if not isinstance(body, dict):
                raise ControlError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def dispatch(self, method: str, path: str) -> None:
            if (path.startswith("/v1/slots") or path == "/v1/experts") and tokens.required:
                try:
                    allowed = tokens.allows(self.headers.get("Authorization"))
                except (OSError, ValueError) as exc:  # the token file went away or is empty
                    raise ControlError(
                        HTTPStatus.SERVICE_UNAVAILABLE, f"data tokens unreadable: {exc}"
                    ) from exc
                if not allowed:
                    self.close_connection = True  # the body (if any) was not read
                    raise ControlError(
                        HTTPStatus.UNAUTHORIZED,
                        "a valid data token is required (Authorization: Bearer <token>)",
                        {"WWW-Authenticate": "Bearer"},
                    )
            if method == "GET" and path == "/healthz":
                self.send_probe(target.is_healthy(), "ok", "unhealthy")
            elif method == "GET" and path == "/readyz":
                self.send_probe(target.is_ready(), "ready", "not ready")
            elif method == "GET" and path == "/metrics":
                self.send_bytes(HTTPStatus.OK, target.metrics_text(), CONTENT_TYPE_LATEST)
            elif method == "GET" and path == "/v1/info":
                self.send_json(HTTPStatus.OK, target.info())
            elif method == "GET" and path == "/v1/stats":
                self.send_json(HTTPStatus.OK, target.stats())
            elif method == "GET" and path == "/v1/slots":
                self.send_json(HTTPStatus.OK, {"slots": target.slots()})
            elif method == "POST" and path == "/v1/slots":
                body = self._body()
                client_id, transport = body.get("client_id"), body.get("transport")
                if not isinstance(client_id, str) or not 0 < len(client_id) <= 200:
                    raise ControlError(
                        HTTPStatus.BAD_REQUEST, "client_id: a string of 1-200 characters is required"
                    )
                if not isinstance(transport, str):
                    raise ControlError(HTTPStatus.BAD_REQUEST, "transport: a transport name is required")
                version = body.get("placement_version")
                if version is not None and (type(version) is not int or not 0 <= version < 2**63):
                    raise ControlError(
                        HTTPStatus.BAD_REQUEST, "placement_version: a non-negative integer, if given"
                    )
                lease = body.get("lease")
                if lease is not None and not (isinstance(lease, str) and LEASE_NAME.fullmatch(lease)):
                    raise ControlError(
                        HTTPStatus.BAD_REQUEST,
                        "lease: the name of the client's Lease (a DNS subdomain of at most 253 characters), "
                        "if given",
                    )
                offer = body.get("offer")
                if offer is not None and not isinstance(offer, dict):
                    raise ControlError(HTTPStatus.BAD_REQUEST, "offer: a JSON object, if given")
                self.send_json(HTTPStatus.CREATED, target.attach(client_id, transport, version, lease, offer))
            elif method == "DELETE" and path.startswith("/v1/slots/"):
                parts = path.split("/")
                if len(parts) != 5 or not parts[4].isdigit():
                    raise ControlError(HTTPStatus.NOT_FOUND, "use DELETE /v1/slots/<transport>/<slot>")
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                holder = query["client_id"][0] if query.get("client_id") else None
                if not target.detach(parts[3], int(parts[4]), holder):
                    held = f" held by {holder}" if holder else ""
                    raise ControlError(HTTPStatus.NOT_FOUND, f"no attached {parts[3]} slot {parts[4]}{held}")
                self.send_bytes(HTTPStatus.NO_CONTENT, b"", "text/plain")
            elif method == "GET" and path == "/v1/experts":
                try:
                    pairs = parse_pairs(urllib.parse.urlsplit(self.path).query)
                except ValueError as exc:
                    raise ControlError(HTTPStatus.BAD_REQUEST, str(exc)) from exc
                offer = target.experts(pairs)
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(offer.length))
                self.end_headers()
                offer.write(self.wfile)
            else:
                raise ControlError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")

    return Handler


class ControlServer(BackgroundServer):
    """The HTTP control port in a daemon thread."""

    def __init__(self, target: ControlTarget, host: str, port: int, tokens: Tokens | None = None) -> None:
        super().__init__(_handler(target, tokens or Tokens()), host, port, name="eaas-control")
