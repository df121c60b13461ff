# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
"""What the whole-system drills share: a streaming load generator through the AttentionPool's
Service, the reference answers, a view of the deployed MoEService (:class:`System`), a watch on
the replication invariant (:class:`ReplicaWatch`), :func:`deploy`, which applies the tiny
MoEService on the process nodes and waits until it serves, and the drills more than one module
runs on its own deployment: drill 1's completions (:func:`completions_equal_reference`), drill 2
(:func:`sigkill_drill`) and drill 3 (:func:`sigstop_drill`), both through :func:`drill`."""

from __future__ import annotations

import contextlib
import copy
import http.client
import itertools
import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from kubernetes import client, watch

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane
from e2e.operator.harness import OperatorProcess, stored_placements
from e2e.operator.system.conftest import pod_logs
from e2e.operator.test_operator_lifecycle import (
    ATTENTION,
    GROUP,
    NAME,
    POOL,
    VERSION,
    apply_tiny,
    tiny_gpu_manifest,
)
from e2e.waiting import wait_until
from eaas.runtime.model import load_reference, load_tokenizer
from eaas.runtime.placement import Placement
from eaas.runtime.server.daemon import DaemonLoop

API_KEY = "sk-e2e"
PROMPTS = ["experts as a service", "the pool scales", "one GPU at a time", "no request is lost"]
SKEWED = "aaaaaaaaaaaaaaaa"  # asked over and over (drill 7): its tokens keep to a few experts
MAX_TOKENS = 24
REPLICATION = 2


@dataclass
class Outcome:
    prompt: str
    text: str = ""
    error: str = ""
    started: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    done: bool = False
    finished: bool = False  # the stream's [DONE] arrived
    done_at: float = 0.0
    connected: float = 0.0  # when the TCP connection to the Service was established (monotonic)
    revisions: set[str | None] = field(default_factory=set)  # the system_fingerprint of every chunk


class Load:
    """Streaming completions through the Service from `workers` threads until stopped (bounded:
    at most `limit` requests and `max_seconds`)."""

    def __init__(
        self,
        url: str,
        model: str,
        workers: int = 2,
        limit: int = 400,
        max_seconds: float = 240,
        prompts: tuple[str, ...] = tuple(PROMPTS),
        timeout: float = 60,
    ):
        self.url, self.model, self.workers, self.limit = url, model, workers, limit
        self.prompts, self.timeout = prompts, timeout
        self.deadline = time.monotonic() + max_seconds
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(workers)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def _loop(self, worker: int) -> None:
        turn = worker
        while not self.stopping.is_set() and time.monotonic() < self.deadline:
            with self.lock:
                if len(self.outcomes) >= self.limit:
                    return
                outcome = Outcome(self.prompts[turn % len(self.prompts)])
                self.outcomes.append(outcome)
            turn += self.workers
            stream_completion(self.url, self.model, outcome, self.timeout)

    def stop_new(self) -> None:
        """Start no more requests; the ones in flight go on."""
        self.stopping.set()

    def completed_since(self, moment: float) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o.started >= moment and o.done and not o.error)

    def summary(self, moment: float) -> str:
        """What became of the requests started since `moment` (a failed wait names it)."""
        now = time.monotonic()
        with self.lock:
            since = [o for o in self.outcomes if o.started >= moment or not o.done]
            rows = [
                f"{o.prompt!r} started {o.started - moment:+.1f} s, {len(o.chunk_times)} chunks, "
                + (
                    f"failed: {o.error}"
                    if o.error
                    else "done"
                    if o.done
                    else f"in flight {now - o.started:.1f} s"
                )
                for o in since
            ]
        return f"{len(rows)} requests: " + "; ".join(rows)

    def all_done(self) -> bool:
        with self.lock:
            return all(o.done for o in self.outcomes)


