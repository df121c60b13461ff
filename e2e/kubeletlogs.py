"""The kubelet's log endpoint for the process runner's nodes (:mod:`e2e.podrunner`), so that
``kubectl logs POD [-c CONTAINER] [--tail N] [-f] [--previous] [--limit-bytes N]`` works.

For ``pods/log`` the API server connects to the node's InternalIP (the pod network's gateway, shared
by the runner's nodes) on the port in ``status.daemonEndpoints.kubeletEndpoint`` and asks
``GET /containerLogs/{namespace}/{pod}/{container}?tailLines=&follow=&previous=&limitBytes=``.
One listener per node serves that node's pods from the log files the runner writes; nothing else.

Mutual TLS with the control plane's CA: the listener presents a serving certificate for the gateway
address (the API server checks it, ``--kubelet-certificate-authority``) and accepts only a client
certificate of that CA whose CN is the API server's kubelet client (``--kubelet-client-certificate``);
anything else is refused in the handshake or answered 403.

A container's log file holds every run of it; the runner notes where each run's output begins
(after its ``--- ... start #N`` line, which is the runner's, not the container's, and not served).
``previous`` is the run before the current one. Timestamps and ``sinceSeconds``/``sinceTime`` need
a time per line, which the runner does not record: they are answered 400.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

log = logging.getLogger("podrunner.logs")

FOLLOW_POLL_SECONDS = 0.2  # how often a followed log is checked for more output
HANDSHAKE_TIMEOUT_SECONDS = 10.0
CHUNK = 64 * 1024


class LogContainer(Protocol):
    """What the endpoint needs of a container of the runner (:class:`e2e.podrunner.Container`)."""

    log_path: Path
    # Per run, oldest first: (offset of the runner's start line, offset where the output begins).
    runs: list[tuple[int, int]]
    process: Any  # the running process, None between runs

    @property
    def name(self) -> str: ...


class LogPod(Protocol):
    """What the endpoint needs of a pod of the runner (:class:`e2e.podrunner.PodWorker`)."""

    pod: dict[str, Any]
    containers: list[Any]

    def is_alive(self) -> bool: ...


Lookup = Callable[[str, str, str], LogPod | None]  # (node, namespace, pod name) -> the pod


class LogError(Exception):
    """Answered as the kubelet does: an HTTP status and a one-line text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LogRequest:
    namespace: str
    pod: str
    container: str
    tail_lines: int | None = None
    follow: bool = False
    previous: bool = False
    limit_bytes: int | None = None


def _flag(query: dict[str, list[str]], name: str) -> bool:
    value = query.get(name, ["false"])[-1].lower()
    if value not in ("true", "false", "1", "0", ""):
        raise LogError(400, f"{name}: {value!r} is not a boolean (true or false)")
    return value in ("true", "1")


def _count(query: dict[str, list[str]], name: str, minimum: int) -> int | None:
    if name not in query:
        return None
    value = query[name][-1]
    try:
        number = int(value)
    except ValueError:
        raise LogError(400, f"{name}: {value!r} is not an integer") from None
    if number < minimum:
        raise LogError(400, f"{name}: must be at least {minimum}, got {number}")
    return number


def parse_request(path: str) -> LogRequest:
    """``/containerLogs/{namespace}/{pod}/{container}?...`` as a :class:`LogRequest`; LogError
    (404 for another path, 400 for a bad or unsupported parameter) otherwise."""
    url = urllib.parse.urlsplit(path)
    parts = url.path.split("/")
    if len(parts) < 4 or parts[0] != "" or parts[1] != "containerLogs":
        raise LogError(404, f"{url.path}: not found (this node serves /containerLogs/ alone)")
    if len(parts) != 5 or not all(parts[2:4]):
        raise LogError(400, f"{url.path}: expected /containerLogs/{{namespace}}/{{pod}}/{{container}}")
    namespace, pod, container = (urllib.parse.unquote(p) for p in parts[2:5])
    if not container:
        raise LogError(400, "missing container name")
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    if _flag(query, "timestamps"):
        raise LogError(400, "timestamps: the e2e process runner records no time per log line")
    for unsupported in ("sinceSeconds", "sinceTime"):
        if unsupported in query:
            raise LogError(400, f"{unsupported}: the e2e process runner records no time per log line")
    return LogRequest(
        namespace=namespace,
        pod=pod,
        container=container,
        tail_lines=_count(query, "tailLines", 0),
        follow=_flag(query, "follow"),
        previous=_flag(query, "previous"),
        limit_bytes=_count(query, "limitBytes", 1),
    )


def tail_offset(file: BinaryIO, start: int, end: int, lines: int) -> int:
    """Where the last `lines` lines of ``file[start:end]`` begin (a last line without a newline
    counts); `start` when there are no more than that."""
    if lines == 0 or end <= start:
        return end
    position = end
    newlines = 0
    file.seek(end - 1)
    if file.read(1) == b"\n":  # it ends the last line; it does not begin another one
        position -= 1
    while position > start:
        size = min(CHUNK, position - start)
        file.seek(position - size)
        block = file.read(size)
        index = len(block)
        while True:
            index = block.rfind(b"\n", 0, index)
            if index < 0:
                break
            newlines += 1
            if newlines == lines:
                return position - size + index + 1
        position -= size
    return start


class _Stop(Exception):
    """The client went away."""


