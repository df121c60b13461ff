"""An expert server frees the slots of clients that went away: their connection closed, or the
Lease they named at the handshake expired (judged on the server's clock, never during an API gap)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from datapath_helpers import in_process_servers

from eaas.runtime import contract
from eaas.runtime.client.connection import ServerConnection
from eaas.runtime.lease import MIN_RETRY_S, Heartbeat, LeaseSettings, lease_body
from eaas.runtime.model import CheckpointReader
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.server import ExpertServer
from eaas.runtime.server.client_leases import LeaseClock, attention_selector


def lease(name: str, renew: str, duration: int = 10) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"renewTime": renew, "leaseDurationSeconds": duration}}


# --- the clock ------------------------------------------------------------------------------------
def test_a_lease_expires_when_its_renewal_stops_changing_for_its_duration() -> None:
    clock = LeaseClock(default_duration_s=10)
    assert not clock.expired("a", attached_at=0.0, now=100.0)  # nothing listed yet: nothing judged
    clock.observe([lease("a", "t1")], now=100.0)
    clock.observe([lease("a", "t1")], now=109.0)
    assert not clock.expired("a", 0.0, now=109.0)
    clock.observe([lease("a", "t2")], now=109.5)  # renewed: counts from when the change was seen
    assert not clock.expired("a", 0.0, now=119.0)
    clock.observe([lease("a", "t2")], now=120.0)
    assert clock.expired("a", 0.0, now=120.0)


def test_the_servers_clock_judges_not_the_timestamps() -> None:
    """A renewTime far in the past (a client whose clock lags) is alive while it keeps changing."""
    clock = LeaseClock(default_duration_s=10)
    for step in range(5):
        clock.observe([lease("a", f"1970-01-01T00:00:0{step}.000000Z")], now=100.0 + 8 * step)
        assert not clock.expired("a", 0.0, now=100.0 + 8 * step + 7)


def test_a_lease_never_seen_counts_from_the_slots_attach() -> None:
    clock = LeaseClock(default_duration_s=10)
    clock.observe([], now=40.0)
    clock.observe([], now=50.0)
    assert not clock.expired("new", attached_at=45.0, now=54.0)
    assert clock.expired("new", attached_at=45.0, now=56.0)
    # ... but never from before the first listing: the Lease may have been there unseen
    assert not clock.expired("new", attached_at=0.0, now=49.0)


def test_after_an_api_gap_every_client_gets_a_full_duration_again() -> None:
    """The API server was away for 30 s: no client could renew, none is expired on its return."""
    clock = LeaseClock(default_duration_s=10)
    clock.observe([lease("a", "t1")], now=100.0)
    clock.gap()
    assert not clock.expired("a", 0.0, now=131.0)  # nothing is judged while the API cannot be read
    clock.observe([lease("a", "t1")], now=131.0)
    assert not clock.expired("a", 0.0, now=140.0)
    assert not clock.expired("never-seen", 0.0, now=140.0)
    clock.observe([lease("a", "t1")], now=142.0)
    assert clock.expired("a", 0.0, now=142.0) and clock.expired("never-seen", 0.0, now=142.0)


def test_a_deleted_lease_is_judged_from_its_last_renewal() -> None:
    clock = LeaseClock(default_duration_s=10)
    clock.observe([lease("a", "t1", duration=4)], now=100.0)
    clock.observe([], now=102.0)  # deleted with its pod
    assert not clock.expired("a", 0.0, now=103.0)
    assert clock.expired("a", 0.0, now=105.0)
    clock.observe([], now=106.0)
    assert clock.expired("a", 0.0, now=106.0)
    clock.observe([], now=141.0)  # forgotten long after: a slot naming it is then judged from its attach
    assert clock.expired("a", attached_at=0.0, now=141.0) and not clock.expired("a", 135.0, now=141.0)


def test_attention_leases_are_labelled_for_the_servers_selector() -> None:
    settings = LeaseSettings(
        "m-attention-abc", "ns", "m-attention", 1, 3, component=contract.ATTENTION_COMPONENT, service="m"
    )
    body = lease_body(settings, datetime.now(UTC), 3, 0)
    labels = body["metadata"]["labels"]
    selector = dict(term.split("=") for term in attention_selector("m").split(","))
    assert selector.items() <= labels.items()
    assert labels[contract.POOL_LABEL] == "m-attention"
    expert = lease_body(LeaseSettings("m-experts-0", "ns", "m-experts"), datetime.now(UTC), 1, 0)
    assert expert["metadata"]["labels"][contract.COMPONENT_LABEL] == contract.EXPERT_COMPONENT


# --- the server -----------------------------------------------------------------------------------
def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reaped(server: ExpertServer, reason: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "eaas_expert_server_reaped_slots_total", {"reason": reason}
    )
    return value or 0.0


def live_slots(server: ExpertServer, transport: str = "tcp") -> set[int]:
    return {
        int(row["slot"])
        for row in server.slots()
        if row["transport"] == transport and row["state"] != "OFFLINE"
    }


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoints: dict[str, Path]) -> tuple[Path, Placement]:
    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    return checkpoint, round_robin(config.moe_layers, config.num_experts, 1, replication=1)


@pytest.fixture
def server(mixtral: tuple[Path, Placement]) -> Iterator[ExpertServer]:
    checkpoint, placement = mixtral
    with in_process_servers(checkpoint, placement, max_clients=4) as servers:
        yield servers[0]


def connect(server: ExpertServer, lease_name: str | None, client_id: str) -> ServerConnection:
    connection = ServerConnection(0, server.url, "tcp", client_id, 5.0, 2.0, lease=lease_name)
    connection.connect()
    return connection


def test_a_malformed_lease_name_is_refused_and_nothing_is_attached(server: ExpertServer) -> None:
    for bad in ("", "Upper", "-dash", "a" * 254, 7, ["x"]):
        status, body = post(f"{server.url}/v1/slots", {"client_id": "c", "transport": "tcp", "lease": bad})
        assert status == 400 and body["error"].startswith("lease:"), bad
    assert live_slots(server) == set()


def test_only_the_slots_of_expired_leases_are_freed(server: ExpertServer) -> None:
    hung = connect(server, "m-attention-hung", "hung")
    alive = connect(server, "m-attention-alive", "alive")
    local = connect(server, None, "no-lease")  # outside Kubernetes: never freed by Lease
    assert live_slots(server) == {0, 1, 2}
    verdicts: list[tuple[str, float]] = []

    def expired(name: str, attached_at: float) -> bool:
        verdicts.append((name, attached_at))
        return name == "m-attention-hung"

    freed = server.reap_expired_leases(expired)
    assert freed == [("tcp", int(hung.handle["slot"]), "m-attention-hung")]
    assert {name for name, _ in verdicts} == {"m-attention-hung", "m-attention-alive"}
    assert live_slots(server) == {1, 2}
    assert reaped(server, "lease_expired") == 1
    # The freed slot's next client is not the hung one: a verdict on the old Lease frees nothing.
    newcomer = connect(server, "m-attention-new", "new")
    assert int(newcomer.handle["slot"]) == int(hung.handle["slot"])
    assert server.reap_expired_leases(lambda name, _: name == "m-attention-hung") == []
    assert live_slots(server) == {0, 1, 2}
    for connection in (alive, local, newcomer):
        connection.close()
    hung.drop()


def test_a_closed_connection_frees_its_slot_and_is_counted(server: ExpertServer) -> None:
    before = reaped(server, "client_gone")
    connection = connect(server, "m-attention-x", "x")
    slot = int(connection.handle["slot"])
    assert slot in live_slots(server)
    connection.drop()  # the process died: its socket closes, nobody says DELETE
    wait_for(lambda: slot not in live_slots(server), "the slot of the closed connection to be freed")
    wait_for(lambda: reaped(server, "client_gone") == before + 1, "the reap to be counted")
    assert reaped(server, "lease_expired") == 0
    assert server.reap_expired_leases(lambda *_: True) == []  # nothing left to free by Lease


def test_a_client_that_hangs_with_its_connection_open_loses_its_slot_to_its_lease(
    server: ExpertServer,
) -> None:
    """The case only the Lease can catch: the TCP connection stays up, the client is stopped."""
    sock = socket.create_connection(("127.0.0.1", server.tcp_port))  # an unrelated open connection
    hung = connect(server, "m-attention-stopped", "stopped")
    clock = LeaseClock(default_duration_s=0.3)
    clock.observe([lease("m-attention-stopped", "t1", duration=1)], now=time.monotonic())
    assert server.reap_expired_leases(lambda n, at: clock.expired(n, at, time.monotonic())) == []
    time.sleep(1.1)
    clock.observe([lease("m-attention-stopped", "t1", duration=1)], now=time.monotonic())
    freed = server.reap_expired_leases(lambda n, at: clock.expired(n, at, time.monotonic()))
    assert [lease for _, _, lease in freed] == ["m-attention-stopped"]
    assert int(hung.handle["slot"]) not in live_slots(server)
    sock.close()
    hung.drop()


def test_utilization_is_the_busy_fraction_over_a_window_not_one_heartbeat() -> None:
    """A server busy in bursts: one heartbeat's interval would read 0 or 100%; the Lease carries
    the fraction over the last 10 s, as the HPA's rate over its window does."""
    from eaas.runtime.lease import Utilization

    now, busy = [0.0], [0.0]
    utilization = Utilization(lambda: busy[0], window_s=10.0, clock=lambda: now[0])
    readings = []
    for second in range(1, 31):  # 1 s heartbeats; busy every other second
        now[0] = float(second)
        busy[0] += 1.0 if second % 2 else 0.0
        readings.append(utilization.milli())
    assert readings[0] == 1000  # less than a window seen: the fraction so far
    assert all(450 <= r <= 550 for r in readings[9:]), readings  # a full window: about half
    now[0] += 60.0  # heartbeats far apart (the API server was away): the whole gap counts
    assert utilization.milli() == 0