def stream_completion(url: str, model: str, outcome: Outcome, timeout: float = 60) -> Outcome:
    """One streamed completion of `outcome.prompt`, recorded in `outcome` (returned); `timeout`
    bounds each wait on the socket (connecting, and every chunk)."""
    body = {
        "model": model,
        "prompt": outcome.prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    parts = urllib.parse.urlsplit(url)
    outcome.started = time.monotonic()
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        connection.connect()  # timed on its own: a SYN dropped on the way costs a 1 s retransmission
        outcome.connected = time.monotonic()
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        response = connection.getresponse()
        if response.status != 200:
            raise urllib.error.HTTPError(url, response.status, response.reason, response.headers, response)
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                outcome.finished = True
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                outcome.error = json.dumps(chunk["error"])
                return outcome
            outcome.chunk_times.append(time.monotonic())
            outcome.text += chunk["choices"][0].get("text", "")
            outcome.revisions.add(chunk.get("system_fingerprint"))
    except urllib.error.HTTPError as error:
        outcome.error = f"HTTP {error.code}: {error.read()[:500]!r}"
    except Exception as error:
        outcome.error = f"{type(error).__name__}: {error}"
    else:
        if not outcome.finished:
            outcome.error = "the stream ended without data: [DONE]"
    finally:
        connection.close()
        outcome.done_at = time.monotonic()
        outcome.done = True
    return outcome


def longest_gap(outcomes: list[Outcome], start: float, end: float) -> float:
    """The longest wait for the next chunk of any request, over waits that end in [start, end]."""
    return _longest_gap(outcomes, start, end)[0]


def _longest_gap(
    outcomes: list[Outcome], start: float, end: float
) -> tuple[float, float, int, Outcome | None]:
    """(the longest wait, when it ended, which chunk it waited for: 0 = the first, its request)."""
    worst, when, chunk, which = 0.0, 0.0, -1, None
    for outcome in outcomes:
        times = [outcome.started, *outcome.chunk_times]
        for index, (before, after) in enumerate(itertools.pairwise(times)):
            if start <= after <= end and after - before > worst:
                worst, when, chunk, which = after - before, after, index, outcome
    return worst, when, chunk, which


# How long after a crash its own effect on the clients lasts: a dead server's connection fails at
# once and they fail over to its replicas within a step; a hung one is timed out in ~1 s. A wait
# that overlaps [strike, strike + CRASH_WINDOW_S] is the crash's; later waits are the recovery's.
CRASH_WINDOW_S = 1.5
# Bounds on the longest wait, over the machine's own (the longest in the seconds before the strike):
# the crash's (the target), and the whole drill's, which also holds the replacement starting on
# these two cores (an interpreter and torch, while the control plane handles the pod's status; on
# a cluster it starts on another GPU's host): docs/benchmarks.md records both.
CRASH_STALL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5  # the drills' Leases (renewed every second)
RECOVERY_STALL_S = 2.0
# A wait that overlapped a pod's start (a new pod, or a container restarted after a crash, until
# it is Ready) shares these two cores with an interpreter importing torch and loading its model,
# seconds of CPU that on a cluster are another host's: such waits are held to START_STALL_S (the
# fresh-clone CI runs of 2026-11-27 read 2.5-3.6 s there on a slower machine), every other wait of
# the drill to RECOVERY_STALL_S. Both stay under the drills' Lease timeout: a client that waited
# for a Lease to expire instead of failing over would still fail them.
START_STALL_S = 4.0


def crash_stall(outcomes: list[Outcome], struck: float, window: float = CRASH_WINDOW_S) -> float:
    """The longest wait for a chunk that overlapped [struck, struck + window]."""
    worst = 0.0
    for outcome in outcomes:
        times = [outcome.started, *outcome.chunk_times]
        for before, after in itertools.pairwise(times):
            if before <= struck + window and after >= struck:
                worst = max(worst, after - before)
    return worst


class ResumingWatch(DaemonLoop):
    """A watch on a list of objects, resumed from the last resourceVersion it saw (across an API
    server outage), listed again when that has been compacted away (410). Subclasses say how to
    list (:meth:`_relist`, returning the list's resourceVersion), what to watch (:meth:`_stream`)
    and what an event means (:meth:`_event`)."""

    _since: str | None = None  # where the watch resumes; None: list again first

    def _relist(self) -> str:
        raise NotImplementedError

    def _stream(self, since: str) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _event(self, kind: str, obj: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        since = self._since
        while not self._stop.is_set():
            try:
                if since is None:
                    since = self._relist()
                for event in self._stream(since):
                    if event["type"] == "ERROR":  # an expired resourceVersion delivered as an event
                        since = None
                        break
                    since = event["object"].metadata.resource_version
                    self._event(event["type"], event["object"])
                    if self._stop.is_set():
                        break
            except client.ApiException as error:
                if error.status == 410:
                    since = None
                else:
                    self._stop.wait(0.2)
            except Exception:  # the API server away (drill 8): resume from `since`
                self._stop.wait(0.2)


class Starts(ResumingWatch):
    """When each pod of the namespace was starting, from a watch on its pods: from its creation,
    or its container's restart after a crash, until it is Ready or deleted."""

    def __init__(self, system: System) -> None:
        super().__init__("pod-starts")
        self.system = system
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, float]] = {}  # uid -> (name, since when), starting now
        self._spans: list[tuple[str, float, float]] = []  # (name, from, to) of starts that ended
        self._restarts_when_ready: dict[str, int] = {}  # uid -> its containers' restarts when last Ready

    def _event(self, kind: str, pod: Any) -> None:
        uid, restarts = pod.metadata.uid, sum(c.restart_count for c in pod.status.container_statuses or [])
        if ready(pod):
            self._restarts_when_ready[uid] = restarts
        # Not Ready and never Ready, or restarted since: a pod that was Ready and stopped answering
        # its probe (a hung server, drill 3) is not starting.
        starting = (
            kind != "DELETED"
            and pod.metadata.deletion_timestamp is None
            and not ready(pod)
            and restarts > self._restarts_when_ready.get(uid, -1)
        )
        now = time.monotonic()
        with self._lock:
            if starting and pod.metadata.uid not in self._open:
                self._open[pod.metadata.uid] = (pod.metadata.name, now)
            elif not starting and pod.metadata.uid in self._open:
                name, since = self._open.pop(pod.metadata.uid)
                self._spans.append((name, since, now))

    def _relist(self) -> str:
        pods = self.system.cluster.core.list_namespaced_pod(self.system.namespace)
        for pod in pods.items:
            self._event("ADDED", pod)
        return str(pods.metadata.resource_version)

    def _stream(self, since: str) -> Iterator[dict[str, Any]]:
        core = self.system.cluster.core
        return watch.Watch().stream(  # type: ignore[no-any-return]
            core.list_namespaced_pod, self.system.namespace, resource_version=since, timeout_seconds=2
        )

    def during(self, start: float, end: float) -> tuple[str, ...]:
        """The pods that were starting at some moment of [start, end]."""
        with self._lock:
            spans = [*self._spans, *((name, since, math.inf) for name, since in self._open.values())]
        return tuple(sorted({name for name, a, b in spans if a <= end and b >= start}))


