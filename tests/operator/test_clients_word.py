"""Re-planning on the clients' word: what the attention clients say on their Leases (the servers
they fail over), how the operator hears it (the Lease watch), asks the server's control port, and
re-places a server that is gone without waiting for its Lease to expire."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from memory_kube import MemoryKube
from prometheus_client import CollectorRegistry
from test_rebalance_reconcile import serving

from eaas.operator import handlers, naming
from eaas.operator.collector import Probe, probe
from eaas.operator.lease_watch import Concern, LeaseWatch
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.reconcile import expertpool
from eaas.operator.reconcile.context import Context
from eaas.operator.renewals import RenewalClock
from eaas.runtime.lease import LeaseSettings, lease_body, micro_time
from eaas.runtime.placement import Placement, stored

POOL = "tiny-experts"


def server_lease(ordinal: int, renewed_ago: float = 0.0, loaded: int = 1, uid: str = "") -> dict[str, Any]:
    settings = LeaseSettings(naming.pod_name(POOL, ordinal), "ns", POOL, 1.0, 5.0, pod_uid=uid or None)
    return lease_body(settings, datetime.now(UTC) - timedelta(seconds=renewed_ago), loaded, 0)


def client_lease(name: str, failed: tuple[int, ...], service: str = "tiny") -> dict[str, Any]:
    settings = LeaseSettings(
        name, "ns", "tiny-attention", 1.0, 5.0, component=naming.ATTENTION_COMPONENT, service=service
    )
    return lease_body(settings, datetime.now(UTC), 1, 0, failed_over=failed)


# --- what a client says ----------------------------------------------------------------------------
def test_a_client_lease_names_the_servers_it_fails_over_and_drops_the_word_when_none() -> None:
    said = client_lease("a-0", (3, 1))
    assert said["metadata"]["annotations"][naming.FAILED_OVER_ANNOTATION] == "1,3"
    settings = LeaseSettings("a-0", "ns", "tiny-attention", component=naming.ATTENTION_COMPONENT)
    healed = lease_body(settings, datetime.now(UTC), 1, 0, previous=said, failed_over=())
    assert naming.FAILED_OVER_ANNOTATION not in healed["metadata"]["annotations"]


def test_a_garbled_word_is_read_as_far_as_it_parses() -> None:
    assert expertpool.failed_over("1, 3,x,-2,,7") == frozenset({1, 3, 7})
    assert expertpool.failed_over(None) == frozenset()
    assert expertpool.failed_over(",".join(["5"] * 5000)) == frozenset({5})


# --- how the operator hears it ---------------------------------------------------------------------
def test_the_lease_watch_acts_on_what_matters_and_records_every_renewal() -> None:
    clock = RenewalClock()
    watch = LeaseWatch(clock)
    now = time.time()
    expert = server_lease(1)
    assert watch.seen(expert, None, now) is None  # the initial listing: remembered only
    renewed = server_lease(1)
    renewed["spec"]["renewTime"] = micro_time(datetime.now(UTC) + timedelta(seconds=1))
    assert watch.seen(renewed, "MODIFIED", now + 1) is None  # a plain renewal
    assert clock.ages("ns", POOL, [renewed], now + 1.5)[naming.pod_name(POOL, 1)] == pytest.approx(0.5)
    loaded = server_lease(1, loaded=2)
    assert watch.seen(loaded, "MODIFIED", now + 2) == Concern("ns", pool=POOL)  # a newer placement loaded
    leaving = server_lease(1, loaded=2)
    leaving["metadata"]["annotations"][naming.LEAVING_ANNOTATION] = micro_time(datetime.now(UTC))
    assert watch.seen(leaving, "MODIFIED", now + 3) == Concern("ns", pool=POOL)

    assert watch.seen(client_lease("a-0", (1,)), None, now) == Concern("ns", service="tiny")  # standing word
    assert watch.seen(client_lease("a-0", (1,)), "MODIFIED", now) is None
    assert watch.seen(client_lease("a-0", ()), "MODIFIED", now) == Concern("ns", service="tiny")
    assert watch.seen(client_lease("a-1", ()), None, now) is None
    watch.forget(client_lease("a-1", ()))
    assert watch.seen(client_lease("a-1", ()), "ADDED", now) == Concern("ns", service="tiny")

    foreign = {"metadata": {"name": "node-1", "namespace": "kube-node-lease"}, "spec": {}}
    assert watch.seen(foreign, "MODIFIED", now) is None


def test_rechecks_keep_the_earliest_and_run_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, str, float]] = []
    done = threading.Event()

    def reconcile(namespace: str, name: str) -> None:
        ran.append((namespace, name, time.monotonic()))
        done.set()

    monkeypatch.setattr(handlers, "reconcile_expert_pool", reconcile)
    rechecks = handlers.Rechecks()
    key = ("ExpertPool", "ns", "p")
    rechecks.schedule(*key, 5.0)
    first = rechecks._due[key]
    rechecks.schedule(*key, 0.05)  # earlier: replaces it
    earliest = rechecks._due[key]
    rechecks.schedule(*key, 3.0)  # later than the one due: ignored
    assert earliest < first - 4 and rechecks._due[key] == earliest  # what is due (no clock race)
    assert done.wait(5)
    assert [(n, p) for n, p, _ in ran] == [("ns", "p")] and key not in rechecks._due
    with pytest.raises(ValueError, match="only of ExpertPools"):
        rechecks.schedule("AttentionPool", "ns", "a", 0.1)


# --- the operator's probe --------------------------------------------------------------------------
@pytest.fixture
def healthz() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_probe_tells_an_answer_a_refusal_and_silence_apart(healthz: str) -> None:
    assert probe(healthz) == "answers"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the host refuses
    assert probe(f"http://127.0.0.1:{port}") == "refused"
    with socket.socket() as hung:  # listening (the kernel accepts) but never answering: SIGSTOP
        hung.bind(("127.0.0.1", 0))
        hung.listen(4)
        started = time.monotonic()
        assert probe(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout_s=0.3) == "silent"
        assert time.monotonic() - started < 2


# --- the reconcile ---------------------------------------------------------------------------------
def world(
    pool: dict[str, Any], probes: dict[int, Probe], renewed_ago: float
) -> tuple[MemoryKube, Context, list]:
    kube = MemoryKube()
    serving(kube, pool)
    for ordinal in range(3):
        uid = kube.objects[("Pod", naming.pod_name(POOL, ordinal))]["metadata"]["uid"]
        kube.apply(server_lease(ordinal, renewed_ago if ordinal == 1 else 0.0, uid=uid))
    kube.apply(client_lease("tiny-attention-a", (1,)))
    asked: list[str] = []
    rechecks: list[tuple[str, str, str, float]] = []

    def ask(url: str) -> Probe:
        asked.append(url)
        return probes[int(url.rsplit(".", 1)[1].split(":")[0])]

    context = Context(
        kube=kube,
        metrics=OperatorMetrics(CollectorRegistry()),
        post_event=lambda *a: None,
        probe=ask,
        recheck=lambda *args: rechecks.append(args),
    )
    watched(context, kube, {1: renewed_ago})
    return kube, context, rechecks


def watched(context: Context, kube: MemoryKube, ago: dict[int, float]) -> None:
    """The Lease watch delivered each server's Lease when it was renewed (`ago` seconds back)."""
    for ordinal in range(3):
        lease = kube.objects[("Lease", naming.pod_name(POOL, ordinal))]
        context.leases.seen(lease, "MODIFIED", time.time() - ago.get(ordinal, 0.0))