def _select(found: LogPod, request: LogRequest) -> tuple[LogContainer, int]:
    """The container and the index of the run `request` asks for (LogError as the kubelet's)."""
    names = [c["name"] for c in found.pod["spec"].get("containers") or []]
    if request.container not in names:
        raise LogError(404, f'container "{request.container}" not found in pod "{request.pod}"')
    container = next((c for c in found.containers if c.name == request.container), None)
    runs = len(container.runs) if container is not None else 0
    if container is None or runs == 0:
        if request.previous:
            raise LogError(
                400, f'previous terminated container "{request.container}" in pod "{request.pod}" not found'
            )
        raise LogError(
            400,
            f'container "{request.container}" in pod "{request.pod}" is waiting to start: ContainerCreating',
        )
    if request.previous:
        if runs < 2:
            raise LogError(
                400, f'previous terminated container "{request.container}" in pod "{request.pod}" not found'
            )
        return container, runs - 2
    return container, runs - 1


def stream_log(
    found: LogPod,
    request: LogRequest,
    write: Callable[[bytes], None],
    stopping: threading.Event,
    on_ready: Callable[[], None] = lambda: None,
) -> None:
    """Write the requested run's output (tail, limit) to `write`; with ``follow`` until the run ends,
    the pod goes away or `stopping` is set. LogError (before anything is written) for a request
    that names no log. `on_ready` is called once the request is known to be answerable."""
    container, index = _select(found, request)
    process = container.process
    budget = request.limit_bytes
    with open(container.log_path, "rb") as file:

        def run_end() -> int | None:
            """Where this run's output ends, None while it may still grow."""
            runs = container.runs
            if index + 1 < len(runs):
                return runs[index + 1][0]
            if container.process is not process or process is None or process.returncode is not None:
                return file.seek(0, 2)
            if not found.is_alive() or stopping.is_set():
                return file.seek(0, 2)
            return None

        start = container.runs[index][1]
        end = run_end()
        follow = request.follow and end is None
        limit = end if end is not None else file.seek(0, 2)
        position = start
        if request.tail_lines is not None:
            position = tail_offset(file, start, limit, request.tail_lines)
        on_ready()
        while True:
            file.seek(position)
            while position < limit and (budget is None or budget > 0):
                size = min(CHUNK, limit - position, budget if budget is not None else CHUNK)
                data = file.read(size)
                if not data:
                    break
                write(data)
                position += len(data)
                if budget is not None:
                    budget -= len(data)
            if not follow or (budget is not None and budget <= 0):
                return
            end = run_end()
            if end is not None:
                if position >= end:
                    return
                limit = end
                follow = False
                continue
            time.sleep(FOLLOW_POLL_SECONDS)
            limit = file.seek(0, 2)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: NodeLogServer
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes (a followed log)

    def setup(self) -> None:
        connection = self.request
        assert isinstance(connection, ssl.SSLSocket)
        connection.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
        connection.do_handshake()  # here, not in accept(): a slow client holds up no one else
        connection.settimeout(None)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s: " + format, self.server.node, self.address_string(), *args)

    def _error(self, status: int, message: str) -> None:
        body = (message + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        connection = self.request
        assert isinstance(connection, ssl.SSLSocket)
        user = _common_name(connection.getpeercert())
        if user != self.server.client_name:
            self._error(403, f"Forbidden (user={user}, verb=get, resource=nodes, subresource=log)")
            return
        try:
            request = parse_request(self.path)
            found = self.server.lookup(self.server.node, request.namespace, request.pod)
            if found is None:
                raise LogError(404, f'pod "{request.pod}" does not exist')

            def ready() -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()

            def write(data: bytes) -> None:
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except OSError as error:
                    raise _Stop from error

            stream_log(found, request, write, self.server.stopping, ready)
        except LogError as error:
            self._error(error.status, str(error))
        except _Stop:
            pass


class NodeLogServer(http.server.ThreadingHTTPServer):
    """The log endpoint of `node` on (`address`, `port`; 0 picks a free one: see ``port``)."""

    daemon_threads = True

    def __init__(
        self,
        node: str,
        address: str,
        port: int,
        lookup: Lookup,
        tls: ssl.SSLContext,
        client_name: str,
        stopping: threading.Event,
    ) -> None:
        self.node = node
        self.lookup = lookup
        self.client_name = client_name
        self.stopping = stopping
        self.tls = tls
        super().__init__((address, port), _Handler)

    def server_bind(self) -> None:
        super().server_bind()
        self.socket = self.tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client without the right certificate fails the handshake: nothing to print a trace for.
        log.info("%s: connection from %s ended: %s", self.node, client_address, _last_error())


def _common_name(certificate: dict[str, Any] | None) -> str:
    """The subject's CN of a peer certificate as ``SSLSocket.getpeercert()`` gives it; "" when it
    has none or several."""
    subject: Any = (certificate or {}).get("subject", ())
    names = [value for rdn in subject for key, value in rdn if key == "commonName"]
    return str(names[0]) if len(names) == 1 else ""


def _last_error() -> str:
    error = sys.exc_info()[1]
    return f"{type(error).__name__}: {error}" if error is not None else "?"


def tls_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """A server context presenting `cert` that requires a client certificate signed by `ca`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cafile=ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def serve(
    nodes: list[str],
    address: str,
    lookup: Lookup,
    tls: ssl.SSLContext,
    client_name: str,
    stopping: threading.Event,
) -> dict[str, NodeLogServer]:
    """One listener per node on `address` (free ports), each served by a daemon thread."""
    servers = {}
    for node in nodes:
        server = NodeLogServer(node, address, 0, lookup, tls, client_name, stopping)
        threading.Thread(target=server.serve_forever, name=f"logs-{node}", daemon=True).start()
        servers[node] = server
    return servers


def close(servers: dict[str, NodeLogServer]) -> None:
    for server in servers.values():
        with contextlib.suppress(OSError):
            server.shutdown()
            server.server_close()