def test_expert_wait_is_the_mean_per_step_over_a_window() -> None:
    """What an attention client's decoder steps spent on the expert servers, per step, over the
    last 10 s, as its Lease carries it for the built-in autoscaler (``metric: expertWait``)."""
    from eaas.runtime.lease import ExpertWait

    now, total = [0.0], [(0.0, 0)]
    wait = ExpertWait(lambda: total[0], window_s=10.0, clock=lambda: now[0])
    assert wait.micros() == 0  # no step yet: nothing asked of the experts
    readings = []
    for second in range(1, 31):  # 10 steps a second: 20 ms each on the experts, then 40 ms from 10 s
        now[0] = float(second)
        seconds, steps = total[0]
        total[0] = (seconds + 10 * (0.02 if second <= 10 else 0.04), steps + 10)
        readings.append(wait.micros())
    assert readings[:10] == [20_000] * 10
    assert 20_000 < readings[14] < 40_000  # the window holds both
    assert readings[-1] == 40_000  # a full window at 40 ms
    now[0] += 60.0  # no step since: idle, not the last steps' wait
    assert wait.micros() == 0


def test_attention_leases_carry_the_expert_wait_when_measured() -> None:
    settings = LeaseSettings(
        "m-attention-abc", "ns", "m-attention", 1, 3, component=contract.ATTENTION_COMPONENT
    )
    measured = lease_body(settings, datetime.now(UTC), 3, 0, expert_wait_micros=61_500)
    assert measured["metadata"]["annotations"][contract.EXPERT_WAIT_ANNOTATION] == "61500"
    assert (
        contract.EXPERT_WAIT_ANNOTATION
        not in lease_body(settings, datetime.now(UTC), 3, 0)["metadata"]["annotations"]
    )


