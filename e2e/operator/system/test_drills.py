# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
"""Drills on the whole system: the operator's pods really run (:mod:`e2e.podrunner`), requests flow
through the AttentionPool's Service (kube-proxy), clients find expert servers by DNS (CoreDNS).

Each drill keeps a load generator running and asserts: no failed request, every answer identical to
the single-process reference model, and it prints the interruption (the longest gap between two
streamed chunks of any request during the drill, against the same before it) and the time until the
pool is back to full R. docs/benchmarks.md records what they printed.

Drills 9-11 are the disruptions on purpose: SIGTERM of an expert server, of an
attention pod, and `kubectl drain` of a node, where nothing may fail and R may never break (a
server that received SIGTERM counts while it still serves). Drill 14, a new model revision rolled
out blue/green, comes last: the MoEService serves another checkpoint after it.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane
from e2e.operator.conftest import Release
from e2e.operator.harness import OperatorProcess
from e2e.operator.system.conftest import pod_logs
from e2e.operator.system.workload import (
    ATTENTION,
    CONNECTION_ERRORS,
    CRASH_STALL_S,
    GROUP,
    NAME,
    POOL,
    PROMPTS,
    REPLICATION,
    SKEWED,
    VERSION,
    Load,
    Outcome,
    ReplicaWatch,
    Starts,
    System,
    completions_equal_reference,
    crash_stall,
    deploy,
    gap_story,
    longest_gap,
    pod_url,
    reference_texts,
    retried,
    sigkill_drill,
    sigstop_drill,
    stream_completion,
    waits,
)
from e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def system(
    cluster: Cluster, process_plane: ControlPlane, node_checkpoint: Path, system_operator: OperatorProcess
) -> Iterator[System]:
    """Drill 1: `kubectl apply` the tiny MoEService → Ready → completions through the Service equal
    the reference."""
    with deploy(cluster, process_plane, node_checkpoint, system_operator, "drills") as deployed:
        yield deployed


def test_completions_through_the_service_equal_the_reference(system: System) -> None:
    completions_equal_reference(system)


def test_sigkill_of_an_expert_server_loses_no_request(system: System) -> None:
    """Drill 2: a crashed server; its replicas take its share at once, the kubelet restarts it."""
    sigkill_drill(system)


def test_sigstop_of_an_expert_server_loses_no_request(system: System) -> None:
    """Drill 3: a hung server; clients time it out, its Lease expires and the operator re-places
    its experts, deletes the pod and brings a replacement in."""
    sigstop_drill(system)


def test_kill_of_an_attention_pod_fails_only_its_in_flight_requests(system: System) -> None:
    """Drill 4: one of two attention pods SIGKILLed (and force-deleted, as a lost node's pod is):
    requests on the other pod are unaffected; only the dead pod's in-flight requests fail, with a
    connection error, and a retry through the Service succeeds; its replacement serves; the expert
    servers' attached slots return to one per live client."""
    system.scale_attention(2)
    wait_until(lambda: set(system.attached_slots().values()) == {2}, 60, "2 clients on every expert server")
    doomed, other = system.attention_pods()
    pid = system.pid_of(doomed)
    with (
        Starts(system) as starts,
        Load(pod_url(other, "http"), system.model) as steady,
        Load(pod_url(doomed, "http"), system.model, timeout=10) as lost,
    ):
        wait_until(
            lambda: steady.completed_since(0) >= 2 and lost.completed_since(0) >= 2, 120, "requests before"
        )
        before_start = time.monotonic()
        time.sleep(3)
        lost.stop_new()  # what was sent to the doomed pod is in flight; nothing more is sent there
        os.kill(pid, signal.SIGKILL)
        struck = time.monotonic()  # after the kill: a request that ended just before it ended whole
        system.cluster.core.delete_namespaced_pod(
            doomed.metadata.name, system.namespace, grace_period_seconds=0
        )
        wait_until(lost.all_done, 90, "the dead pod's requests to end")
        try:
            wait_until(
                lambda: (
                    system.attention_serving(2)
                    and doomed.metadata.uid not in {p.metadata.uid for p in system.attention_pods()}
                ),
                180,
                "the replacement attention pod serving",
            )
            replaced = time.monotonic() - struck
            wait_until(
                lambda: set(system.attached_slots().values()) == {2},
                60,
                "one slot per live client on each server",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, system.namespace)}") from None
        slots_back = time.monotonic() - struck
        back = time.monotonic()
        wait_until(lambda: steady.completed_since(back) >= 2, 120, "requests on the other pod after")
    system.check(steady.outcomes)  # the other pod: nothing failed, identical answers
    during = longest_gap(steady.outcomes, struck, time.monotonic())
    split = waits(steady.outcomes, struck, time.monotonic(), starts)
    baseline = longest_gap(steady.outcomes, before_start, struck)
    in_flight = [o for o in lost.outcomes if o.done_at > struck]
    finished_before = [o for o in lost.outcomes if o.done_at <= struck]
    system.check(finished_before)
    assert in_flight, "no request was in flight on the killed pod"
    for outcome in in_flight:
        assert outcome.error and any(kind in outcome.error for kind in CONNECTION_ERRORS), outcome
    retries = [retried(system.url, system.model, o.prompt) for o in in_flight]
    system.check(retries)
    replacement = next(p for p in system.attention_pods() if p.metadata.name != other.metadata.name)
    system.check([stream_completion(pod_url(replacement, "http"), system.model, Outcome(PROMPTS[0]))])
    print(
        f"\ndrill 4 (attention pod killed): other pod {len(steady.outcomes)} requests, 0 failed, "
        f"longest gap {during:.2f} s (before: {baseline:.2f} s; {split.story()}); killed pod: "
        f"{len(in_flight)} in flight "
        f"failed ({sorted({o.error.split(':')[0] for o in in_flight})}), retried through the Service: "
        f"all succeeded; replacement serving after {replaced:.1f} s; one slot per client after "
        f"{slots_back:.1f} s"
    )
    split.check(baseline, other=1.0)


