"""Child processes of the control plane: own process group, log file, reliable teardown.

Every component runs in its own session (so a signal to its process group reaches anything it
forks). Attached processes also get ``PR_SET_PDEATHSIG=SIGKILL``: if the Python process that started
them dies without running its cleanup (SIGKILL, a crash), the kernel kills them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (``ip_local_port_range``)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, from 10000-29999: below the kernel's
    ephemeral range and below Services' NodePorts (30000-32767).

    A component binds the port some time after it is chosen. A port from the ephemeral range
    (what binding port 0 gives) can meanwhile become the local end of an outgoing connection, and
    the component then fails with "address already in use". Each port is handed out once per
    process."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(10000, 30000) if p not in ephemeral and p not in _handed_out]
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # none left below: any
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group `pgid`, then SIGKILL it if it is still there after `timeout` s."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process_alive(pgid):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class ManagedProcess:
    """One control-plane component started with :meth:`start` and ended with :meth:`stop`."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    attached: bool = True  # die with the Python parent (False for `cluster-up`, which outlives it)
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.popen.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.attached else None,
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def describe_exit(self) -> str:
        """A message for a component that exited early, with the end of its log."""
        code = self.popen.returncode if self.popen is not None else None
        return f"{self.name} exited with code {code}; end of {self.log_path}:\n{tail(self.log_path)}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None:
            return
        kill_group(self.popen.pid, timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