@dataclass
class Waits:
    """A drill's waits after the strike, split by whether a pod was starting meanwhile."""

    struck: float
    other: float = 0.0  # the longest wait while no pod started
    other_at: float = 0.0  # when it ended (monotonic)
    starting: float = 0.0  # the longest wait that overlapped a pod's start
    starting_at: float = 0.0
    pods: tuple[str, ...] = ()  # the pods starting during that one

    def story(self) -> str:
        ending = self.other_at - self.struck
        other = f"longest wait while no pod started {self.other:.2f} s (ending {ending:+.1f} s)"
        if not self.pods:
            return f"{other}, none while one started"
        return (
            f"{other}, {self.starting:.2f} s (ending {self.starting_at - self.struck:+.1f} s) while "
            f"{', '.join(self.pods)} started"
        )

    def check(self, baseline: float, other: float = RECOVERY_STALL_S) -> None:
        """Every wait within `other` (START_STALL_S while a pod started) over `baseline`."""
        assert self.other < baseline + other, (self.story(), baseline)
        assert self.starting < baseline + max(other, START_STALL_S), (self.story(), baseline)


def waits(outcomes: list[Outcome], struck: float, end: float, starts: Starts) -> Waits:
    """The longest waits ending in [struck, end]: of those that overlapped a pod's start (as
    `starts` saw it) and of the others."""
    found = Waits(struck)
    for outcome in outcomes:
        times = [outcome.started, *outcome.chunk_times]
        for before, after in itertools.pairwise(times):
            if not struck <= after <= end:
                continue
            seen = starts.during(before, after)
            if seen and after - before > found.starting:
                found.starting, found.starting_at, found.pods = after - before, after, seen
            elif not seen and after - before > found.other:
                found.other, found.other_at = after - before, after
    return found


def gap_story(outcomes: list[Outcome], start: float, end: float, struck: float) -> str:
    """Where the longest wait in [start, end] was, for a drill's line: when it ended after the
    strike, and whether it was a request's first chunk (queueing, prefill) or a later one (decode)."""
    worst, when, chunk, outcome = _longest_gap(outcomes, start, end)
    if chunk < 0 or outcome is None:
        return "no wait"
    what = "the first chunk" if chunk == 0 else f"chunk {chunk + 1}"
    if chunk == 0 and outcome.connected:  # the TCP connect through the Service, then the answer
        what += f" (connected after {outcome.connected - outcome.started:.2f} s)"
    by = ", ".join(sorted(str(r) for r in outcome.revisions)) or "no revision yet"
    return f"{worst:.2f} s for {what} of a request ({by}), ending {when - struck:+.1f} s from the strike"