def test_hung_attention_pod_loses_its_slots_to_its_lease(system: System) -> None:
    """Drill 4b: one of two attention pods SIGSTOPped (hung: its TCP connections stay open, so only
    its Lease can tell): every expert server frees its slot once the Lease expires, counted as
    ``lease_expired``; the other pod is unaffected; after SIGCONT the resumed client attaches again
    and serves answers identical to the reference."""
    system.scale_attention(2)
    wait_until(lambda: set(system.attached_slots().values()) == {2}, 60, "2 clients on every expert server")
    hung, other = system.attention_pods()
    pid = system.pid_of(hung)
    reaped_before = system.reaped_slots("lease_expired")
    with Load(pod_url(other, "http"), system.model) as steady:
        wait_until(lambda: steady.completed_since(0) >= 2, 120, "requests before")
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: set(system.attached_slots().values()) == {1}, 30, "the hung client's slots freed"
            )
            freed = time.monotonic() - stopped
            reaped_after = system.reaped_slots("lease_expired")
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        first = stream_completion(pod_url(hung, "http"), system.model, Outcome(PROMPTS[1]))
        try:
            wait_until(
                lambda: set(system.attached_slots().values()) == {2}, 60, "the resumed client attached again"
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, system.namespace)}") from None
        reattached = time.monotonic() - resumed
        again = stream_completion(pod_url(hung, "http"), system.model, Outcome(PROMPTS[2]))
        back = time.monotonic()
        wait_until(lambda: steady.completed_since(back) >= 2, 120, "requests on the other pod after")
    system.check(steady.outcomes)
    assert {name: reaped_after[name] - reaped_before.get(name, 0) for name in reaped_after} == dict.fromkeys(
        reaped_after, 1.0
    ), (reaped_before, reaped_after)
    print(
        f"\ndrill 4b (attention pod hung): its slots freed by Lease expiry after {freed:.1f} s (Lease "
        f"5 s) on all {len(reaped_after)} servers; other pod {len(steady.outcomes)} requests, 0 failed; "
        f"first request after SIGCONT: {first.error or 'ok'}; attached again after {reattached:.1f} s"
    )
    system.check([first, again])
    assert freed < 5 + 2 * 1 + 2  # the Lease's duration, two listing intervals, the metrics' refresh


def test_scale_and_retire_under_load_never_go_below_r(system: System) -> None:
    """Drill 6: `kubectl scale expertpool` 3 -> 4 -> 2 (and back to 3) under load: never fewer
    than R Ready replicas of any expert, each placement change at most doubling or halving the
    pool (the default ``maxServersPerChange``: 4 -> 2 is one change). Then a chosen middle ordinal
    is retired: a replacement comes in first, then only that server leaves."""
    pool_path = f"expertpool/{POOL}"
    ns = system.namespace

    def mode(value: str) -> None:
        patch = {"spec": {"autoscaling": {"mode": value}}}
        system.cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME, patch)

    def scale(replicas: int) -> float:
        started = time.monotonic()
        system.cluster.kubectl("scale", pool_path, f"--replicas={replicas}", "-n", ns)
        try:
            wait_until(
                lambda: system.full_strength(replicas) and len(committed_ordinals()) == replicas,
                240,
                f"the pool at {replicas} servers",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        return time.monotonic() - started

    def committed_ordinals() -> tuple[int, ...]:
        placement, pending = system.placement()
        return () if pending else placement.ordinals

    moe: Any = system.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME)
    original_mode = moe["spec"]["autoscaling"]["mode"]
    mode("external")  # `kubectl scale` is then the one writer of the pool's replicas
    wait_until(lambda: system.full_strength(3), 60, "the pool settled at 3")
    took = {}
    with ReplicaWatch(system) as watch, Load(system.url, system.model) as load:
        wait_until(lambda: load.completed_since(0) >= 2, 120, "requests before")
        serving = {p.metadata.name for p in system.expert_pods()}
        took["3 -> 4"] = scale(4)
        (added,) = {p.metadata.name for p in system.expert_pods()} - serving
        # The new server took every expert it hosts from the servers that held them (weights from
        # peers), none from the checkpoint.
        log = system.server_log(added)
        assert re.search(r"fetched \d+ experts from \d+ peer\(s\).*; 0 from the checkpoint", log), log[-3000:]
        took["4 -> 2"] = scale(2)
        took["2 -> 3"] = scale(3)
        uids = {p.metadata.name: p.metadata.uid for p in system.expert_pods()}
        ordinals = sorted(int(name.rsplit("-", 1)[1]) for name in uids)
        victim = f"{POOL}-{ordinals[1]}"  # the middle one of three (which ones depends on earlier drills)
        started = time.monotonic()
        system.cluster.kubectl("annotate", "pod", victim, "eaas.io/retire=true", "-n", ns)
        again = system.cluster.kubectl(  # asked twice: the same retirement, nothing more
            "annotate", "pod", victim, "eaas.io/retire=true", "--overwrite", "-n", ns, check=False
        )
        assert again.returncode == 0 or "NotFound" in again.stderr, again.stderr
        wait_until(
            lambda: (
                victim not in {p.metadata.name for p in system.expert_pods()}
                and system.full_strength(3)
                and len(committed_ordinals()) == 3
            ),
            240,
            "the retired server gone and the pool at 3 again",
        )
        took[f"retire {victim}"] = time.monotonic() - started
        back = time.monotonic()
        wait_until(lambda: load.completed_since(back) >= 2, 120, "requests after")
    after = {p.metadata.name: p.metadata.uid for p in system.expert_pods()}
    mode(original_mode)
    system.check(load.outcomes)
    stayed = {name: uid for name, uid in uids.items() if name != victim}
    assert {name: after.get(name) for name in stayed} == stayed  # only the chosen server left
    assert len(after) == 3 and victim not in after
    fewest = min(f for _, _, f in watch.fewest)
    assert fewest >= REPLICATION, [s for s in watch.fewest if s[2] < REPLICATION][:5]
    for (v1, before), (v2, now) in watch.steps():
        added, removed = set(now) - set(before), set(before) - set(now)
        assert len(added) <= len(before) and len(removed) <= max(1, len(before) // 2), (
            f"v{v1} {before} -> v{v2} {now}: more than doubled or halved at once"
        )
    print(
        f"\ndrill 6 (scale 3->4->2->3, retire {victim}): {len(load.outcomes)} requests, 0 failed; "
        + ", ".join(f"{step} in {seconds:.1f} s" for step, seconds in took.items())
        + f"; fewest Ready replicas of any expert over {len(watch.fewest)} samples: {fewest}; committed "
        + " -> ".join(f"v{v}{list(o)}" for v, o in watch.commits)
    )


