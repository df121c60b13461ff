# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
"""Drills on the whole system: the operator's pods really run (:mod:`e2e.podrunner`), requests flow
through the AttentionPool's Service (kube-proxy), clients find expert servers by DNS (CoreDNS).

Each drill keeps a load generator running and asserts: no failed request, every answer identical to
the single-process reference model, and it prints the interruption (the longest gap between two
streamed chunks of any request during the drill, against the same before it) and the time until the
pool is back to full R. docs/benchmarks.md records what they printed.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane
from e2e.operator.conftest import Release
from e2e.operator.harness import OperatorProcess
from e2e.operator.system.conftest import pod_logs
from e2e.operator.system.workload import (
    API_KEY,
    ATTENTION,
    CONNECTION_ERRORS,
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
    System,
    completions_equal_reference,
    deploy,
    longest_gap,
    pod_url,
    retried,
    sigkill_drill,
    sigstop_drill,
    stream_completion,
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
        Load(pod_url(other, "http"), system.model) as steady,
        Load(pod_url(doomed, "http"), system.model, timeout=10) as lost,
    ):
        wait_until(
            lambda: steady.completed_since(0) >= 2 and lost.completed_since(0) >= 2, 120, "requests before"
        )
        before_start = time.monotonic()
        time.sleep(3)
        lost.stop_new()  # what was sent to the doomed pod is in flight; nothing more is sent there
        struck = time.monotonic()
        os.kill(pid, signal.SIGKILL)
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
        f"longest gap {during:.2f} s (before: {baseline:.2f} s); killed pod: {len(in_flight)} in flight "
        f"failed ({sorted({o.error.split(':')[0] for o in in_flight})}), retried through the Service: "
        f"all succeeded; replacement serving after {replaced:.1f} s; one slot per client after "
        f"{slots_back:.1f} s"
    )
    assert during < baseline + 1.0


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
    than R Ready replicas of any expert, placements committed one server at a time. Then a chosen
    middle ordinal is retired: a replacement comes in first, then only that server leaves."""
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
        took["3 -> 4"] = scale(4)
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
    for (v1, before), (v2, now) in itertools.pairwise(watch.commits):
        assert len(set(before) ^ set(now)) <= 1, (
            f"v{v1} {before} -> v{v2} {now}: more than one server at once"
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
    assert identities() == pods_before, "a pod was replaced or restarted because of the outage"
    assert committed_version() == version_before, "the placement changed because of the outage"
    started = time.monotonic()
    system.scale_attention(1)  # the operator acts again (and the drills go on with one attention pod)
    resumed = time.monotonic() - started
    # Until this change was carried out (a patch of a verb the 403s named), a 403 may be the
    # restarted API server's cold RBAC cache; a missing grant would have failed the change.
    system_operator.forbidden_grace.append((outage, time.time()))

    def service_answers() -> bool:  # kube-proxy has caught up too: the Service routes to live pods
        for _ in range(6):
            request = urllib.request.Request(
                f"{system.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
            )
            with urllib.request.urlopen(request, timeout=5):
                pass
        return True

    wait_until(service_answers, 60, "the Service routing to the serving pod only", ignore=(OSError,))
    system.check(load.outcomes)
    during = longest_gap(load.outcomes, struck, end)
    baseline = longest_gap(load.outcomes, before_start, struck)
    print(
        f"\ndrill 8 (kube-apiserver down {unreachable:.1f} s): {len(load.outcomes)} requests, 0 failed, "
        f"{served_while_down} completed while it was down; longest gap {during:.2f} s (before: "
        f"{baseline:.2f} s); no pod or placement changed; RBAC authorizing again {rbac_back:.1f} s after "
        f"its return; a change afterwards done in {resumed:.1f} s"
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
    for name in (POOL, ATTENTION):
        service = cluster.core.read_namespaced_service(name, namespace)
        state[f"service/{name}"] = (service.metadata.resource_version,)
    deployment = cluster.apps.read_namespaced_deployment(ATTENTION, namespace)
    state[f"deployment/{ATTENTION}"] = (
        deployment.metadata.generation,
        api.sanitize_for_serialization(deployment.spec),
    )
    state["configmap/placement"] = cluster.core.read_namespaced_config_map(
        f"{POOL}-placement", namespace
    ).data
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