@dataclass
class System:
    cluster: Cluster
    plane: ControlPlane
    namespace: str
    checkpoint: Path
    url: str
    model: str
    expected: dict[str, str]

    def expert_pool(self) -> dict[str, Any]:
        return self.cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "expertpools", POOL
        )

    def expert_pods(self) -> list[Any]:
        pods = self.cluster.core.list_namespaced_pod(
            self.namespace, label_selector=f"eaas.io/pool={POOL}"
        ).items
        return sorted(pods, key=lambda p: p.metadata.name)

    def full_strength(self, servers: int) -> Strength:
        """`servers` expert pods Ready and every expert on R live servers (false, with what is
        missing, otherwise: a wait that times out names it)."""
        status = self.expert_pool().get("status") or {}
        pods = [p for p in self.expert_pods() if p.metadata.deletion_timestamp is None]
        not_ready = {
            p.metadata.name: next(
                (c.reason or c.status for c in p.status.conditions or [] if c.type == "Ready"), "?"
            )
            for p in pods
            if not ready(p)
        }
        missing = []
        if len(pods) - len(not_ready) != servers:
            missing.append(
                f"{len(pods) - len(not_ready)} of {servers} expert pods Ready (not Ready: {not_ready})"
            )
        if status.get("downServers"):
            missing.append(f"downServers {status['downServers']}")
        if status.get("fewestLiveReplicas", 0) < REPLICATION:
            missing.append(f"fewestLiveReplicas {status.get('fewestLiveReplicas', 0)} < {REPLICATION}")
        if missing:
            nodes = {n.metadata.name: _node_state(n) for n in self.cluster.core.list_node().items}
            missing.append(f"nodes {nodes}")
        return Strength("; ".join(missing))

    def attention_pods(self, including_leaving: bool = False) -> list[Any]:
        """The attention pods not being deleted (or all of them), by name."""
        pods = self.cluster.core.list_namespaced_pod(
            self.namespace, label_selector=f"eaas.io/pool={ATTENTION}"
        ).items
        return sorted(
            (p for p in pods if including_leaving or p.metadata.deletion_timestamp is None),
            key=lambda p: p.metadata.name,
        )

    def serving_endpoints(self) -> int:
        """Ready endpoints of the MoEService's API Service (what kube-proxy routes to)."""
        slices = client.DiscoveryV1Api(self.cluster.api_client).list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={NAME}"
        )
        return sum(1 for s in slices.items for e in s.endpoints or [] if e.conditions and e.conditions.ready)

    def attention_serving(self, replicas: int) -> bool:
        pods = self.attention_pods()
        return len(pods) == replicas and all(map(ready, pods)) and self.serving_endpoints() == replicas

    def scale_attention(self, replicas: int) -> float:
        """Scales the attention pool to `replicas` and waits until that many pods serve and the
        Service routes to them only (:meth:`wait_routed`, whose wait it returns)."""
        patch = {"spec": {"attentionPool": {"replicas": replicas}}}
        self.cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "moeservices", NAME, patch
        )
        wait_until(lambda: self.attention_serving(replicas), 180, f"{replicas} attention pods serving")
        return self.wait_routed()

    def routing(self) -> Routing:
        """Where kube-proxy's rules send a connection to the MoEService's Service now, against the
        Ready attention pods and the Service's EndpointSlices."""
        port = self.cluster.core.read_namespaced_service(NAME, self.namespace).spec.ports[0]
        slices = client.DiscoveryV1Api(self.cluster.api_client).list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={NAME}"
        )
        sliced = {
            f"{address}:{slice_port.port}"
            for s in slices.items
            for slice_port in s.ports or []
            if slice_port.name == port.name
            for e in s.endpoints or []
            if e.conditions and e.conditions.ready
            for address in e.addresses
        }
        serving = {
            pod_url(p, "http").removeprefix("http://")
            for p in self.attention_pods()
            if ready(p) and p.status.pod_ip
        }
        programmed = self.plane.kube_proxy_routes(self.namespace, NAME, port.name, port.protocol)
        return Routing(f"{self.namespace}/{NAME}", programmed, frozenset(serving), frozenset(sliced))

    def wait_routed(self, timeout: float = 120) -> float:
        """Waits until kube-proxy routes the Service to exactly the serving attention pods; returns
        how long that took. Until then a connection through the Service may go to a pod that is
        gone (`No route to host`), or miss a new one. kube-proxy follows the EndpointSlices within
        a second or two, except after an API server outage: its informers then resume their
        watches with client-go's backoff, which had grown to [30, 60) s while the API server was
        away (as every client's does, on a real node too), so it can lag the EndpointSlices by up
        to a minute after the API server returns (drill 8: 37 s and 61 s measured here)."""
        started = time.monotonic()
        wait_until(self.routing, timeout, f"kube-proxy routing the Service {NAME} to the serving pods only")
        return time.monotonic() - started

    def server_metric(self, name: str) -> dict[str, float]:
        """`name` (all its samples summed) from each live expert server's /metrics, by pod name."""
        values = {}
        for pod in self.expert_pods():
            if pod.metadata.deletion_timestamp is None and ready(pod):
                text = urllib.request.urlopen(f"{pod_url(pod, 'control')}/metrics", timeout=5).read().decode()
                values[pod.metadata.name] = sum(metric(text, name))
        return values

    def attached_slots(self) -> dict[str, int]:
        """Slots attached on each live expert server (pod name -> count)."""
        return {name: int(n) for name, n in self.server_metric("eaas_expert_server_attached_slots").items()}

    def reaped_slots(self, reason: str) -> dict[str, float]:
        """Slots each live expert server freed for `reason` (pod name -> count)."""
        return self.server_metric(f'eaas_expert_server_reaped_slots_total{{reason="{reason}"}}')

    def placement(self) -> tuple[Placement, bool]:
        """The committed placement, and whether a pending one is being loaded."""
        config_map = self.cluster.core.read_namespaced_config_map(f"{POOL}-placement", self.namespace)
        committed, pending = stored_placements(config_map)
        assert committed is not None, "no committed placement"
        return committed, pending is not None

    def server_log(self, pod_name: str) -> str:
        """The expert-server container's log of the newest pod named `pod_name` (the process runner
        keeps one per pod UID)."""
        paths = sorted(
            self.plane.pod_dir.glob(f"{self.namespace}_{pod_name}_*/expert-server.log"),
            key=lambda path: path.stat().st_mtime,
        )
        assert paths, f"no log of {pod_name}"
        return paths[-1].read_text(errors="replace")

    def pid_of(self, pod: Any) -> int:
        container_id = pod.status.container_statuses[0].container_id or ""
        assert container_id.startswith("proc://"), container_id
        return int(container_id.removeprefix("proc://"))

    def check(self, outcomes: list[Outcome]) -> None:
        failed = [o for o in outcomes if o.error]
        assert not failed, (
            f"{len(failed)} failed requests, e.g. {failed[0]}\n{pod_logs(self.plane, self.namespace)}"
        )
        wrong = [o for o in outcomes if o.text != self.expected[o.prompt]]
        assert not wrong, (
            f"answers differ from the reference: {wrong[0].text!r} != {self.expected[wrong[0].prompt]!r}"
        )