def test_api_server_outage_under_load(
    system: System, system_operator: OperatorProcess, release: Release
) -> None:
    """Drill 8: the kube-apiserver stopped for 30 s under load. The data path does not need it:
    no request fails and decoding does not stall. When it returns every Lease looks 30 s old, yet
    nothing is re-placed or restarted (the operator suspects its own view when most servers go
    silent together), and the operator resumes: a change made afterwards is carried out."""
    system.scale_attention(2)
    wait_until(lambda: system.full_strength(3), 120, "the pool settled")

    def identities() -> dict[str, str]:
        return {p.metadata.name: p.metadata.uid for p in [*system.expert_pods(), *system.attention_pods()]}

    def committed_version() -> int:
        return system.placement()[0].version

    pods_before, version_before = identities(), committed_version()
    with Load(system.url, system.model) as load:
        wait_until(lambda: load.completed_since(0) >= 2, 120, "requests before")
        before_start = time.monotonic()
        time.sleep(3)
        struck, outage = time.monotonic(), time.time()
        unreachable = system.plane.api_server_down(30)
        returned = time.monotonic()
        # Just started, the kube-apiserver answers 403 to what the chart grants until its RBAC
        # caches are filled: the operator retries meanwhile (its 403s then are not the chart's
        # fault), and the drill requires that it carries out a change afterwards.
        account = f"system:serviceaccount:{release.namespace}:{release.service_account}"
        wait_until(
            lambda: (
                system.cluster.kubectl(
                    "auth",
                    "can-i",
                    "patch",
                    "deployments.apps",
                    "-n",
                    system.namespace,
                    "--as",
                    account,
                    check=False,
                ).stdout.strip()
                == "yes"
            ),
            120,
            "the restarted kube-apiserver to authorize the operator again",
        )
        rbac_back = time.monotonic() - returned
        served_while_down = load.completed_since(struck) - load.completed_since(returned)
        time.sleep(10)  # the operator's first passes after the outage, on Leases that looked expired
        system_operator.check_alive()
        wait_until(lambda: load.completed_since(returned) >= 2, 120, "requests after")
        end = time.monotonic()
    events = system.cluster.kubectl(
        "get", "events", "-n", system.namespace, "--sort-by=.lastTimestamp", check=False
    ).stdout
    assert identities() == pods_before, (
        f"a pod was replaced or restarted because of the outage\n{events[-4000:]}\n"
        f"{system_operator.log_tail()}"
    )
    assert committed_version() == version_before, "the placement changed because of the outage"
    started = time.monotonic()
    # The operator acts again (and the drills go on with one attention pod); the wait ends once
    # kube-proxy routes the Service to the remaining pod only, which after the outage can take up
    # to a minute (its informers' backoff, see System.wait_routed).
    routed = system.scale_attention(1)
    resumed = time.monotonic() - started - routed  # the operator and the controllers: not kube-proxy
    # Until this change was carried out (a patch of a verb the 403s named), a 403 may be the
    # restarted API server's cold RBAC cache; a missing grant would have failed the change.
    system_operator.forbidden_grace.append((outage, time.time()))
    # Through the Service now, every request reaches the serving pod: none is retried.
    after = [stream_completion(system.url, system.model, Outcome(prompt)) for prompt in PROMPTS]
    system.check(after)
    system.check(load.outcomes)
    during = longest_gap(load.outcomes, struck, end)
    baseline = longest_gap(load.outcomes, before_start, struck)
    print(
        f"\ndrill 8 (kube-apiserver down {unreachable:.1f} s): {len(load.outcomes)} requests, 0 failed, "
        f"{served_while_down} completed while it was down; longest gap {during:.2f} s (before: "
        f"{baseline:.2f} s); no pod or placement changed; RBAC authorizing again {rbac_back:.1f} s after "
        f"its return; a change afterwards done in {resumed:.1f} s, kube-proxy routing the Service to the "
        f"serving pod only {routed:.1f} s after its EndpointSlice; {len(after)} requests through it after"
    )
    assert served_while_down >= 2
    assert during < baseline + 1.0


