"""The small stdlib HTTP server under the expert server's control port and the attention client's API.

A subclass of ``JsonHandler`` implements ``dispatch(method, path)``; errors it raises as
``HttpError`` (or a subclass with its own ``body()``) are answered as JSON, and any other
exception becomes a 500 without stopping the server. ``BackgroundServer`` runs a handler class
in a daemon thread.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

log = logging.getLogger("eaas.http")


class HttpError(Exception):
    """An answer other than success: a status and a message the caller can act on."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}  # sent with the answer (``Retry-After`` on a 429)

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


class ClientGone(Exception):
    """The client closed the connection before its answer was ready: nothing is sent back."""


class JsonHandler(BaseHTTPRequestHandler):
    """Routing, JSON bodies and answers; subclasses implement ``dispatch``."""

    protocol_version = "HTTP/1.1"
    max_body_bytes = 64 * 1024
    error_type: type[HttpError] = HttpError  # how this API shapes its errors

    def dispatch(self, method: str, path: str) -> None:
        raise NotImplementedError

    def body_error(self, message: str) -> HttpError:
        """The error raised for a missing, oversized or malformed request body."""
        return self.error_type(HTTPStatus.BAD_REQUEST, message)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def send_bytes(
        self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, status: HTTPStatus, data: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(data).encode() + b"\n", "application/json", headers)

    def send_event_stream(self, events: Iterator[Any]) -> None:
        """200 with server-sent events: ``data: <json>`` per item, then ``data: [DONE]``; the
        connection closes at the end. An error after the headers is an event of its own (then
        ``[DONE]``, as vLLM ends a stream). A client that goes away (found at a write, or by
        ``events`` raising ``ClientGone``) is written nothing more, and ``events`` is closed (its
        ``finally`` can cancel the work)."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            try:
                for item in events:
                    self.wfile.write(b"data: " + json.dumps(item).encode() + b"\n\n")
                    self.wfile.flush()
            except HttpError as exc:  # after the headers: the error goes into the stream
                self.wfile.write(b"data: " + json.dumps(exc.body()).encode() + b"\n\n")
            except (BrokenPipeError, ConnectionResetError, ClientGone):
                raise
            except Exception as exc:  # a bug: a 500 in the stream (the headers said 200 already)
                log.exception("a stream of %s failed", self.path)
                error = self.error_type(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc))
                self.wfile.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ClientGone) as exc:
            log.info("a streaming client went away: %s", str(exc) or type(exc).__name__)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def send_probe(self, ok: bool, ok_text: str, failed_text: str) -> None:
        """A plain-text health/readiness answer: 200 or 503."""
        status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
        self.send_bytes(status, f"{ok_text if ok else failed_text}\n".encode(), "text/plain")

    def client_gone(self) -> bool:
        """True once the client closed its end of the connection (or it broke): a long answer that
        nobody will read can stop. A client that sent more (a next request) is not gone."""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # reset, or closed here
            return True

    def read_json(self) -> Any:
        """The request's JSON body (1..max_body_bytes bytes, by ``Content-Length`` or in chunks),
        or ``body_error``."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = self._read_chunks()
        else:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 < length <= self.max_body_bytes:
                self.close_connection = True  # the body (if any) was not read
                raise self.body_error(f"body: a JSON body of 1-{self.max_body_bytes} bytes is required")
            data = self.rfile.read(length)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self.body_error(f"body: not valid JSON: {exc}") from exc

    def _read_chunks(self) -> bytes:
        """A body sent with ``Transfer-Encoding: chunked`` (what a client sends that does not know
        the length beforehand: a streamed upload, some proxies), at most ``max_body_bytes``."""
        body = bytearray()
        while True:
            line = self.rfile.readline(1024)  # the size in hex (and extensions, ignored)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                size = -1
            if size < 0 or not line.endswith(b"\n"):
                self.close_connection = True
                raise self.body_error(f"body: a chunk of a chunked body has no valid size: {line[:40]!r}")
            if size == 0:
                break
            if len(body) + size > self.max_body_bytes:
                self.close_connection = True
                raise self.body_error(f"body: a JSON body of 1-{self.max_body_bytes} bytes is required")
            chunk = self.rfile.read(size)
            if len(chunk) != size or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                self.close_connection = True
                raise self.body_error("body: a chunk of a chunked body is cut short or not ended by CRLF")
            body += chunk
        while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
            pass
        if not body:
            raise self.body_error(f"body: a JSON body of 1-{self.max_body_bytes} bytes is required")
        return bytes(body)

    def _route(self, method: str) -> None:
        try:
            self.dispatch(method, self.path.split("?", 1)[0].rstrip("/") or "/")
        except HttpError as exc:
            self.send_json(exc.status, exc.body(), exc.headers)
        except ClientGone:
            log.info("%s %s: the client went away before its answer", method, self.path)
            self.close_connection = True
        except Exception as exc:  # a handler bug answers 500; the server keeps serving
            log.exception("request %s %s failed", method, self.path)
            self.send_json(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                self.error_type(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc)).body(),
            )

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # Methods no route takes still reach dispatch, which answers 404/405 (the stdlib would say 501).
    def do_PATCH(self) -> None:
        self._route("PATCH")

    def do_OPTIONS(self) -> None:
        self._route("OPTIONS")


# Connections the kernel queues before they are accepted. The standard library's default is 5:
# a burst of clients beyond it (a load test, a router's reconnects) had connections reset or
# left waiting for SYN retransmits. The kernel caps it at net.core.somaxconn (4096 by default).
LISTEN_BACKLOG = 4096


class _Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


class BackgroundServer:
    """A ``ThreadingHTTPServer`` for ``handler`` in a daemon thread (one thread per connection)."""

    def __init__(self, handler: type[JsonHandler], host: str, port: int, name: str) -> None:
        self._http = _Server((host, port), handler)
        self.host = host
        self.port: int = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
        )

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._http.shutdown()  # blocks until serve_forever returns, so only when it runs
            self._thread.join(timeout=5)
        self._http.server_close()