def completions_equal_reference(system: System, requests: int = 8) -> list[Outcome]:
    """Drill 1's check: `requests` streamed completions through the Service (2 at a time), every
    one succeeded and equal to the reference; returns them."""
    with Load(system.url, system.model, workers=2, limit=requests) as load:
        wait_until(lambda: len(load.outcomes) == requests and load.all_done(), 120, f"{requests} requests")
    system.check(load.outcomes)
    return load.outcomes


def drill(
    system: System, victim: Any, act: Any, name: str, timeout: float = 180
) -> tuple[float, float, float | None]:
    """Run `act` on `victim` (an expert pod) under load; returns (the crash's stall, baseline,
    replaced): the longest wait for a chunk that overlapped the strike's first CRASH_WINDOW_S, and
    in the seconds before it; and the seconds from the strike until a placement without the victim
    was committed (None: none was). The drill's waits are held to RECOVERY_STALL_S over the
    baseline here (START_STALL_S while a pod starts: :class:`Waits`)."""
    restarts = victim.status.container_statuses[0].restart_count

    def recovered() -> bool:
        # The victim's container restarted, or its pod was replaced (under its name or, when the
        # operator re-placed it after its Lease expired, a new ordinal), and the pool is whole again.
        now_pod = {p.metadata.name: p for p in system.expert_pods()}.get(victim.metadata.name)
        if now_pod is not None and now_pod.metadata.uid == victim.metadata.uid:
            statuses = now_pod.status.container_statuses or []
            if not statuses or statuses[0].restart_count <= restarts:
                return False
        return system.full_strength(3)

    # The load outlasts every wait below (before, the drill's recovery, after), so a slow recovery
    # is reported as slow, never as "no requests after the drill" because the load had run out.
    lasting = 120 + 3 + timeout + 120 + 30
    load = Load(system.url, system.model, workers=2, max_seconds=lasting)
    with ReplicaWatch(system) as watch, Starts(system) as starts, load:
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        before_start = time.monotonic()
        time.sleep(3)
        struck = time.monotonic()
        act()
        try:
            wait_until(recovered, timeout, f"{name}: the victim back and the pool at full R")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, system.namespace)}") from None
        restored = time.monotonic() - struck
        back = time.monotonic()
        try:
            wait_until(lambda: load.completed_since(back) >= 4, 120, "requests after the drill")
        except AssertionError as error:
            raise AssertionError(
                f"{error}; since the pool was whole: {load.summary(back)}\n"
                f"{pod_logs(system.plane, system.namespace)}"
            ) from None
    outcomes = load.outcomes
    baseline = longest_gap(outcomes, before_start, struck)
    during = longest_gap(outcomes, struck, time.monotonic())
    split = waits(outcomes, struck, time.monotonic(), starts)
    crash = crash_stall(outcomes, struck)
    failed = sum(1 for o in outcomes if o.error)
    # R on the survivors: from the first sample short of R (the victim's pod no longer Ready) to
    # the next with every expert on R Ready servers of the committed placement (the re-placement
    # committed, or the victim Ready again, whichever came first).
    samples = [(t, f) for t, _, f in watch.fewest if t >= struck]
    short = next((t for t, f in samples if f < REPLICATION), None)
    whole = next((t for t, f in samples if short is not None and t > short and f >= REPLICATION), None)
    r_back = f"after {whole - struck:.1f} s" if whole is not None else "never short of it"
    # A hung server's pod stays Ready for a while (its probes time out): the re-placement on the
    # survivors is then seen as the first committed placement without it.
    ordinal = int(victim.metadata.name.rsplit("-", 1)[1])
    without = next(
        (
            t
            for t, (_, o) in zip(watch.commit_times, watch.commits, strict=True)
            if t > struck and ordinal not in o
        ),
        None,
    )
    replaced = f"; placement without it committed after {without - struck:.1f} s" if without else ""
    print(
        f"\n{name}: {len(outcomes)} requests, {failed} failed; longest wait at the strike {crash:.2f} s, "
        f"over the whole drill {during:.2f} s ({gap_story(outcomes, struck, time.monotonic(), struck)}; "
        f"before: {baseline:.2f} s; {split.story()}); R on Ready servers {r_back}{replaced}; victim back "
        f"and pool whole after {restored:.1f} s"
    )
    system.check(outcomes)
    split.check(baseline)
    return crash, baseline, (without - struck if without is not None else None)