def test_skewed_load_is_rebalanced(system: System) -> None:
    """Drill 7: one prompt asked over and over keeps its tokens on a few experts. With load-based
    rebalancing turned on, the operator measures the skew (and what a token costs on these
    servers), publishes a placement that moves experts (the `Rebalanced` event), and the measured
    per-server load evens out: summed over layers, the busiest server's tokens over the mean
    server's (what the planner minimises: each layer waits for its busiest server) falls. No
    request fails, every answer stays the reference's."""
    ns = system.namespace
    wait_until(lambda: system.full_strength(3), 120, "the pool settled")

    def interval(seconds: int) -> None:
        patch = {"spec": {"placement": {"rebalanceIntervalSeconds": seconds}}}
        system.cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME, patch)

    def committed() -> tuple[int, bool]:
        placement, pending = system.placement()
        return placement.version, pending

    def layer_tokens() -> dict[str, list[int]]:
        """Per server: the tokens it has computed for each MoE layer (from its /v1/stats)."""
        counts = {}
        for pod in system.expert_pods():
            stats = json.loads(
                urllib.request.urlopen(f"{pod_url(pod, 'control')}/v1/stats", timeout=5).read()
            )
            counts[f"{pod.metadata.name}/{stats['instance']}"] = [sum(row) for row in stats["tokens"]]
        return counts

    def imbalance(seconds: float) -> tuple[float, list[int]]:
        """What the planner minimises, measured over the next `seconds`: each layer waits for its
        busiest server, so sum over layers of the busiest server's tokens / of the mean server's
        (1.0 = even); and each server's tokens in the window."""
        start = layer_tokens()
        time.sleep(seconds)
        end = layer_tokens()
        window = [[b - a for a, b in zip(start[n], end[n], strict=True)] for n in sorted(start) if n in end]
        layers = list(zip(*window, strict=True))  # per layer, each server's tokens
        busiest = sum(max(per_server) for per_server in layers)
        mean = sum(sum(per_server) / len(per_server) for per_server in layers)
        return busiest / mean, [sum(server) for server in window]

    def rebalanced_events() -> list[Any]:
        events = system.cluster.core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={POOL},reason=Rebalanced"
        )
        return events.items

    version, _ = committed()
    with Load(system.url, system.model, prompts=(SKEWED,)) as load:
        wait_until(lambda: load.completed_since(0) >= 2, 120, "skewed requests before")
        before, rates_before = imbalance(20)
        enabled = time.monotonic()
        interval(10)  # on: a baseline scrape, a window of 10 s, then a plan
        try:
            wait_until(
                lambda: committed()[0] > version and not committed()[1] and rebalanced_events(),
                150,
                "a rebalanced placement committed",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        took = time.monotonic() - enabled
        interval(0)  # off again: what follows is measured on that one placement
        after, rates_after = imbalance(20)
    system.check(load.outcomes)
    event = rebalanced_events()[-1]
    print(
        f"\ndrill 7 (skewed prompt): {len(load.outcomes)} requests, 0 failed; Rebalanced after "
        f"{took:.1f} s: {event.message}; tokens per server in 20 s before {rates_before}, busiest/mean "
        f"server summed over layers {before:.2f}; after {rates_after}, {after:.2f}"
    )
    assert "measured" in event.message
    assert after < before


# the servers' busy fraction and routed tokens per second: they follow the load, not the operator
LIVE_STATUS = ("utilizationMilli", "tokensPerSecond")


def owned_state(system: System) -> dict[str, Any]:
    """What the operator decides, of every object it owns: the three kinds (status less the live
    load), the pods (identity, labels, annotations, spec: their status is the kubelet's), the
    Services, the Deployment and the placement ConfigMap."""
    cluster, namespace = system.cluster, system.namespace
    api = cluster.api_client
    state: dict[str, Any] = {}
    for plural, name in (("moeservices", NAME), ("attentionpools", ATTENTION), ("expertpools", POOL)):
        obj: Any = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        status = {k: v for k, v in (obj.get("status") or {}).items() if k not in LIVE_STATUS}
        state[f"{plural}/{name}"] = (obj["spec"], status, obj["metadata"].get("annotations"))
    for pod in cluster.core.list_namespaced_pod(namespace, label_selector=f"eaas.io/moeservice={NAME}").items:
        meta = pod.metadata
        state[f"pod/{meta.name}"] = (
            meta.uid,
            meta.labels,
            meta.annotations,
            api.sanitize_for_serialization(pod.spec),
        )
    for name in (POOL, ATTENTION, NAME):
        service = cluster.core.read_namespaced_service(name, namespace)
        state[f"service/{name}"] = (service.metadata.resource_version,)
    deployment = cluster.apps.read_namespaced_deployment(ATTENTION, namespace)
    state[f"deployment/{ATTENTION}"] = (
        deployment.metadata.generation,
        api.sanitize_for_serialization(deployment.spec),
    )
    config_map = cluster.core.read_namespaced_config_map(f"{POOL}-placement", namespace)
    state["configmap/placement"] = (config_map.data, config_map.binary_data)
    return state


def test_operator_restart_under_load_changes_nothing(
    system: System, system_operator: OperatorProcess
) -> None:
    """Drill 5: the operator SIGKILLed and started again while requests flow: nothing it decides
    changes (objects, pods, placement; only the live load figure in the ExpertPool's status moves,
    as it does without a restart) and no request fails."""
    with Load(system.url, system.model, workers=2) as load:
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        wait_until(lambda: system.full_strength(3), 60, "the pool settled")
        before = owned_state(system)
        system_operator.kill()
        system_operator.start()
        system_operator.wait_started()
        restarted = time.monotonic()
        time.sleep(5)  # several resync periods of the new operator
        system_operator.check_alive()
        wait_until(lambda: load.completed_since(restarted) >= 4, 120, "requests after the restart")
        after = owned_state(system)
    changed = {key: (before[key], after.get(key)) for key in before if before[key] != after.get(key)}
    assert not changed, f"the restarted operator changed {changed}\n{system_operator.log_tail()}"
    assert before.keys() == after.keys()
    print(f"\ndrill 5 (operator restart): {len(load.outcomes)} requests, 0 failed, nothing changed")
    system.check(load.outcomes)


def served_throughout(watch: ReplicaWatch, struck: float) -> int:
    """The fewest serving replicas of any expert in the samples since `struck` (a leaving server
    counts while its process answers); fails naming the first samples below R (seconds after
    `struck`), and any attention pod that saw a server down (what a failover would show), with the
    ExpertPool's Events and the pods' logs."""
    system = watch.system
    samples = [s for s in watch.fewest if s[0] >= struck]
    assert samples, "the replica watch took no sample"
    fewest = min(f for _, _, f in samples)
    seen = [(round(t - struck, 1), pod, down) for t, pod, down in watch.client_down if t >= struck]
    if fewest < REPLICATION or seen:
        short = [(round(t - struck, 1), v, f) for t, v, f in samples if f < REPLICATION][:5]
        events = system.cluster.kubectl(
            "get", "events", "-n", system.namespace, "--sort-by=.lastTimestamp", check=False
        ).stdout
        raise AssertionError(
            f"below R: {short}; attention clients saw servers down: {seen[:5]}; committed "
            f"{watch.commits}\n{events[-5000:]}\n{pod_logs(system.plane, system.namespace)}"
        )
    return fewest


def settled(system: System, servers: int = 3) -> None:
    """The pool at full strength with no placement change in flight (a drill strikes a still pool)."""
    wait_until(
        lambda: system.full_strength(servers) and not system.placement()[1],
        120,
        "the pool settled, no change pending",
    )


def test_sigterm_of_an_expert_server_hands_its_experts_over_before_it_goes(system: System) -> None:
    """Drill 9: `kubectl delete pod` of an expert server under load (SIGTERM, as an eviction or a
    drain sends). It serves on, its Lease announces the departure, the operator moves its experts
    to the others (R kept) and commits; the server exits once no client routes to it, and the pool
    grows back to 3. No client ever loses a server, no request fails or stalls."""
    ns = system.namespace
    settled(system)
    victim = system.expert_pods()[1]
    name, uid = victim.metadata.name, victim.metadata.uid
    gone: list[float] = []

    def victim_gone() -> bool:
        if uid in {p.metadata.uid for p in system.expert_pods()}:
            return False
        if not gone:
            gone.append(time.monotonic())
        return True

    with (
        ReplicaWatch(system, serving=True) as watch,
        Starts(system) as starts,
        Load(system.url, system.model) as load,
    ):
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        before_start = time.monotonic()
        time.sleep(3)
        struck = time.monotonic()
        system.cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
        try:
            wait_until(
                lambda: victim_gone() and system.full_strength(3), 180, "the victim gone, the pool at 3"
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        whole = time.monotonic() - struck
        back = time.monotonic()
        wait_until(lambda: load.completed_since(back) >= 4, 120, "requests after the drill")
    system.check(load.outcomes)
    fewest = served_throughout(watch, struck)
    ordinal = int(name.rsplit("-", 1)[1])
    without = next(
        (
            t
            for t, (_, o) in zip(watch.commit_times, watch.commits, strict=True)
            if t > struck and ordinal not in o
        ),
        None,
    )
    during = longest_gap(load.outcomes, struck, time.monotonic())
    baseline = longest_gap(load.outcomes, before_start, struck)
    assert without is not None, watch.commits
    handover = longest_gap(load.outcomes, struck, without)
    story = gap_story(load.outcomes, struck, time.monotonic(), struck)
    split = waits(load.outcomes, struck, time.monotonic(), starts)
    log = "\n".join(
        p.read_text(errors="replace") for p in system.plane.pod_dir.glob(f"{ns}_{name}_{uid[:8]}*/*.log")
    )
    print(
        f"\ndrill 9 (SIGTERM of {name}: kubectl delete pod): {len(load.outcomes)} requests, 0 failed; "
        f"longest gap until the placement without it was committed ({without - struck:.1f} s) "
        f"{handover:.2f} s, over the whole drill {during:.2f} s ({story}; {split.story()}) "
        f"(before: {baseline:.2f} s); fewest serving replicas {fewest}, no client saw a server "
        f"down; the server exited after {gone[0] - struck:.1f} s, pool at 3 again after {whole:.1f} s"
    )
    assert "no placement names this server and no client holds a slot; exiting" in log, log[-3000:]
    # Target: 0.2 s over the machine's jitter. Here the replacement server starts (an interpreter
    # and torch, seconds of CPU) on the same two cores as everything else: the handover is held to
    # the crash path's bound, the rest of the drill to the recovery's (START_STALL_S while a pod
    # starts); docs/benchmarks.md records them.
    assert handover < baseline + CRASH_STALL_S
    split.check(baseline)


def test_sigterm_of_an_attention_pod_finishes_its_requests(system: System) -> None:
    """Drill 10: `kubectl delete pod` of one of two attention pods under load through the Service.
    It turns unready (out of the Service), answers what it has and what still reaches it, and exits
    when nothing is in flight: every request, on it or through the Service, succeeds."""
    ns = system.namespace
    system.scale_attention(2)
    victim, _ = system.attention_pods()
    with Load(system.url, system.model) as through, Load(pod_url(victim, "http"), system.model) as direct:
        wait_until(
            lambda: through.completed_since(0) >= 2 and direct.completed_since(0) >= 2, 120, "requests before"
        )
        direct.stop_new()  # what was sent to the victim is in flight; nothing more is sent there
        struck = time.monotonic()
        system.cluster.kubectl("delete", "pod", victim.metadata.name, "-n", ns, "--wait=false")
        wait_until(direct.all_done, 90, "the leaving pod's requests to end")
        try:
            wait_until(
                lambda: (
                    system.attention_serving(2)
                    and victim.metadata.uid not in {p.metadata.uid for p in system.attention_pods(True)}
                ),
                180,
                "the victim gone and a replacement serving",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        replaced = time.monotonic() - struck
        back = time.monotonic()
        wait_until(lambda: through.completed_since(back) >= 2, 120, "requests through the Service after")
    in_flight = [o for o in direct.outcomes if o.done_at > struck]
    assert in_flight, "no request was in flight on the leaving pod"
    system.check(direct.outcomes)  # the leaving pod finished what it had
    system.check(through.outcomes)
    log = "\n".join(
        p.read_text(errors="replace")
        for p in system.plane.pod_dir.glob(f"{ns}_{victim.metadata.name}_{victim.metadata.uid[:8]}*/*.log")
    )
    print(
        f"\ndrill 10 (SIGTERM of attention pod {victim.metadata.name}): {len(in_flight)} requests in "
        f"flight on it, all finished; {len(through.outcomes)} through the Service, 0 failed; gone and "
        f"replaced after {replaced:.1f} s"
    )
    assert "left: nothing in flight" in log, log[-3000:]


def test_kubectl_drain_of_a_node_with_two_expert_servers(system: System) -> None:
    """Drill 11: `kubectl drain` of the node that hosts two of the three expert servers, under
    load. Evictions go through the pools' PodDisruptionBudgets: the second expert server is
    evicted only once the first is replaced; each serves on until its experts are re-homed. R
    never broken, no client loses a server, no request fails."""
    ns = system.namespace
    system.scale_attention(2)  # the attention pods on the node are evicted too: one at a time
    settled(system)
    budgets = {
        b.metadata.name: b
        for b in client.PolicyV1Api(system.cluster.api_client).list_namespaced_pod_disruption_budget(ns).items
    }
    assert budgets[POOL].spec.min_available == 3 - (REPLICATION - 1), budgets[POOL].spec
    assert budgets[ATTENTION].spec.max_unavailable == 1, budgets[ATTENTION].spec
    hosts = collections.Counter(p.spec.node_name for p in system.expert_pods())
    node, count = hosts.most_common(1)[0]
    assert count >= 2, hosts  # three servers on two nodes
    on_node = {p.metadata.uid for p in system.expert_pods() if p.spec.node_name == node}
    with (
        ReplicaWatch(system, serving=True) as watch,
        Starts(system) as starts,
        Load(system.url, system.model) as load,
    ):
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        before_start = time.monotonic()
        time.sleep(3)
        struck = time.monotonic()
        try:
            drained = system.cluster.kubectl(
                "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
                timeout=330, check=False,
            )  # fmt: skip
            assert drained.returncode == 0, drained.stdout + drained.stderr
            took = time.monotonic() - struck
            wait_until(
                lambda: (
                    system.full_strength(3)
                    and not on_node & {p.metadata.uid for p in system.expert_pods()}
                    and system.attention_serving(2)
                ),
                180,
                "the pool at 3 on the other node",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        finally:
            system.cluster.kubectl("uncordon", node, check=False)
        whole = time.monotonic() - struck
        back = time.monotonic()
        wait_until(lambda: load.completed_since(back) >= 4, 120, "requests after the drill")
    system.check(load.outcomes)
    fewest = served_throughout(watch, struck)
    during = longest_gap(load.outcomes, struck, time.monotonic())
    baseline = longest_gap(load.outcomes, before_start, struck)
    story = gap_story(load.outcomes, struck, time.monotonic(), struck)
    split = waits(load.outcomes, struck, time.monotonic(), starts)
    refusals = (drained.stdout + drained.stderr).count("disruption budget")
    print(
        f"\ndrill 11 (kubectl drain {node}, {count} expert servers on it): {len(load.outcomes)} requests, "
        f"0 failed; longest gap {during:.2f} s ({story}; {split.story()}; before: {baseline:.2f} s); fewest "
        f"serving replicas "
        f"{fewest}, no client saw a server down; drain done after {took:.1f} s ({refusals} evictions "
        f"refused by a budget and retried); pool whole after {whole:.1f} s"
    )
    split.check(baseline)  # replacements start on these two cores (see drill 9)


def test_a_whole_node_lost_loses_no_request(system: System) -> None:
    """Drill 12: every expert server on one node SIGKILLed at once (its GPUs, or the node, gone),
    under load. The operator put every expert's replicas on distinct nodes once the pods were
    scheduled, so the servers on the other node hold a replica of everything: clients fail over,
    nothing fails, and the pool comes back to full R."""
    ns = system.namespace
    wait_until(lambda: system.full_strength(3), 120, "the pool settled")

    def spread_committed() -> bool:
        placement, pending = system.placement()
        nodes = {int(p.metadata.labels["eaas.io/ordinal"]): p.spec.node_name for p in system.expert_pods()}
        recorded = {server.ordinal: server.domain for server in placement.servers}
        return not pending and recorded == {n: nodes.get(n) for n in placement.ordinals}

    def nodes_in_use() -> int:
        return len({p.spec.node_name for p in system.expert_pods()})

    if nodes_in_use() < 2:  # an earlier drill (the drain) left every server on one node: move one
        moved = system.expert_pods()[0]
        system.cluster.kubectl("delete", "pod", moved.metadata.name, "-n", ns, "--wait=false")
        wait_until(
            lambda: (
                moved.metadata.uid not in {p.metadata.uid for p in system.expert_pods()}
                and system.full_strength(3)
                and nodes_in_use() >= 2
            ),
            180,
            "a server on each node",
        )
    wait_until(spread_committed, 120, "the placement recording the servers' nodes")
    placement, _ = system.placement()
    hosts = collections.Counter(p.spec.node_name for p in system.expert_pods())
    node, count = hosts.most_common(1)[0]
    victims = [p for p in system.expert_pods() if p.spec.node_name == node]
    lost = {int(p.metadata.labels["eaas.io/ordinal"]) for p in victims}
    survivors_hold_all = all(
        set(placement.servers_of(layer, e)) - lost
        for layer in placement.layers
        for e in range(placement.num_experts)
    )
    assert count >= 2 and survivors_hold_all, (hosts, placement.to_json())
    restarts = {p.metadata.uid: p.status.container_statuses[0].restart_count for p in victims}

    def recovered() -> bool:
        pods = {p.metadata.uid: p for p in system.expert_pods()}
        for uid, before in restarts.items():  # restarted in place, or replaced (a new UID)
            statuses = pods[uid].status.container_statuses or [] if uid in pods else []
            if uid in pods and (not statuses or statuses[0].restart_count <= before):
                return False
        return bool(system.full_strength(3))

    with ReplicaWatch(system) as watch, Starts(system) as starts, Load(system.url, system.model) as load:
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        before_start = time.monotonic()
        time.sleep(3)
        struck = time.monotonic()
        for pod in victims:
            os.kill(system.pid_of(pod), signal.SIGKILL)
        try:
            wait_until(recovered, 240, "the node's servers back and the pool at full R")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        whole = time.monotonic() - struck
        back = time.monotonic()
        wait_until(lambda: load.completed_since(back) >= 4, 120, "requests after the drill")
    system.check(load.outcomes)
    during = longest_gap(load.outcomes, struck, time.monotonic())
    crash = crash_stall(load.outcomes, struck)
    baseline = longest_gap(load.outcomes, before_start, struck)
    story = gap_story(load.outcomes, struck, time.monotonic(), struck)
    split = waits(load.outcomes, struck, time.monotonic(), starts)
    samples = [f for t, _, f in watch.fewest if t >= struck]
    print(
        f"\ndrill 12 (every expert server on {node} SIGKILLed: {sorted(lost)}): {len(load.outcomes)} "
        f"requests, 0 failed; longest wait at the strike {crash:.2f} s, over the whole drill {during:.2f} s "
        f"({story}; {split.story()}; before: {baseline:.2f} s); fewest Ready replicas of any expert "
        f"{min(samples)} (the "
        f"other node's server held one of each); pool at full R after {whole:.1f} s"
    )
    assert min(samples) >= 1  # never an expert without a Ready replica
    assert crash < baseline + CRASH_STALL_S  # as for one crashed server
    split.check(baseline)  # the replacements start on these two cores


def test_a_runtime_upgrade_rolls_one_server_at_a_time_and_a_revert_converges(system: System) -> None:
    """Drill 13: a new runtime image for both pools under load, reverted halfway. Expert servers
    are replaced one at a time: each outdated one is drained while it serves (the SIGTERM path)
    and a server of the new template joins; the attention Deployment rolls with surge, old pods
    finishing their requests. The revert rolls the new ones back the same way. No request fails,
    no client loses a server, R is never broken, and the pool ends on the original template."""
    ns = system.namespace
    system.scale_attention(2)
    wait_until(lambda: system.full_strength(3), 120, "the pool settled")
    moe: Any = system.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME)
    images = {pool: moe["spec"][pool]["image"] for pool in ("expertPool", "attentionPool")}
    original = {p.metadata.annotations["eaas.io/template-hash"] for p in system.expert_pods()}
    assert len(original) == 1, original

    def set_images(suffix: str) -> None:
        patch = {"spec": {pool: {"image": image + suffix} for pool, image in images.items()}}
        system.cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME, patch)

    def hashes() -> collections.Counter[str]:
        return collections.Counter(
            p.metadata.annotations["eaas.io/template-hash"] for p in system.expert_pods()
        )

    with ReplicaWatch(system, serving=True) as watch, Load(system.url, system.model) as load:
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        struck = time.monotonic()
        set_images("-upgrade")
        try:
            wait_until(
                lambda: any(h not in original for h, _ in hashes().items()) and system.full_strength(3),
                180,
                "a first server of the new template serving",
            )
            halfway = dict(hashes())
            reverted = time.monotonic()
            set_images("")  # the revert, mid-rollout
            wait_until(
                lambda: (
                    set(hashes()) == original
                    and system.full_strength(3)
                    and system.attention_serving(2)
                    and {p.spec.containers[0].image for p in system.attention_pods()}
                    == {images["attentionPool"]}
                ),
                300,
                "every pod back on the original template",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{pod_logs(system.plane, ns)}") from None
        converged = time.monotonic() - reverted
        back = time.monotonic()
        wait_until(lambda: load.completed_since(back) >= 4, 120, "requests after the drill")
    system.check(load.outcomes)
    fewest = served_throughout(watch, struck)
    status = system.expert_pool()
    assert status["status"]["observedGeneration"] == status["metadata"]["generation"]
    print(
        f"\ndrill 13 (runtime upgrade of both pools, reverted halfway at {reverted - struck:.1f} s with "
        f"template hashes {halfway}): {len(load.outcomes)} requests, 0 failed; fewest serving replicas "
        f"{fewest}, no client saw a server down; back on the original template after {converged:.1f} s; "
        f"committed placements {len(watch.commits)}"
    )


def test_a_model_revision_rolls_out_blue_green_and_no_answer_mixes_revisions(system: System) -> None:
    """Drill 14, a model revision rolled out blue/green: a new checkpoint of the same architecture
    (other weights) as revision ``r2``, under load through the MoEService's Service. The new pair of
    pools comes up beside the serving one; the Service moves to it when it is settled; the old attention pods
    finish their requests, then the old expert servers go. No request fails, every answer names
    one revision and equals that revision's reference, and both revisions answer."""
    ns, plane = system.namespace, system.plane
    settled(system)
    moe: Any = system.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME)
    first = moe["status"]["revision"]
    assert moe["status"]["servingSlot"] == "blue" and first.startswith("ckpt-")
    directory = plane.work_dir / "checkpoints" / "tiny-mixtral-r2"
    if not directory.exists():
        subprocess.run(
            [sys.executable, "-m", "eaas.runtime.cli", "model", "init", "--family", "mixtral",
             "--preset", "tiny", "--seed", "1", "--out", str(directory)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    expected = {first: system.expected, "r2": reference_texts(directory, list(PROMPTS))}
    assert expected["r2"] != {p: system.expected[p] for p in PROMPTS}, "the two revisions answer alike"

    def status() -> dict[str, Any]:
        obj: Any = system.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME)
        return obj.get("status") or {}

    def old_pods() -> list[Any]:
        return [
            p
            for p in system.cluster.core.list_namespaced_pod(
                ns, label_selector=f"eaas.io/moeservice={NAME}"
            ).items
            if p.metadata.labels.get("eaas.io/pool") in (POOL, ATTENTION)
        ]

    with Starts(system) as starts, Load(system.url, system.model) as load:
        wait_until(lambda: load.completed_since(0) >= 4, 120, "requests before the drill")
        struck = time.monotonic()
        patch = {"spec": {"model": {"checkpoint": {"hostPath": {"path": str(directory)}}, "revision": "r2"}}}
        system.cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "moeservices", NAME, patch)
        try:
            wait_until(
                lambda: status().get("rollout", {}).get("revision") == "r2", 30, "the rollout to start"
            )
            wait_until(
                lambda: status().get("servingSlot") == "green" and status().get("revision") == "r2",
                360,
                "the green pair of revision r2 serving",
            )
            switched = time.monotonic()
            wait_until(lambda: not old_pods() and "retiring" not in status(), 180, "the blue pair gone")
            gone = time.monotonic()
        except AssertionError as error:
            raise AssertionError(f"{error}\nstatus: {status()}\n{pod_logs(plane, ns)}") from None
        wait_until(lambda: load.completed_since(gone) >= 4, 120, "requests after the drill")
    failed = [o for o in load.outcomes if o.error]
    assert not failed, f"{len(failed)} failed requests, e.g. {failed[0]}\n{pod_logs(plane, ns)}"
    mixed = [o for o in load.outcomes if len(o.revisions) != 1]
    assert not mixed, f"{len(mixed)} answers without exactly one revision, e.g. {mixed[0]}"
    served = collections.Counter(next(iter(o.revisions)) for o in load.outcomes)
    assert set(served) == {first, "r2"}, served
    wrong = [o for o in load.outcomes if o.text != expected[next(iter(o.revisions))][o.prompt]]
    assert not wrong, f"answers differ from their revision's reference, e.g. {wrong[0]}"
    late = [o for o in load.outcomes if o.started > gone and o.revisions != {"r2"}]
    assert not late, f"{len(late)} requests started after the old pair went were not served by r2"
    before = longest_gap(load.outcomes, 0.0, struck)
    during = longest_gap(load.outcomes, struck, gone)
    story = gap_story(load.outcomes, struck, gone, struck)
    split = waits(load.outcomes, struck, gone, starts)
    experts = system.cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, ns, "expertpools", f"{NAME}-green-experts"
    )
    assert experts["spec"]["model"]["revision"] == "r2"
    print(
        f"\ndrill 14 (model revision {first} -> r2, blue/green): {len(load.outcomes)} requests, 0 failed, "
        f"each answered by one revision and equal to its reference ({dict(served)}); the green pair "
        f"served {switched - struck:.1f} s after the change, the blue pair gone {gone - switched:.1f} s "
        f"later; longest gap {during:.2f} s ({story}; {split.story()}; before: {before:.2f} s)"
    )
    # The green pair starts on the same two cores as the pair that serves (START_STALL_S then).
    # The blue pair's servers end without the interpreter's teardown (``end_process``): with it,
    # the waits while no pod started read 1.5-1.8 s here, as the blue pair went.
    split.check(before)