def test_token_rate_is_routed_entries_per_second_over_a_window() -> None:
    """An expert server's load as its Lease carries it for ``metric: tokenRate``: (token, expert)
    entries per second over the last 10 s, however long its batches took."""
    from eaas.runtime.lease import TokenRate

    now, tokens = [0.0], [0.0]
    rate = TokenRate(lambda: tokens[0], window_s=10.0, clock=lambda: now[0])
    assert rate.per_second() == 0  # one reading: no rate yet
    readings = []
    for second in range(1, 31):  # 1 s heartbeats: 300 entries a second, then 600 from 10 s
        now[0] = float(second)
        tokens[0] += 300.0 if second <= 10 else 600.0
        readings.append(rate.per_second())
    assert readings[:10] == [300] * 10
    assert 300 < readings[14] < 600  # the window holds both
    assert readings[-1] == 600
    now[0] += 60.0  # idle since: the whole gap counts
    assert rate.per_second() == 0


def test_expert_server_leases_carry_the_token_rate_when_measured() -> None:
    settings = LeaseSettings("m-experts-0", "ns", "m-experts", 1, 3)
    measured = lease_body(settings, datetime.now(UTC), 3, 500, tokens_per_second=1234)
    assert measured["metadata"]["annotations"][contract.TOKEN_RATE_ANNOTATION] == "1234"
    assert (
        contract.TOKEN_RATE_ANNOTATION
        not in lease_body(settings, datetime.now(UTC), 3, 500)["metadata"]["annotations"]
    )