def sigkill_drill(system: System, name: str = "drill 2 (SIGKILL)") -> None:
    """Drill 2: a crashed server (SIGKILL of the second expert pod's process) under load; its
    replicas take its share at once, the kubelet restarts it."""
    victim = system.expert_pods()[1]
    pid = system.pid_of(victim)
    crash, baseline, replaced = drill(system, victim, lambda: os.kill(pid, signal.SIGKILL), name)
    assert crash < baseline + CRASH_STALL_S  # target: a crash stalls decoding at most 1 s
    assert_replaced_on_the_clients_word(replaced, name)


def sigstop_drill(system: System, name: str = "drill 3 (SIGSTOP)") -> None:
    """Drill 3: a hung server (SIGSTOP of the third expert pod's process) under load; clients
    time it out, its Lease expires and the operator re-places its experts, deletes the pod and
    brings a replacement in."""
    victim = system.expert_pods()[2]
    pid = system.pid_of(victim)
    try:
        crash, baseline, replaced = drill(system, victim, lambda: os.kill(pid, signal.SIGSTOP), name, 240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert crash < baseline + 2.0  # target: a hang stalls decoding at most 2 s
    assert_replaced_on_the_clients_word(replaced, name)


def assert_replaced_on_the_clients_word(replaced: float | None, name: str) -> None:
    """The placement without the victim was committed before its Lease could have expired: the
    operator acted on its clients' word (the re-planning targets, 1.5 s after a SIGKILL and 2.5 s after
    a SIGSTOP, are printed by :func:`drill` and recorded in docs/benchmarks.md; a shared CI machine
    is held to the bound that tells the two paths apart)."""
    assert replaced is not None, f"{name}: no placement without the victim was committed"
    assert replaced < HEARTBEAT_TIMEOUT_S, (
        f"{name}: the placement without the victim was committed {replaced:.1f} s after the strike, "
        f"not before its Lease ({HEARTBEAT_TIMEOUT_S} s) could expire"
    )


def ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def pod_url(pod: Any, port_name: str) -> str:
    """http://<pod IP>:<the container port named `port_name`>."""
    port = next(p.container_port for p in pod.spec.containers[0].ports if p.name == port_name)
    return f"http://{pod.status.pod_ip}:{port}"


def metric(text: str, name: str) -> list[float]:
    """The values of every sample of `name` (with its labels, if given) in Prometheus text."""
    values = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            values.append(float(line.rsplit(" ", 1)[1]))
    return values


CONNECTION_ERRORS = (
    "RemoteDisconnected",
    "IncompleteRead",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "the stream ended without",  # the server's end closed mid-stream
    "timed out",  # nothing closed it: the pod's network went with it, as when its node dies
)


def retried(url: str, model: str, prompt: str, attempts: int = 20) -> Outcome:
    """What a client does after a connection error: try again (through the Service), 0.5 s apart."""
    for _ in range(attempts):
        outcome = stream_completion(url, model, Outcome(prompt))
        if not outcome.error:
            return outcome
        time.sleep(0.5)
    return outcome


def reference_texts(checkpoint: Path, prompts: list[str]) -> dict[str, str]:
    """What the single-process reference model answers to each prompt (greedy, up to EOS)."""
    reference = load_reference(checkpoint)
    tokenizer = load_tokenizer(checkpoint, reference.config.vocab_size)
    generated, _ = reference.generate([tokenizer.encode(p) for p in prompts], MAX_TOKENS)
    expected = {}
    for prompt, ids in zip(prompts, generated, strict=True):
        stop = next((i for i, t in enumerate(ids) if t in tokenizer.eos_token_ids), len(ids))
        expected[prompt] = tokenizer.decode(ids[:stop])
    return expected


@contextlib.contextmanager
def deploy(
    cluster: Cluster,
    plane: ControlPlane,
    checkpoint: Path,
    operator: OperatorProcess,
    prefix: str,
    customize: Callable[[dict[str, Any]], None] = lambda manifest: None,
    servers: int = 3,
) -> Iterator[System]:
    """The tiny MoEService (CPU processes, 1 s heartbeats, no load-based rebalancing unless
    `customize` asks for it) applied in a new namespace named after `prefix`; yields once it is
    Ready with `servers` expert servers and answers through its Service."""
    expected = reference_texts(checkpoint, [*PROMPTS, SKEWED])
    manifest = copy.deepcopy(tiny_gpu_manifest())
    manifest["spec"]["expertPool"]["gpusPerPod"] = 0  # the processes compute on CPU here
    manifest["spec"]["model"]["checkpoint"] = {"hostPath": {"path": str(checkpoint)}}
    manifest["spec"]["heartbeat"] = {"intervalSeconds": 1, "timeoutSeconds": HEARTBEAT_TIMEOUT_S}
    # Load-based rebalancing only where a drill asks for it: elsewhere a rebalance would be a
    # change the drill did not make.
    manifest["spec"]["placement"] = {"rebalanceIntervalSeconds": 0}
    customize(manifest)
    with cluster.namespace(prefix=prefix) as namespace:
        started = time.monotonic()
        apply_tiny(cluster, namespace, manifest, keys=API_KEY)
        placeholder = System(cluster, plane, namespace, checkpoint, "", "", expected)
        try:
            wait_until(
                lambda: _serving(placeholder, servers), 300, "the MoEService Ready with every pod running"
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{operator.log_tail()}\n{pod_logs(plane, namespace)}") from None
        service = cluster.core.read_namespaced_service(NAME, namespace)  # the MoEService's API
        url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
        models = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        # The Service answers once kube-proxy has programmed its endpoints, which can be a moment
        # after the pods are Ready: until then its ClusterIP refuses the connection.
        model = wait_until(lambda: _model_of(models), 60, f"the Service {NAME} answering {url}")
        print(f"\n{prefix}: tiny MoEService Ready with its processes in {time.monotonic() - started:.1f} s")
        yield System(cluster, plane, namespace, checkpoint, url, model, expected)


def _model_of(models: urllib.request.Request) -> str | None:
    """The model the Service names at ``/v1/models``; None while its ClusterIP refuses or drops the
    connection (no endpoint programmed yet). An HTTP error is an answer, and raises."""
    try:
        with urllib.request.urlopen(models, timeout=10) as response:
            return str(json.loads(response.read())["data"][0]["id"])
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _serving(system: System, servers: int) -> bool:
    moe: Any = system.cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, system.namespace, "moeservices", NAME
    )
    ready = any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (moe.get("status") or {}).get("conditions", [])
    )
    return ready and bool(system.full_strength(servers))