def pending_of(kube: MemoryKube) -> Placement | None:
    return stored.read_config_map(kube.objects[("ConfigMap", naming.placement_config_map_name(POOL))])[1]


def test_a_server_a_client_fails_over_whose_port_refuses_is_replaced_at_once(pool: dict[str, Any]) -> None:
    pool["spec"]["heartbeat"] = {"intervalSeconds": 1, "timeoutSeconds": 5}
    kube, context, rechecks = world(pool, {0: "answers", 1: "refused", 2: "answers"}, renewed_ago=0.2)
    expertpool.reconcile(context, pool)
    pending = pending_of(kube)
    assert pending is not None and pending.ordinals == (0, 2)  # its Lease had 4.8 s left
    assert rechecks == []


def test_a_hung_server_a_client_fails_over_is_looked_at_again_when_its_silence_suffices(
    pool: dict[str, Any],
) -> None:
    pool["spec"]["heartbeat"] = {"intervalSeconds": 1, "timeoutSeconds": 5}
    kube, context, rechecks = world(pool, {0: "answers", 1: "silent", 2: "answers"}, renewed_ago=0.6)
    expertpool.reconcile(context, pool)
    assert pending_of(kube) is None  # 0.6 s unrenewed: not yet
    [(kind, namespace, name, delay)] = rechecks
    assert (kind, namespace, name) == ("ExpertPool", pool["metadata"]["namespace"], POOL)
    assert 0.8 < delay < 1.0  # 1.5 intervals less the 0.6 s, plus a margin
    uid = kube.objects[("Pod", naming.pod_name(POOL, 1))]["metadata"]["uid"]
    kube.apply(server_lease(1, renewed_ago=1.6, uid=uid))
    context.renewals = RenewalClock()  # a fresh operator: it never saw the renewal happen
    context.leases = LeaseWatch(context.renewals)
    expertpool.reconcile(context, pool)
    assert pending_of(kube) is None  # first seen now: its silence is counted from now, not renewTime
    context.renewals = RenewalClock()
    context.leases = LeaseWatch(context.renewals)
    watched(context, kube, {1: 1.6})
    expertpool.reconcile(context, pool)
    pending = pending_of(kube)
    assert pending is not None and pending.ordinals == (0, 2)