def test_attention_leases_carry_the_p99_time_per_output_token_of_the_window() -> None:
    """What ``metric: tokenRate`` learns its target from: the p99 (nearest rank) of the finished
    requests' time per output token over the last 30 s; none finished, no reading, and a renewal
    drops the previous one (an old reading must not pass for the present)."""
    from eaas.runtime.lease import RecentP99

    now = [0.0]
    recent = RecentP99(window_s=30.0, clock=lambda: now[0])
    assert recent.micros() is None
    for i in range(100):
        recent.record(0.010 + 0.001 * i)  # 10 ... 109 ms
    assert recent.micros() == 108_000  # the 99th of 100
    now[0] = 31.0
    recent.record(0.020)
    assert len(recent._samples) == 1  # forgotten on record too: no reader needed to bound memory
    assert recent.micros() == 20_000  # the old ones left the window
    settings = LeaseSettings(
        "m-attention-abc", "ns", "m-attention", 1, 3, component=contract.ATTENTION_COMPONENT
    )
    measured = lease_body(settings, datetime.now(UTC), 3, 0, tpot_micros=20_000)
    assert measured["metadata"]["annotations"][contract.TPOT_ANNOTATION] == "20000"
    renewed = lease_body(settings, datetime.now(UTC), 3, 0, previous=measured)
    assert contract.TPOT_ANNOTATION not in renewed["metadata"]["annotations"]


# --- telling at once ------------------------------------------------------------------------------
class CountingHeartbeat(Heartbeat):
    """A Heartbeat whose renewals are counted instead of written (`failing`: each one raises)."""

    def __init__(self, interval_s: float, failing: bool = False) -> None:
        super().__init__(LeaseSettings("a-0", "ns", "a", interval_s, interval_s * 3), lambda: 1, lambda: 0.0)
        self.times: list[float] = []
        self.failing = failing

    def beat(self) -> None:
        self.times.append(time.monotonic())
        if self.failing:
            raise OSError("the API server is away")


def within(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_nudge_renews_at_once_not_at_the_next_interval() -> None:
    """A client's failover (or a server's loaded placement) reaches its Lease now; the interval
    still paces the renewals otherwise."""
    with CountingHeartbeat(interval_s=30.0) as beats:
        assert within(lambda: len(beats.times) == 1, 5)  # the first renewal: at start
        nudged = time.monotonic()
        beats.nudge()
        assert within(lambda: len(beats.times) == 2, 5)
        assert beats.times[1] - nudged < 1.0
        time.sleep(0.3)
        assert len(beats.times) == 2  # nothing more until the interval or the next nudge


def test_a_nudge_does_not_hurry_the_backoff_after_api_errors() -> None:
    with CountingHeartbeat(interval_s=30.0, failing=True) as beats:
        assert within(lambda: len(beats.times) == 1, 5)  # failed: the next try after 0.5 s
        beats.nudge()
        beats.nudge()
        assert within(lambda: len(beats.times) == 2, 5)
        assert beats.times[1] - beats.times[0] >= MIN_RETRY_S - 0.02