@dataclass(frozen=True)
class Strength:
    """Whether the pool is at full strength: true when nothing is `missing`."""

    missing: str

    def __bool__(self) -> bool:
        return not self.missing

    def __repr__(self) -> str:
        return self.missing or "full strength"


@dataclass(frozen=True)
class Routing:
    """Where kube-proxy's rules route a Service (``programmed``, as ``IP:port``), against the Ready
    pods behind it (``serving``) and its EndpointSlices' ready endpoints (``sliced``): true when
    all three are the same (and not empty); its repr, which a failed wait prints, shows them."""

    service: str
    programmed: frozenset[str]
    serving: frozenset[str]
    sliced: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.serving) and self.programmed == self.serving == self.sliced

    def __repr__(self) -> str:
        return (
            f"kube-proxy's nftables rules for {self.service} route to {sorted(self.programmed)}; Ready "
            f"pods {sorted(self.serving)}; EndpointSlice ready endpoints {sorted(self.sliced)}"
        )


def _node_state(node: Any) -> str:
    condition = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
    taints = [t.key for t in node.spec.taints or []]
    return f"Ready={condition.status if condition else '?'}" + (f" taints {taints}" if taints else "")


class CommitWatch(ResumingWatch):
    """Every committed placement, in order, as a watch on the placement ConfigMap delivers it: a
    sampler misses a placement that lived shorter than its period (a replacement committed and
    the retired server drained away within a second), a watch does not. The stream is resumed
    from the last resourceVersion it saw; if that has been compacted away (410), the gap is
    recorded as the version ``-1`` when the placement changed meanwhile, so that no comparison
    spans it unknowingly."""

    def __init__(self, system: System) -> None:
        super().__init__("commit-watch")
        self.system = system
        self.commits: list[tuple[int, tuple[int, ...]]] = []  # (version, ordinals), as they change
        self.times: list[float] = []  # when each of `commits` arrived
        self._lock = threading.Lock()
        name = f"{POOL}-placement"
        self._selector = f"metadata.name={name}"
        configmap = system.cluster.core.read_namespaced_config_map(name, system.namespace)
        self._since = configmap.metadata.resource_version
        self._saw(configmap)

    def _saw(self, configmap: Any) -> None:
        placement = stored_placements(configmap)[0]
        if placement is None:
            return
        with self._lock:
            if not self.commits or self.commits[-1][0] != placement.version:
                self.commits.append((placement.version, placement.ordinals))
                self.times.append(time.monotonic())

    def _gap(self) -> None:
        with self._lock:
            self.commits.append((-1, ()))
            self.times.append(time.monotonic())

    def _relist(self) -> str:
        # Compacted past the last resourceVersion (nothing changed for minutes): start again from
        # what is there now. Versions only grow, so an unchanged one means nothing was missed.
        core = self.system.cluster.core
        configmap = core.read_namespaced_config_map(f"{POOL}-placement", self.system.namespace)
        placement = stored_placements(configmap)[0]
        if self.commits and placement is not None and placement.version != self.commits[-1][0]:
            self._gap()
        self._saw(configmap)
        return str(configmap.metadata.resource_version)

    def _stream(self, since: str) -> Iterator[dict[str, Any]]:
        core = self.system.cluster.core
        return watch.Watch().stream(  # type: ignore[no-any-return]
            core.list_namespaced_config_map,
            self.system.namespace,
            field_selector=self._selector,
            resource_version=since,
            timeout_seconds=2,
        )

    def _event(self, kind: str, obj: Any) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._saw(obj)