def test_a_slow_server_a_client_fails_over_stays(pool: dict[str, Any]) -> None:
    pool["spec"]["heartbeat"] = {"intervalSeconds": 1, "timeoutSeconds": 5}
    kube, context, rechecks = world(pool, {0: "answers", 1: "answers", 2: "answers"}, renewed_ago=3.0)
    expertpool.reconcile(context, pool)
    assert pending_of(kube) is None and rechecks == []


@pytest.fixture
def pool(pool_body: dict[str, Any]) -> dict[str, Any]:
    return pool_body


def test_only_the_clients_of_the_pools_own_slot_speak_for_it() -> None:
    """During a blue/green rollout both slots' attention clients carry the MoEService's label; the
    green clients' ordinals and placement versions are the green ExpertPool's, not the blue one's."""
    kube = MemoryKube()
    kube.apply(client_lease("tiny-attention-a", (1,)))
    green = client_lease("tiny-green-attention-a", (2,))
    green["metadata"]["labels"][naming.POOL_LABEL] = naming.attention_pool_name("tiny", "green")
    green["metadata"]["annotations"][naming.LOADED_VERSION_ANNOTATION] = "7"
    kube.apply(green)
    context = Context(kube=kube, metrics=OperatorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    labels = {naming.SERVICE_LABEL: "tiny"}
    blue_pool = {
        "metadata": {"name": naming.expert_pool_name("tiny", "blue"), "namespace": "ns", "labels": labels}
    }
    green_pool = {
        "metadata": {"name": naming.expert_pool_name("tiny", "green"), "namespace": "ns", "labels": labels}
    }
    now = time.time()
    assert expertpool.clients(context, blue_pool, now) == ((1,), frozenset({1}))
    assert expertpool.clients(context, green_pool, now) == ((7,), frozenset({2}))
