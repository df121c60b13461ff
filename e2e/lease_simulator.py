"""Expert servers' heartbeats without the servers: :class:`LeaseSimulator` keeps one Lease per
expert-server pod that kwok reports Ready, written as the runtime writes it
(:func:`eaas.runtime.lease.lease_body`), renewed every interval with changing utilization and
token-rate annotations, and reporting a stored placement loaded after a delay: all the operator
needs of a server to commit (:class:`eaas.operator.expert_step.Observed`: its pod Ready, its
Lease's loaded version). It runs on asyncio in one thread with one HTTP session, as the control
plane's admin (:mod:`e2e.scale` measures the operator against it)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from eaas.runtime import contract
from eaas.runtime.lease import LeaseSettings, lease_body
from eaas.runtime.placement import stored


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
