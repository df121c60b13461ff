"""The operator at scale on a real control plane with kwok nodes: what it costs the API server and
itself while every expert server's Lease renews.

Pieces the scale benchmark (``benchmarks/operator_scale.py``) and its e2e test share (the run
itself, control plane to measurement, is :mod:`e2e.scale_run`):

* :data:`AUDIT_POLICY` and :class:`AuditLog`: the API server records every request of a
  ServiceAccount (the operator runs as the chart's; nothing else here does) in its audit log,
  which says who asked what and how it was answered: requests per second, 409/429 answers,
  lists without a selector. The API server's ``apiserver_request_total`` has no client label.
* :class:`~e2e.lease_simulator.LeaseSimulator` (its own module): the expert servers' heartbeats.
* :class:`ProcessSample`: a process's CPU seconds and resident memory (peak included) from
  ``/proc``.
* :func:`scale_manifest`: a MoEService of a model's shape with many one-GPU expert servers.

Pods never run (kwok plays their kubelet), so nothing here starts a runtime process, and no
Service address is routed.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

# Only requests of ServiceAccounts are recorded (the operator's; the control plane's own components
# and the simulator use the admin's certificate), each once, when it completed.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def audit_args(directory: Path) -> list[str]:
    """kube-apiserver flags that write :data:`AUDIT_POLICY`'s log to ``directory/audit.log``."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = directory / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={directory / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-maxbackup=0",
    ]


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class Request:
    """One completed API request as the audit log records it."""

    at: float  # when it was received (Unix seconds)
    user: str
    verb: str  # get, list, watch, create, update, patch, delete
    resource: str
    subresource: str
    code: int
    uri: str

    @property
    def unfiltered_list(self) -> bool:
        """A list (not a watch) without a label or field selector."""
        if self.verb != "list":
            return False
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.uri).query)
        return not (query.get("labelSelector") or query.get("fieldSelector"))

    @property
    def what(self) -> str:
        """``verb resource[/subresource]``, e.g. ``patch expertpools/status``."""
        return f"{self.verb} {self.resource}" + (f"/{self.subresource}" if self.subresource else "")


def parse_audit_line(line: str) -> Request | None:
    """A :class:`Request` from one audit-log line (None for a line that is not a completed event)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if event.get("stage") != "ResponseComplete":
        return None
    ref = event.get("objectRef") or {}
    return Request(
        at=_seconds(event["requestReceivedTimestamp"]),
        user=str((event.get("user") or {}).get("username", "")),
        verb=str(event.get("verb", "")),
        resource=str(ref.get("resource", "")),
        subresource=str(ref.get("subresource", "")),
        code=int((event.get("responseStatus") or {}).get("code") or 0),
        uri=str(event.get("requestURI", "")),
    )


@dataclass
class AuditLog:
    """The requests of the audit log at `path`, read as it grows."""

    path: Path
    requests: list[Request] = field(default_factory=list)
    _offset: int = 0

    def read(self) -> list[Request]:
        """Every request logged so far (the new ones appended to :attr:`requests`)."""
        if self.path.exists():
            with open(self.path, "rb") as log:
                log.seek(self._offset)
                data = log.read()
            complete = data.rfind(b"\n") + 1  # a line being written is read next time
            self._offset += complete
            for line in data[:complete].decode("utf-8", "replace").splitlines():
                if (request := parse_audit_line(line)) is not None:
                    self.requests.append(request)
        return self.requests

    def between(self, start: float, end: float, user: str | None = None) -> list[Request]:
        return [r for r in self.read() if start <= r.at < end and (user is None or r.user == user)]


@dataclass(frozen=True)
class RequestSummary:
    """What a client asked of the API server in a window (watches apart: they are long-lived)."""

    seconds: float
    requests: int  # everything but watches
    watches: int  # watch requests that ended in the window (re-established by the client)
    by_kind: dict[str, int]  # "verb resource[/subresource]" -> count
    conflicts: int  # 409
    throttled: int  # 429
    unfiltered_lists: int
    errors: int  # other answers >= 400 but 404

    @classmethod
    def of(cls, requests: Iterable[Request], seconds: float) -> RequestSummary:
        requests = list(requests)
        calls = [r for r in requests if r.verb != "watch"]
        return cls(
            seconds=seconds,
            requests=len(calls),
            watches=len(requests) - len(calls),
            by_kind=dict(Counter(r.what for r in calls).most_common()),
            conflicts=sum(r.code == 409 for r in requests),
            throttled=sum(r.code == 429 for r in requests),
            unfiltered_lists=sum(r.unfiltered_list for r in requests),
            errors=sum(r.code >= 400 and r.code not in (404, 409, 429) for r in requests),
        )

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ProcessSample:
    """A process's CPU seconds (user + system) and resident memory (now, and its peak) at `at`."""

    at: float
    cpu_s: float
    rss_bytes: int
    peak_rss_bytes: int

    @classmethod
    def of(cls, pid: int) -> ProcessSample:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        memory = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                memory[key] = int(value.split()[0]) * 1024
        return cls(time.time(), cpu, memory.get("VmRSS", 0), memory.get("VmHWM", 0))


def value_at(points: list[tuple[float, float]], x: float) -> float:
    """The least-squares line through `points` at `x` (the single value when there is one point)."""
    if len({p[0] for p in points}) < 2:
        return points[-1][1] if points else 0.0
    n = len(points)
    mean_x, mean_y = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / sum((p[0] - mean_x) ** 2 for p in points)
    return mean_y + slope * (x - mean_x)


def scale_manifest(
    name: str,
    servers: int,
    replication: int = 2,
    layers: int = 61,
    dense_layers: int = 3,
    experts: int = 256,
    top_k: int = 8,
    family: str = "deepseek_v3",
    preset: str = "deepseek-v3",
    slots_per_server: int | None = None,
) -> dict[str, Any]:
    """A MoEService of DeepSeek-V3's shape (by default) with `servers` one-GPU expert servers at
    R = `replication`, its replicas set by the MoEService (autoscaling off) and no load-based
    rebalance (nothing serves stats on kwok's pods), small CPU and memory requests so that many
    pods fit on the fake nodes."""
    moe_layers = layers - dense_layers
    slots = slots_per_server or math.ceil(moe_layers * experts * replication * 1.05 / servers)
    return {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "MoEService",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "family": family,
                "preset": preset,
                "numLayers": layers,
                "numDenseLayers": dense_layers,
                "numExperts": experts,
                "topK": top_k,
                "checkpoint": {"hostPath": {"path": f"/var/lib/eaas/{preset}"}},
            },
            "transport": "tcp",
            "attentionPool": {
                "replicas": 1,
                "image": "ghcr.io/eaas-project/eaas:0.1.0",
                "gpusPerPod": 0,
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            },
            "expertPool": {
                "replicas": servers,
                "gpusPerPod": 1,
                "replicationFactor": replication,
                "expertSlotsPerServer": slots,
                "image": "ghcr.io/eaas-project/eaas:0.1.0",
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            },
            "heartbeat": {"intervalSeconds": 2, "timeoutSeconds": 10},
            "placement": {"policy": "cost_aware", "rebalanceIntervalSeconds": 0},
            "autoscaling": {"mode": "off"},
        },
    }
