"""The expert server's control port (HTTP, stdlib): health, metrics, stats and the slot handshake.

| method | path | answer |
|---|---|---|
| GET | ``/healthz`` | 200 while the process serves (liveness) |
| GET | ``/readyz`` | 200 once experts are loaded and the loop runs, else 503 |
| GET | ``/metrics`` | Prometheus text |
| GET | ``/v1/info`` | identity, model shape, hosted (layer, expert) pairs, transports, limits |
| GET | ``/v1/stats`` | tokens per (layer, expert) since start (the placement planner's input) |
| GET | ``/v1/slots`` | attached slots and their states |
| POST | ``/v1/slots`` | ``{"client_id", "transport"}`` → 201 with the slot's handle (503 when full) |
| DELETE | ``/v1/slots/<transport>/<slot>`` | release a slot → 204 (404 if not attached) |
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("eaas.server.control")
MAX_BODY_BYTES = 64 * 1024


class ControlError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ControlTarget(Protocol):
    """What the control port needs from the server it fronts."""

    def is_healthy(self) -> bool: ...
    def is_ready(self) -> bool: ...
    def metrics_text(self) -> bytes: ...
    def info(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def slots(self) -> list[dict[str, Any]]: ...
    def attach(self, client_id: str, transport: str) -> dict[str, Any]: ...
    def detach(self, transport: str, slot: int) -> bool: ...


def _handler(target: ControlTarget) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "eaas-expert-server"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: HTTPStatus, data: Any) -> None:
            self._send(status, json.dumps(data).encode() + b"\n", "application/json")

        def _route(self, method: str) -> None:
            try:
                self._dispatch(method, self.path.split("?", 1)[0].rstrip("/") or "/")
            except ControlError as exc:
                self._json(exc.status, {"error": exc.message})
            except Exception as exc:  # never let a handler bug kill the control thread
                log.exception("control request %s %s failed", method, self.path)
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)})

        def _dispatch(self, method: str, path: str) -> None:
            if method == "GET" and path == "/healthz":
                ok = target.is_healthy()
                self._send(
                    HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                    b"ok\n" if ok else b"unhealthy\n",
                    "text/plain",
                )
            elif method == "GET" and path == "/readyz":
                ok = target.is_ready()
                self._send(
                    HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                    b"ready\n" if ok else b"not ready\n",
                    "text/plain",
                )
            elif method == "GET" and path == "/metrics":
                self._send(HTTPStatus.OK, target.metrics_text(), CONTENT_TYPE_LATEST)
            elif method == "GET" and path == "/v1/info":
                self._json(HTTPStatus.OK, target.info())
            elif method == "GET" and path == "/v1/stats":
                self._json(HTTPStatus.OK, target.stats())
            elif method == "GET" and path == "/v1/slots":
                self._json(HTTPStatus.OK, {"slots": target.slots()})
            elif method == "POST" and path == "/v1/slots":
                body = self._body()
                client_id, transport = body.get("client_id"), body.get("transport")
                if not isinstance(client_id, str) or not 0 < len(client_id) <= 200:
                    raise ControlError(
                        HTTPStatus.BAD_REQUEST, "client_id: a string of 1-200 characters is required"
                    )
                if not isinstance(transport, str):
                    raise ControlError(HTTPStatus.BAD_REQUEST, "transport: a transport name is required")
                self._json(HTTPStatus.CREATED, target.attach(client_id, transport))
            elif method == "DELETE" and path.startswith("/v1/slots/"):
                parts = path.split("/")
                if len(parts) != 5 or not parts[4].isdigit():
                    raise ControlError(HTTPStatus.NOT_FOUND, "use DELETE /v1/slots/<transport>/<slot>")
                if not target.detach(parts[3], int(parts[4])):
                    raise ControlError(HTTPStatus.NOT_FOUND, f"no attached {parts[3]} slot {parts[4]}")
                self._send(HTTPStatus.NO_CONTENT, b"", "text/plain")
            else:
                raise ControlError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                raise ControlError(
                    HTTPStatus.BAD_REQUEST, f"a JSON body of 1-{MAX_BODY_BYTES} bytes is required"
                )
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ControlError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise ControlError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler


class ControlServer:
    """The HTTP control port in a daemon thread."""

    def __init__(self, target: ControlTarget, host: str, port: int) -> None:
        self._http = ThreadingHTTPServer((host, port), _handler(target))
        self._http.daemon_threads = True
        self.host = host
        self.port: int = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="eaas-control", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._http.shutdown()  # blocks until serve_forever returns, so only when it runs
            self._thread.join(timeout=5)
        self._http.server_close()
