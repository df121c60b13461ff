"""The operator at scale on a real control plane with kwok nodes: what it costs the API server and
itself while every expert server's Lease renews.

Pieces the scale benchmark (``benchmarks/operator_scale.py``) and its e2e test share:

* :data:`AUDIT_POLICY` and :class:`AuditLog`: the API server records every request of a
  ServiceAccount (the operator runs as the chart's; nothing else here does) in its audit log,
  which says who asked what and how it was answered: requests per second, 409/429 answers,
  lists without a selector. The API server's ``apiserver_request_total`` has no client label.
* :class:`LeaseSimulator`: one heartbeat Lease per expert-server pod that kwok reports Ready,
  written as the runtime writes it (:func:`eaas.runtime.lease.lease_body`): renewed every
  interval with changing utilization and token-rate annotations, and reporting a pending
  placement loaded after a delay, which is all the operator needs of a server to commit
  (:class:`eaas.operator.expert_step.Observed`: its pod Ready, its Lease's loaded version).
  It runs on asyncio in one thread with one HTTP session, as the control plane's admin.
* :class:`ProcessSample`: a process's CPU seconds and resident memory (peak included) from
  ``/proc``.
* :func:`scale_manifest`: a MoEService of a model's shape with many one-GPU expert servers.

Pods never run (kwok plays their kubelet), so nothing here starts a runtime process, and no
Service address is routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from eaas.runtime import contract
from eaas.runtime.lease import LeaseSettings, lease_body
from eaas.runtime.placement import stored

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


def admin_ssl_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(cert), str(key))
    return context


@dataclass
class _Server:
    """One simulated expert server: its pod, its Lease as last written, the version it loaded."""

    settings: LeaseSettings
    ordinal: int
    lease: dict[str, Any] | None = None
    loaded: int = 0
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Pool:
    name: str
    service: str
    config_map_version: str = ""
    # (version, ordinals, when first seen) of the stored placements, newest last
    placements: list[tuple[int, frozenset[int], float]] = field(default_factory=list)
    servers: dict[str, _Server] = field(default_factory=dict)  # pod uid -> server


class LeaseSimulator:
    """Heartbeat Leases of the expert servers of `pools` ({ExpertPool: MoEService}) in `namespace`:
    :meth:`start`, :meth:`stop`; :meth:`add_pools` while running. Renewals, conflicts and errors
    are counted in :attr:`counts`."""

    def __init__(
        self,
        server: str,
        ssl_context: ssl.SSLContext,
        namespace: str,
        pools: Mapping[str, str] | None = None,
        interval_s: float = 2.0,
        timeout_s: float = 10.0,
        load_delay_s: float = 1.0,
        poll_s: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.server = server.rstrip("/")
        self.ssl_context = ssl_context
        self.namespace = namespace
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.load_delay_s = load_delay_s
        self.poll_s = poll_s
        self.random = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._pools: dict[str, _Pool] = {}
        self._new_pools: list[tuple[str, str]] = list((pools or {}).items())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    # -- control (any thread) --------------------------------------------------------------------
    def start(self) -> None:
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._stopping = asyncio.Event()
            started.set()
            try:
                self._loop.run_until_complete(self._main())
            except BaseException as error:  # reported by stop()
                self.error = error
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="lease-simulator", daemon=True)
        self._thread.start()
        started.wait()

    def add_pools(self, pools: Mapping[str, str]) -> None:
        with self._lock:
            self._new_pools.extend(pools.items())

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=30)
        if self.error is not None:
            raise RuntimeError(f"the Lease simulator failed: {self.error!r}") from self.error

    def servers(self) -> int:
        """How many servers' Leases are being renewed now."""
        return sum(len(p.servers) for p in list(self._pools.values()))

    # -- the loop --------------------------------------------------------------------------------
    async def _main(self) -> None:
        assert self._stopping is not None
        connector = aiohttp.TCPConnector(ssl=self.ssl_context, limit=32)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._session = session
            while not self._stopping.is_set():
                with self._lock:
                    for name, service in self._new_pools:
                        self._pools.setdefault(name, _Pool(name, service))
                    self._new_pools.clear()
                await asyncio.gather(*(self._watch_pool(pool) for pool in self._pools.values()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.poll_s)
            for pool in self._pools.values():
                for server in pool.servers.values():
                    if server.task is not None:
                        server.task.cancel()
            await asyncio.sleep(0)

    async def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self._session.request(method, f"{self.server}{path}", json=body) as response:
            data = await response.json(content_type=None)
            return response.status, data

    async def _watch_pool(self, pool: _Pool) -> None:
        """What kwok and the operator did to `pool` since the last look: its Ready pods (a server
        each) and its stored placements."""
        selector = urllib.parse.quote(f"{contract.POOL_LABEL}={pool.name}")
        status, pods = await self._request(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}"
        )
        if status != 200:
            self.counts["poll errors"] += 1
            return
        name = f"{pool.name}-placement"
        status, config_map = await self._request(
            "GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}"
        )
        if status == 200 and config_map["metadata"]["resourceVersion"] != pool.config_map_version:
            pool.config_map_version = config_map["metadata"]["resourceVersion"]
            committed, pending = stored.read_config_map(config_map)
            known = {version for version, _, _ in pool.placements}
            for placement in (committed, pending):
                if placement is not None and placement.version not in known:
                    pool.placements.append(
                        (placement.version, frozenset(placement.ordinals), time.monotonic())
                    )
            for server in pool.servers.values():
                server.wake.set()
        ready = {}
        for pod in pods.get("items") or []:
            metadata = pod["metadata"]
            conditions = (pod.get("status") or {}).get("conditions") or []
            is_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
            ordinal = metadata["name"].rsplit("-", 1)[-1]
            if is_ready and not metadata.get("deletionTimestamp") and ordinal.isdigit():
                ready[metadata["uid"]] = (metadata["name"], int(ordinal))
        for uid in set(pool.servers) - set(ready):  # the pod went: so does its process
            server = pool.servers.pop(uid)
            if server.task is not None:
                server.task.cancel()
        for uid, (pod_name, ordinal) in ready.items():
            if uid not in pool.servers:
                settings = LeaseSettings(
                    pod_name, self.namespace, pool.name, self.interval_s, self.timeout_s,
                    pod_uid=uid, service=pool.service,
                )  # fmt: skip
                server = pool.servers[uid] = _Server(settings, ordinal)
                server.task = asyncio.ensure_future(self._heartbeat(pool, server))

    def _loaded(self, pool: _Pool, server: _Server) -> int:
        """The newest placement naming the server that it has had `load_delay_s` to load."""
        now = time.monotonic()
        for version, ordinals, seen in reversed(pool.placements):
            if server.ordinal in ordinals and now - seen >= self.load_delay_s:
                return max(server.loaded, version)
        return server.loaded

    async def _heartbeat(self, pool: _Pool, server: _Server) -> None:
        await asyncio.sleep(self.random.uniform(0, self.interval_s))  # servers start apart
        while True:
            server.loaded = self._loaded(pool, server)
            await self._renew(server)
            server.wake.clear()
            deadline = time.monotonic() + self.interval_s
            while (left := deadline - time.monotonic()) > 0:
                try:  # a newly stored placement: report it loaded once the delay has passed
                    await asyncio.wait_for(server.wake.wait(), left)
                except TimeoutError:
                    break
                server.wake.clear()
                await asyncio.sleep(self.load_delay_s)
                if self._loaded(pool, server) != server.loaded:
                    break

    async def _renew(self, server: _Server) -> None:
        phase = time.time() / 60 + server.ordinal
        utilization = round(500 + 300 * math.sin(phase)) + self.random.randint(-20, 20)
        tokens = round(2000 + 1000 * math.sin(phase)) + self.random.randint(-50, 50)
        base = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        for _ in range(3):
            body = lease_body(
                server.settings, datetime.now(UTC), server.loaded, max(0, min(1000, utilization)),
                server.lease, tokens_per_second=max(0, tokens),
            )  # fmt: skip
            if server.lease is None:
                status, answer = await self._request("POST", base, body)
            else:
                status, answer = await self._request("PUT", f"{base}/{server.settings.pod_name}", body)
            if status in (200, 201):
                server.lease = answer
                self.counts["renewals"] += 1
                return
            if status == 409:  # created by an earlier pod of that name, or written since: read it
                self.counts["conflicts"] += 1
                status, answer = await self._request("GET", f"{base}/{server.settings.pod_name}")
                server.lease = answer if status == 200 else None
                continue
            self.counts[f"errors {status}"] += 1
            return


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
