"""``LocalCluster``: N expert-server processes on this machine, for ``eaas local``, tests and benchmarks.

    with LocalCluster(checkpoint, placement, workdir) as cluster:
        cluster.urls            # {ordinal: "http://127.0.0.1:<port>"}
        cluster.kill(1)         # SIGKILL, as a crash would
        cluster.restart(1)      # same ports, so clients rejoin by handshake

Servers bind free ports themselves (port 0) and report them in a ready file, so starting never
races for ports; a restart reuses the ports of the process it replaces. Every server watches this
process and exits when it goes away, and ``stop()`` (also on ``__exit__``) terminates, then kills,
every server and removes leftover shared memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eaas.runtime import contract
from eaas.runtime.placement import Placement
from eaas.runtime.transport.backoff import Backoff
from eaas.runtime.transport.shm_segment import remove_segments_of


class ClusterError(RuntimeError):
    """An expert server did not start or stop as asked."""


@dataclass
class ServerProcess:
    ordinal: int
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    control_port: int = 0
    tcp_port: int = 0
    instance: str = ""
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class LocalCluster:
    checkpoint: Path
    placement: Placement
    workdir: Path
    transports: tuple[str, ...] = ("shm", "tcp")
    kernel_backend: str = "torch"
    threads_per_server: int = 1
    max_tokens: int = 512
    startup_timeout_s: float = 120.0
    log_level: str = "WARNING"
    extra_args: tuple[str, ...] = ()
    data_token: str | None = None  # the slot handshake requires it (through the env, never argv)
    # Servers follow ``workdir`` as a placement directory (``placement.json`` committed,
    # ``pending.json`` being loaded), as pods follow the placement ConfigMap, instead of reading
    # ``placement.json`` once.
    follow_placement_dir: bool = False
    servers: dict[int, ServerProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.checkpoint = Path(self.checkpoint)
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.placement_path = self.workdir / "placement.json"

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        """Starts every server of the placement and waits until all are ready."""
        self.placement_path.write_text(self.placement.to_json())
        try:
            for ordinal in self.placement.ordinals:
                self._launch(ordinal)
            deadline = time.monotonic() + self.startup_timeout_s
            for server in self.servers.values():
                self._wait_ready(server, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client_threads(self) -> int | None:
        """Torch threads for an attention client in this process: the cores the servers' threads
        leave it (at least one); None when ``OMP_NUM_THREADS`` says already. A client's parallel
        op waits at a barrier for all its threads, and one whose core a server took holds it up
        for a scheduler slice (ms), so more threads than free cores only slow it down."""
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        cores = len(os.sched_getaffinity(0))
        return max(1, cores - len(self.placement.ordinals) * self.threads_per_server)

    @property
    def urls(self) -> dict[int, str]:
        return {ordinal: server.url for ordinal, server in self.servers.items()}

    def _launch(self, ordinal: int) -> None:
        """Starts server ``ordinal`` of the first placement (any free ports)."""
        self.servers[ordinal] = self._spawn(ordinal, control_port=0, tcp_port=0)

    def _spawn(self, ordinal: int, control_port: int, tcp_port: int, restarts: int = 0) -> ServerProcess:
        tag = f"server-{ordinal}" + (f".restart{restarts}" if restarts else "")
        log_path = self.workdir / f"{tag}.log"
        ready_path = self.workdir / f"{tag}.ready.json"
        ready_path.unlink(missing_ok=True)
        placement = (
            ("--placement-dir", str(self.workdir))
            if self.follow_placement_dir
            else ("--placement", str(self.placement_path))
        )
        command = [
            sys.executable, "-m", "eaas.runtime.server",
            "--checkpoint", str(self.checkpoint),
            *placement,
            "--ordinal", str(ordinal),
            "--control-port", str(control_port),
            "--tcp-port", str(tcp_port),
            "--transports", ",".join(self.transports),
            "--kernel-backend", self.kernel_backend,
            "--slot-tokens", str(self.max_tokens),
            "--threads", str(self.threads_per_server),
            "--ready-file", str(ready_path),
            "--exit-with-parent", str(os.getpid()),
            "--log-level", self.log_level,
            *self.extra_args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads_per_server)}
        env.pop(contract.ENV_DATA_TOKEN_FILE, None)
        env.pop(contract.ENV_DATA_TOKENS, None)
        if self.data_token is not None:
            env[contract.ENV_DATA_TOKENS] = self.data_token
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return ServerProcess(ordinal, process, log_path, ready_path, restarts=restarts)

    def _wait_ready(self, server: ServerProcess, deadline: float) -> None:
        backoff = Backoff(min_delay_s=0.01, max_delay_s=0.2)
        while not server.ready_path.exists():
            if server.process.poll() is not None:
                raise ClusterError(
                    f"expert server {server.ordinal} exited with code {server.process.returncode} "
                    "while starting:\n" + self.log_tail(server.ordinal)
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"expert server {server.ordinal} not ready after {self.startup_timeout_s:.0f} s:\n"
                    + self.log_tail(server.ordinal)
                )
            backoff.sleep()
        ready = json.loads(server.ready_path.read_text())
        server.control_port = int(ready["control_port"])
        server.tcp_port = int(ready.get("tcp_port") or 0)
        server.instance = str(ready["instance"])

    def kill(self, ordinal: int, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        """Sends ``sig`` to server ``ordinal`` and, for fatal signals, waits until it is gone."""
        server = self.servers[ordinal]
        if server.process.poll() is not None:
            return
        server.process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                server.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(timeout=timeout_s)
            remove_segments_of(server.pid)

    def restart(self, ordinal: int, timeout_s: float | None = None) -> ServerProcess:
        """Replaces server ``ordinal`` (killing it if it still runs) on the same ports; waits until ready."""
        old = self.servers[ordinal]
        self.kill(ordinal)
        new = self._spawn(ordinal, old.control_port, old.tcp_port, restarts=old.restarts + 1)
        self.servers[ordinal] = new
        self._wait_ready(new, time.monotonic() + (timeout_s or self.startup_timeout_s))
        return new

    def is_alive(self, ordinal: int) -> bool:
        return self.servers[ordinal].process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops every server (SIGINT, then SIGKILL after ``timeout_s``) and cleans shared memory.
        SIGINT, not SIGTERM: a server that follows a placement directory takes SIGTERM as the start
        of a drain (it serves on until no placement names it), and nothing drains a whole cluster."""
        running = [s for s in self.servers.values() if s.process.poll() is None]
        for server in running:
            server.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for server in running:
            try:
                server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(timeout=timeout_s)
        for server in self.servers.values():
            remove_segments_of(server.pid)

    def log_tail(self, ordinal: int, lines: int = 30) -> str:
        path = self.servers[ordinal].log_path
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