class ReplicaWatch(DaemonLoop):
    """Samples, every 0.2 s, the committed placement and which placed servers are Ready: the
    fewest Ready replicas of any expert. A server counts as Ready when its pod was Ready in the
    read before or after the ConfigMap's (a commit between the two reads is then never mistaken
    for a lost replica). The sequence of committed placements (``commits``) comes from a
    :class:`CommitWatch`, which misses none.

    With ``serving=True`` a server also counts while its pod is being deleted if its process still
    answers (a server that received SIGTERM serves on until it is drained: drills 9-11); each
    sample then also asks every attention pod's ``/readyz`` which servers it has lost
    (``client_down``: what the clients saw, where a failover would show)."""

    def __init__(self, system: System, serving: bool = False) -> None:
        super().__init__("replica-watch")
        self.system = system
        self.serving = serving
        self.fewest: list[tuple[float, int, int]] = []  # (time, version, fewest Ready replicas)
        self._commits = CommitWatch(system)
        self.client_down: list[tuple[float, str, list[int]]] = []  # (time, attention pod, down servers)

    @property
    def commits(self) -> list[tuple[int, tuple[int, ...]]]:
        """(version, ordinals) of every committed placement, in order."""
        return self._commits.commits

    def steps(self) -> list[tuple[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...]]]]:
        """Each committed placement with the one before it, never across a gap in the watch."""
        return [(a, b) for a, b in itertools.pairwise(self.commits) if a[0] >= 0 and b[0] >= 0]

    @property
    def commit_times(self) -> list[float]:
        """When each of `commits` arrived (monotonic)."""
        return self._commits.times

    def start(self) -> Self:
        self._commits.start()
        return super().start()

    def stop(self) -> None:
        super().stop()
        self._commits.stop()

    def _ready_ordinals(self) -> set[int]:
        ordinals = set()
        for pod in self.system.expert_pods():
            leaving = pod.metadata.deletion_timestamp is not None
            if (ready(pod) and not leaving) or (self.serving and leaving and _answers(pod)):
                ordinals.add(int(pod.metadata.labels["eaas.io/ordinal"]))
        return ordinals

    def _clients(self) -> None:
        for pod in self.system.attention_pods(including_leaving=True):
            if not pod.status.pod_ip:
                continue
            try:
                with urllib.request.urlopen(f"{pod_url(pod, 'http')}/readyz", timeout=1) as response:
                    detail = json.loads(response.read())
            except urllib.error.HTTPError as error:
                detail = json.loads(error.read() or b"{}")
            except OSError:
                continue  # gone, or not listening yet
            if detail.get("down_servers"):
                self.client_down.append((time.monotonic(), pod.metadata.name, detail["down_servers"]))

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(Exception):  # an API hiccup: skip this sample
                before = self._ready_ordinals()
                placement, _ = self.system.placement()
                live = before | self._ready_ordinals()
                fewest = min(
                    sum(1 for ordinal in hosts if ordinal in live)
                    for table in placement.routing_table().values()
                    for hosts in table
                )
                self.fewest.append((time.monotonic(), placement.version, fewest))
                if self.serving:
                    self._clients()


def _answers(pod: Any) -> bool:
    """The pod's expert server still answers on its control port (its process serves)."""
    if not pod.status.pod_ip:
        return False
    try:
        with urllib.request.urlopen(f"{pod_url(pod, 'control')}/healthz", timeout=0.5) as response:
            return response.status == 200
    except OSError:
        return False
