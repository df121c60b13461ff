"""The ExpertPool's next step, decided from what is observed (pure; no API calls).

The reconciler calls :func:`plan` on every pass, applies the returned :class:`Step` and comes back
later; every step is small and safe to repeat, so a restarted operator picks up where the
ConfigMap and the pods say it is. The placement ConfigMap holds the committed placement (what
clients route by) and, during a change, the pending one (what servers load):

* **create**: publish the initial placement as pending, create pods ``0..N-1``.
* **scale up** (any number of GPUs, in batches): pending = committed + servers ``k..k+b-1``;
  create their pods. A batch holds at most ``maxServersPerChange`` servers (default: as many as
  are placed, so a change at most doubles the pool: 64 -> 320 in three changes); the new servers
  take equal shares from the others (:func:`eaas.operator.planning.add_servers`).
* **scale down** (highest ordinals first, in batches of the same bound, so a change at most
  halves the pool): pending = committed without those servers, their experts re-homed on the
  others (R kept); their pods are deleted only after that placement is committed.
* **retire** a server a person chose (pod annotation ``eaas.io/retire``): make before break —
  while the servers not retiring are fewer than ``replicas``, a replacement is added first; then
  the chosen server is drained like a scale-down and its pod deleted once that is committed.
  Kubernetes never picks the victim; marking the same pod again changes nothing.
* **commit**: once every server of the pending placement is ready for it (pod Ready, and its
  Lease, if it keeps one, reports that version loaded), pending becomes committed.
* **spread over nodes**: once every placed server's pod is scheduled and live, the committed
  placement records each server's node as its failure domain, and every expert's replicas cover
  ``min(R, nodes)`` nodes (:func:`eaas.operator.planning.spread`: the same assignment where it
  already does, else dealt again; a node with fewer servers gets the slots to hold its share). A
  whole node lost then leaves every expert a replica.
* **rebalance**: when nothing else is to be done and every server is live, a load-based proposal
  (:mod:`eaas.operator.rebalance`, passed in as ``Observed.rebalance``) becomes the pending
  placement, loaded and committed like any other change.
* **repair**: a missing pod of a placed server is recreated under the same name; pods whose
  template changed are replaced one at a time while all others are Ready.
* **release a leaving server** (make before break): a placed server whose pod is being deleted
  (``kubectl delete``, an eviction, a node drain) or whose Lease announces that it received
  SIGTERM keeps serving through its grace period (:mod:`eaas.runtime.server.departure`). Pending
  = the placement without it, its experts re-homed on the others (R kept), any change in flight
  abandoned; once that is committed the server exits on its own (no client routes to it any
  more), and the pool grows back to ``replicas`` (one scaling change). Survivors first rather
  than a replacement first: they load only a share of the leaving server's experts each, in
  parallel, which fits a grace period where a new server loading all of them may not. Where the
  survivors cannot hold R copies, a new server is added in that same pending placement (one
  change to load and commit); only if even that cannot keep R does it serve until it goes and is
  recreated in place.
* **re-place a lost server**: a placed server whose heartbeat stopped (its Lease expired, or its
  pod has not been Ready for longer than the heartbeat timeout, after it once served), or that
  its attention clients fail over while its control port refuses connections or stays silent
  with its Lease 1.5 intervals late (:meth:`Observed.lost` says why that suffices), is drained
  like a scale-down: pending = the placement without it, its experts re-homed on the survivors
  (R restored), any change in flight abandoned. Once that is committed its pod is deleted as a
  drained leftover, and the pool grows back to ``replicas`` (one scaling change). Where the
  survivors cannot hold R copies (too few servers, fixed slots), the lost pod is deleted at once
  and recreated in place, the only way back to R. When more than half of the placed servers go
  silent together the operator suspects its own view (an API-server outage stops every renewal)
  and acts on none of them, as the node lifecycle controller stops evicting in a full disruption;
  the clients fail over on the data path either way. Silent servers that all ran on one node,
  while servers on other nodes still renew, are a lost node, not a blind operator: they are acted
  on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from eaas.operator import planning
from eaas.operator.collector import Probe
from eaas.operator.conditions import DEGRADED, PROGRESSING, READY, Observation
from eaas.runtime.placement.placement import Placement, PlacementError

# A server its clients fail over is lost once its Lease has gone unrenewed this many heartbeat
# intervals (and its control port does not answer): half an interval late is more than the API
# server's latency and the operator's watch lag explain, far less than the Lease's timeout.
SUSPECT_RENEWALS = 1.5


@dataclass(frozen=True)
class PodState:
    """One expert-server pod as observed."""

    ordinal: int
    ready: bool
    terminating: bool = False
    template_hash: str = ""
    uid: str = ""
    unready_seconds: float = 0.0  # how long the pod has not been Ready (0 while Ready)
    retiring: bool = False  # marked for retirement (``eaas.io/retire``)
    node: str = ""  # where it runs (its failure domain), "" until scheduled
    problem: str = ""  # what keeps it from running, from its status ("" if nothing, or starting)


@dataclass(frozen=True)
class ServerReport:
    """What a server's Lease says (absent when the server keeps no Lease)."""

    expired: bool
    loaded_version: int | None = None
    utilization_milli: int | None = None
    tokens_per_second: int | None = None
    owner_uid: str | None = None  # the pod the Lease belongs to (None: not recorded)
    leaving: bool = False  # the server received SIGTERM and serves on until it is drained
    released: bool = False  # the operator told it (on this Lease) that no committed placement names it
    silent_s: float = 0.0  # since the operator saw the Lease renewed (from the end of a blind spell)


@dataclass(frozen=True)
class Observed:
    """Everything :func:`plan` needs about one ExpertPool."""

    pool: str
    desired_replicas: int
    shape: planning.PoolShape
    template_hash: str
    pods: dict[int, PodState]
    committed: Placement | None
    pending: Placement | None
    reports: dict[int, ServerReport] = field(default_factory=dict)
    placement_error: str = ""  # the ConfigMap could not be parsed
    last_version: int = 0  # the placement version last reported in status (versions never go back)
    rebalance: Placement | None = None  # a load-based proposal from the committed placement
    rebalance_message: str = ""
    heartbeat_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    # What the servers' control ports said when the operator asked just now (a server suspected
    # lost, or one its clients failed over): one that answers is alive (only cut off from the API
    # server, or slow), so not lost, whatever its heartbeat; one that refuses has no process.
    probes: Mapping[int, Probe] = field(default_factory=dict)
    # Servers that the live attention clients of the pool's MoEService say they fail over now
    # (their Leases' FAILED_OVER_ANNOTATION).
    reported: frozenset[int] = frozenset()
    # The placement versions the live attention clients of the pool's MoEService route by (their
    # Leases): a leaving server is released only once every one routes by a placement without it.
    client_versions: tuple[int, ...] = ()
    # Servers one scaling change may add or remove (``maxServersPerChange``); 0: a change at most
    # doubles or halves the pool.
    max_servers_per_change: int = 0

    def servers_per_change(self, share: int) -> int:
        """How many servers the next scaling change may add or remove: ``maxServersPerChange``, or
        by default `share` (the servers placed now when adding, half of them when removing)."""
        return max(1, self.max_servers_per_change or share)

    def is_live(self, ordinal: int) -> bool:
        """Pod Ready and not terminating, and its heartbeat (if it keeps one) not expired."""
        pod = self.pods.get(ordinal)
        report = self.reports.get(ordinal)
        return pod is not None and pod.ready and not pod.terminating and not (report and report.expired)

    def lost(self, ordinal: int) -> str:
        """Why server `ordinal` counts as lost ("" when it does not): its pod exists, the server
        once heartbeated from that pod, its control port did not answer when asked, and

        * its heartbeat stopped (the Lease expired) or its pod stayed unready past the timeout; or
        * its clients fail it over (:attr:`reported`) and its control port refuses connections:
          nothing listens there, the process is gone (crashed, killed, restarting); or
        * its clients fail it over and its Lease has gone unrenewed for more than
          :data:`SUSPECT_RENEWALS` intervals: three observers on three paths (the data path, the
          API server, the control port) find it silent at once, which a server that is slow but
          runs never is — its heartbeat thread renews on time and its control port answers,
          whatever its batches take.

        A server still loading (no Lease of its own yet) is never lost."""
        pod = self.pods.get(ordinal)
        report = self.reports.get(ordinal)
        if pod is None or pod.terminating or report is None:
            return ""
        if report.owner_uid is not None and pod.uid and report.owner_uid != pod.uid:
            return ""  # the Lease of an earlier pod of that name
        probe = self.probes.get(ordinal)
        if probe == "answers":
            return ""
        if report.expired:
            return f"its Lease was not renewed for {self.heartbeat_timeout_s:.0f} s"
        if not pod.ready and pod.unready_seconds > self.heartbeat_timeout_s:
            return f"its pod has not been Ready for {pod.unready_seconds:.0f} s"
        if ordinal not in self.reported:
            return ""
        if probe == "refused":
            return "its attention clients failed it over and its control port refuses connections"
        if probe == "silent" and report.silent_s > SUSPECT_RENEWALS * self.heartbeat_interval_s:
            return (
                f"its attention clients failed it over, its Lease has not been renewed for "
                f"{report.silent_s:.1f} s and its control port does not answer"
            )
        return ""

    def suspect_in(self, ordinal: int) -> float | None:
        """Seconds until server `ordinal`, which its clients fail over, has gone unrenewed long
        enough to count as lost if it stays silent (None when that does not apply, or the time
        has come already: then a renewal, a report or the resync brings the next look)."""
        report = self.reports.get(ordinal)
        if ordinal not in self.reported or report is None or self.lost(ordinal):
            return None
        if self.probes.get(ordinal) == "answers" or report.expired:
            return None
        remaining = SUSPECT_RENEWALS * self.heartbeat_interval_s - report.silent_s
        return remaining if remaining > 0 else None

    def leaving(self, ordinal: int) -> str:
        """Why server `ordinal` is leaving on purpose ("" when it is not): its pod is being
        deleted, or its Lease (of this pod) announces that it received SIGTERM."""
        pod = self.pods.get(ordinal)
        if pod is None:
            return ""
        if pod.terminating:
            return "its pod is being deleted"
        report = self.reports.get(ordinal)
        if report is not None and report.leaving and not report.expired and self._owns(report, pod):
            return "it received SIGTERM"
        return ""

    def is_serving(self, ordinal: int) -> bool:
        """Answers its clients: live, or leaving with its heartbeat still renewed (it serves on
        through its grace period until the placement without it is committed)."""
        if self.is_live(ordinal):
            return True
        report = self.reports.get(ordinal)
        pod = self.pods.get(ordinal)
        return (
            bool(self.leaving(ordinal))
            and report is not None
            and report.leaving
            and not report.expired
            and pod is not None
            and self._owns(report, pod)
        )

    @staticmethod
    def _owns(report: ServerReport, pod: PodState) -> bool:
        """The Lease is this pod's (not one an earlier pod of the name left)."""
        return report.owner_uid is None or not pod.uid or report.owner_uid == pod.uid

    def is_ready_for(self, ordinal: int, version: int) -> bool:
        """Live, and has loaded the experts of placement `version` (servers without a Lease: when Ready)."""
        report = self.reports.get(ordinal)
        if not self.is_live(ordinal):
            return False
        return report is None or (report.loaded_version is not None and report.loaded_version >= version)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the ExpertPool."""

    reason: str
    message: str
    type: str = "Normal"


@dataclass
class Step:
    """What to do now. ``publish`` = (committed, pending) to write to the ConfigMap, or None."""

    create_pods: list[int] = field(default_factory=list)
    delete_pods: list[int] = field(default_factory=list)
    publish: tuple[Placement | None, Placement | None] | None = None
    events: list[Event] = field(default_factory=list)
    conditions: list[Observation] = field(default_factory=list)
    progressing: str = ""  # reason when a change is in flight
    progress_message: str = ""
    release: list[int] = field(default_factory=list)  # leaving servers to tell they may go (on their Lease)

    def working(self, reason: str, message: str) -> Step:
        self.progressing, self.progress_message = reason, message
        return self


def plan(observed: Observed) -> Step:
    """The next step for one ExpertPool, with its conditions."""
    step = _decide(observed)
    step.release = _releasable(observed)
    step.conditions = _conditions(observed, step)
    return step


def _releasable(o: Observed) -> list[int]:
    """Leaving servers that neither the committed nor the pending placement names and that have
    not been told yet, once every live attention client routes by the committed placement (a
    client whose mounted placement lags, a new one above all, could still attach to a server an
    older placement names): their Lease gets :data:`~eaas.runtime.contract.RELEASED_ANNOTATION`,
    and each exits once no client holds a slot on it (its own mounted placement is frozen while
    its pod terminates)."""
    if o.committed is None or o.placement_error:
        return []
    if any(version < o.committed.version for version in o.client_versions):
        return []  # a client still routes by an older placement, which may name the server
    placed = set(o.committed.ordinals) | set(o.pending.ordinals if o.pending is not None else ())
    return sorted(
        n
        for n, report in o.reports.items()
        if report.leaving
        and not report.released
        and not report.expired
        and n not in placed
        and n in o.pods
        and o._owns(report, o.pods[n])
    )


def _decide(o: Observed) -> Step:
    step = Step()
    if o.placement_error:
        return step
    existing = set(o.pods)
    desired = max(o.desired_replicas, o.shape.replication)
    try:
        if o.committed is None and o.pending is None:
            servers = dict.fromkeys(range(desired))
            first = planning.initial(o.shape, servers, _names(o, range(desired)), version=o.last_version + 1)
            step.publish = (None, first)
            step.create_pods = [n for n in range(desired) if n not in existing]
            step.events.append(
                Event("PlacementProposed", f"initial placement v{first.version} over {desired} servers")
            )
            return step.working("Creating", f"creating {desired} expert servers")

        stale = sorted(
            n
            for n, pod in o.pods.items()
            if pod.template_hash != o.template_hash and not pod.terminating and not o.is_live(n)
        )
        if stale:  # not serving anyway: replace them at once (a live one is rolled below)
            step.delete_pods = stale
            step.events.append(
                Event("RollingUpdate", f"replacing not-ready servers {stale} (template changed)")
            )
            return step.working("RollingUpdate", f"replacing not-ready servers {stale}")

        lost = _lost_servers(o)
        if lost:
            return _replace_lost(o, step, lost)

        departing = _leaving_servers(o)
        if departing:
            return _release_leaving(o, step, departing)

        if o.pending is not None:
            return _finish_pending(o, step, existing)

        assert o.committed is not None
        placed = list(o.committed.ordinals)
        # Pods of servers that are no longer placed (drained and committed): delete them now.
        leftovers = sorted(n for n in existing if n not in placed and not o.pods[n].terminating)
        if leftovers:
            step.delete_pods = leftovers
            step.events += [
                Event("ServerRemoved", f"deleted drained expert server {o.pool}-{n}") for n in leftovers
            ]
            return step.working("ScalingDown", f"removing drained servers {leftovers}")
        missing = [n for n in placed if n not in existing]
        if missing:
            step.create_pods = missing
            step.events += [
                Event("ServerRecreated", f"recreated missing expert server {o.pool}-{n}", "Warning")
                for n in missing
            ]
            return step.working("Recreating", f"recreating servers {missing}")

        retiring = sorted(n for n in placed if o.pods[n].retiring)
        if len(placed) - len(retiring) < desired:
            lowest = max(placed) + 1
            count = min(desired - (len(placed) - len(retiring)), o.servers_per_change(len(placed)))
            new = list(range(lowest, lowest + count))
            old = [n for n in new if n in o.pods and o.pods[n].terminating]
            if old:
                return step.working(
                    "ScalingUp", f"waiting for the old pod(s) of {_servers(o, old)} to terminate"
                )
            names = _names(o, new)
            pending = planning.add_servers(o.committed, o.shape, {n: (names[n], None) for n in new})
            step.publish = (o.committed, pending)
            step.create_pods = [n for n in new if n not in existing]
            step.events.append(
                Event("ScalingUp", f"adding expert {_servers(o, new)}: placement v{pending.version} pending")
            )
            return step.working(
                "ScalingUp", f"adding {_servers(o, new, named=False)} ({len(placed)} -> {desired})"
            )
        if retiring:
            leaving = retiring[0]
            doing = f"retiring expert server {o.pool}-{leaving} as asked"
            return _drain(o, step, [leaving], "Retiring", doing, "marked for retirement")
        if len(placed) > desired:
            count = min(len(placed) - desired, o.servers_per_change(len(placed) // 2))
            draining = sorted(placed)[-count:]
            doing = f"draining expert {_servers(o, draining)}"
            return _drain(o, step, draining, "ScalingDown", doing, f"{len(placed)} -> {desired}")

        if o.committed.replication != o.shape.replication:
            names = _names(o, placed)
            pending = planning.initial(o.shape, dict.fromkeys(placed), names, version=o.committed.version + 1)
            step.publish = (o.committed, pending)
            step.events.append(
                Event(
                    "Replanning",
                    f"replication factor {o.committed.replication} -> {o.shape.replication}: "
                    f"placement v{pending.version} pending",
                )
            )
            return step.working("Replanning", f"re-placing experts for R={o.shape.replication}")

        outdated = sorted(n for n in placed if o.pods[n].template_hash != o.template_hash)
        if outdated:
            others_ready = all(o.is_live(n) for n in placed if n != outdated[-1])
            if others_ready and not o.pods[outdated[-1]].terminating:
                step.delete_pods = [outdated[-1]]
                step.events.append(
                    Event("RollingUpdate", f"replacing {o.pool}-{outdated[-1]} (template changed)")
                )
            return step.working("RollingUpdate", f"{len(outdated)} server(s) run an outdated template")

        nodes = {n: o.pods[n].node for n in placed}
        if all(nodes.values()) and all(map(o.is_live, placed)):
            recorded = {server.ordinal: server.domain for server in o.committed.servers}
            short = planning.spread_shortfall(o.committed, nodes)
            if recorded != nodes or short:
                return _spread(o, step, nodes, short)

        proposal = o.rebalance
        if proposal is not None and _is_rebalance_of(proposal, o.committed) and all(map(o.is_live, placed)):
            step.publish = (o.committed, proposal)
            step.events.append(Event("Rebalanced", f"{o.pool}: {o.rebalance_message}"))
            return step.working("Rebalancing", f"moving experts for load: placement v{proposal.version}")
    except PlacementError as error:
        step.events.append(Event("PlacementFailed", str(error), "Warning"))
        return step.working("PlacementFailed", str(error))
    return step


def _drain(o: Observed, step: Step, leaving: list[int], reason: str, doing: str, progress: str) -> Step:
    """Pending = committed without the servers `leaving`, their experts re-homed (R kept); their
    pods go once that is committed (the leftover branch of :func:`_decide`)."""
    assert o.committed is not None
    pending = planning.drain_servers(o.committed, o.shape, leaving)
    step.publish = (o.committed, pending)
    step.events.append(
        Event(
            reason,
            f"{doing}: its experts move to others in placement v{pending.version} "
            f"(R={o.shape.replication} kept)",
        )
    )
    return step.working(reason, f"draining {_servers(o, leaving, named=False)} ({progress})")


def _spread(o: Observed, step: Step, nodes: dict[int, str], short: int) -> Step:
    """Pending = the committed placement with its servers' nodes recorded as failure domains, every
    expert's replicas on ``min(R, nodes)`` of them (moved only where they were not)."""
    assert o.committed is not None
    try:
        pending = planning.spread(o.committed, o.shape, nodes)
    except PlacementError as error:
        step.events.append(Event("SpreadFailed", str(error), "Warning"))
        return step.working("SpreadFailed", str(error))
    step.publish = (o.committed, pending)
    domains = sorted(set(nodes.values()))
    moved = (
        f"{short} (layer, expert) pairs had every replica on one node: experts dealt again"
        if short
        else "no expert moves"
    )
    step.events.append(
        Event(
            "FailureDomains",
            f"placement v{pending.version} records the nodes of servers {list(pending.ordinals)} "
            f"({len(domains)} node(s)); every expert on {min(o.shape.replication, len(domains))} of them; "
            f"{moved}",
        )
    )
    return step.working(
        "Spreading", f"placing every expert's replicas on distinct nodes (v{pending.version})"
    )


def _lost_servers(o: Observed) -> dict[int, str]:
    """Lost servers of the placement being served or loaded (ordinal -> why)."""
    if o.committed is None:
        return {}
    target = o.pending if o.pending is not None else o.committed
    return {n: why for n in target.ordinals if (why := o.lost(n))}


def _leaving_servers(o: Observed) -> dict[int, str]:
    """Leaving servers of the placement being served or loaded (ordinal -> why)."""
    if o.committed is None:
        return {}
    target = o.pending if o.pending is not None else o.committed
    return {n: why for n in target.ordinals if (why := o.leaving(n))}


def _replace_leaving(o: Observed, step: Step, leaving: dict[int, str], names: str) -> Step | None:
    """Where the others cannot hold R copies without the leaving servers: a new server first,
    in the same pending placement as the leaving servers' drain (one change to load and commit,
    not an addition and then a drain, which may not fit a grace period). None if even that
    cannot keep R."""
    assert o.committed is not None
    new = max([*o.pods, *o.committed.ordinals, *(o.pending.ordinals if o.pending else [])]) + 1
    for base in (o.pending, o.committed) if o.pending is not None else (o.committed,):
        assert base is not None
        try:
            target = planning.add_server(base, o.shape, new, _names(o, [new])[new], None)
            for ordinal in leaving:
                if ordinal in target.ordinals:
                    target = planning.drain_server(target, o.shape, ordinal)
            break
        except PlacementError:
            continue
    else:
        return None
    newest = max(o.committed.version, o.pending.version if o.pending else 0)
    target = target.with_version(newest + 1)
    step.publish = (o.committed, target)
    step.create_pods = [new]
    step.events.append(
        Event(
            "ServerLeaving",
            f"expert server(s) {names} leaving; the others cannot hold R={o.shape.replication} "
            f"without them: adding {o.pool}-{new}, placement v{target.version} pending moves their "
            f"experts to servers {list(target.ordinals)} while they serve on",
        )
    )
    return step.working("ReleasingLeaving", f"replacing leaving servers {sorted(leaving)} with {new}")


def _release_leaving(o: Observed, step: Step, leaving: dict[int, str]) -> Step:
    """Pending = the placement without the leaving servers, their experts re-homed on the others
    while they serve on (see the module docstring)."""
    assert o.committed is not None
    names = ", ".join(f"{o.pool}-{n} ({why})" for n, why in leaving.items())
    # From the pending placement where there is one (a server being added, e.g. the replacement of
    # one that left before, takes its share), else from the committed one.
    error: PlacementError | None = None
    for base in (o.pending, o.committed) if o.pending is not None else (o.committed,):
        assert base is not None
        try:
            target = base
            for ordinal in leaving:
                if ordinal in target.ordinals:
                    target = planning.drain_server(target, o.shape, ordinal)
            break
        except PlacementError as failed:
            error = failed
    else:
        replacing = _replace_leaving(o, step, leaving, names)
        if replacing is not None:
            return replacing
        message = (
            f"expert server(s) {names} leaving; R cannot be kept without them ({error}): they serve "
            "until they go, then are recreated"
        )
        step.events.append(Event("ServerLeaving", message, "Warning"))
        return step.working("Leaving", message)
    newest = max(o.committed.version, o.pending.version if o.pending else 0)
    target = target.with_version(newest + 1)
    step.publish = (o.committed, target)
    abandoned = (
        f"; placement v{o.pending.version} abandoned"
        if o.pending is not None and base is o.committed
        else (f"; replaces pending v{o.pending.version}" if o.pending is not None else "")
    )
    step.events.append(
        Event(
            "ServerLeaving",
            f"expert server(s) {names} leaving: placement v{target.version} pending moves their "
            f"experts to servers {list(target.ordinals)} (R={o.shape.replication}) while they "
            f"serve on{abandoned}",
        )
    )
    return step.working("ReleasingLeaving", f"draining leaving servers {sorted(leaving)}")


def _replace_lost(o: Observed, step: Step, lost: dict[int, str]) -> Step:
    """Re-place the experts of lost servers on the survivors (see the module docstring)."""
    assert o.committed is not None
    placed = o.committed.ordinals
    names = ", ".join(f"{o.pool}-{n} ({why})" for n, why in lost.items())
    # A refused connection is the servers' hosts answering: the operator is not blind to them.
    unheard = {n: why for n, why in lost.items() if o.probes.get(n) != "refused"}
    if 2 * len(unheard) > len(placed) and not _one_node_lost(o, lost):
        message = (
            f"{len(unheard)} of {len(placed)} servers silent at once: {names}; suspecting the control "
            "plane rather than the servers, so none is re-placed on its heartbeat alone (clients fail "
            "over on their own)"
        )
        step.events.append(Event("HeartbeatsLost", message, "Warning"))
        lost = {n: why for n, why in lost.items() if n not in unheard}
        if not lost:
            return step.working("HeartbeatsLost", message)
        names = ", ".join(f"{o.pool}-{n} ({why})" for n, why in lost.items())
    target = o.committed
    try:
        for ordinal in lost:
            if ordinal in target.ordinals:
                target = planning.drain_server(target, o.shape, ordinal)
    except PlacementError as error:  # the survivors cannot hold R copies: bring the lost pods back
        step.delete_pods = sorted(lost)
        message = f"lost expert server(s) {names}; R cannot be kept without them ({error}): recreating them"
        step.events.append(Event("ServerLost", message, "Warning"))
        return step.working("RecreatingLost", message)
    newest = max(o.committed.version, o.pending.version if o.pending else 0)
    target = target.with_version(newest + 1)
    step.publish = (o.committed, target)
    abandoned = f"; placement v{o.pending.version} abandoned" if o.pending is not None else ""
    step.events.append(
        Event(
            "ServerLost",
            f"lost expert server(s) {names}: placement v{target.version} pending re-homes their experts "
            f"on servers {list(target.ordinals)} (R={o.shape.replication}){abandoned}",
            "Warning",
        )
    )
    return step.working("ReplacingLost", f"re-placing the experts of lost servers {sorted(lost)}")


def _one_node_lost(o: Observed, lost: dict[int, str]) -> bool:
    """Every silent server ran on one node while servers on other nodes still renew: a node was
    lost (its servers with it), not the operator's view of the API server."""
    assert o.committed is not None
    nodes = {n: o.pods[n].node for n in o.committed.ordinals if n in o.pods}
    silent = {nodes.get(n, "") for n in lost}
    if len(silent) != 1 or "" in silent:
        return False
    return any(node and node not in silent and n not in lost for n, node in nodes.items())


def _is_rebalance_of(proposal: Placement, committed: Placement) -> bool:
    """A load-based proposal applies only to the placement it was planned from (same servers, R)."""
    return (
        proposal.version > committed.version
        and proposal.ordinals == committed.ordinals
        and proposal.replication == committed.replication
        and not proposal.same_assignment(committed)
    )


def idle(step: Step) -> bool:
    """Nothing to do and nothing in flight: a load-based rebalance may be considered."""
    return step.publish is None and not (step.create_pods or step.delete_pods or step.progressing)


def _finish_pending(o: Observed, step: Step, existing: set[int]) -> Step:
    """Create the pending placement's pods, and commit it once all its servers are ready."""
    assert o.pending is not None
    missing = [n for n in o.pending.ordinals if n not in existing]
    if missing:
        step.create_pods = missing
        return step.working(
            "LoadingPlacement", f"creating servers {missing} for placement v{o.pending.version}"
        )
    # Once its servers are scheduled, the pending placement records their nodes and spreads every
    # expert over them before it is committed (one change, not a second one after the commit).
    nodes = {n: o.pods[n].node for n in o.pending.ordinals}
    if all(nodes.values()):
        recorded = {server.ordinal: server.domain for server in o.pending.servers}
        short = planning.spread_shortfall(o.pending, nodes)
        if recorded != nodes or short:
            try:
                spread = planning.spread(o.pending, o.shape, nodes)
            except PlacementError:
                pass  # committed as it is; the steady-state step reports why it cannot spread
            else:
                step.publish = (o.committed, spread)
                step.events.append(
                    Event(
                        "FailureDomains",
                        f"placement v{spread.version} (pending, replaces v{o.pending.version}) records the "
                        f"nodes of servers {list(spread.ordinals)}"
                        + (
                            f"; {short} (layer, expert) pairs dealt again onto distinct nodes"
                            if short
                            else ""
                        ),
                    )
                )
                return step.working(
                    "Spreading", f"placing every expert's replicas on distinct nodes (v{spread.version})"
                )
    waiting = [n for n in o.pending.ordinals if not o.is_ready_for(n, o.pending.version)]
    if waiting:
        return step.working(
            "LoadingPlacement", f"waiting for servers {waiting} to load placement v{o.pending.version}"
        )
    step.publish = (o.pending, None)
    step.events.append(
        Event(
            "PlacementCommitted",
            f"placement v{o.pending.version} committed: servers {list(o.pending.ordinals)}, "
            f"R={o.pending.replication}",
        )
    )
    return step.working("Committing", f"committing placement v{o.pending.version}")


def _names(o: Observed, ordinals: range | list[int]) -> dict[int, str]:
    return {n: f"{o.pool}-{n}" for n in ordinals}


def _servers(o: Observed, ordinals: list[int], named: bool = True) -> str:
    """``server p-3``, ``servers p-3, p-5``, or a run: ``32 servers p-64..p-95`` (named: with the
    pool's name, as pods are called; else the ordinals alone)."""
    prefix = f"{o.pool}-" if named else ""
    if len(ordinals) == 1:
        return f"server {prefix}{ordinals[0]}"
    if len(ordinals) > 3 and ordinals == list(range(ordinals[0], ordinals[-1] + 1)):
        return f"{len(ordinals)} servers {prefix}{ordinals[0]}..{prefix}{ordinals[-1]}"
    return "servers " + ", ".join(f"{prefix}{n}" for n in ordinals)


def serving_utilization(
    reports: dict[int, ServerReport],
    committed: Placement | None,
    pending: Placement | None,
    reading: Literal["utilization_milli", "tokens_per_second"] = "utilization_milli",
) -> int | None:
    """Mean busy thousandths (or another of the reports' ``reading``s: ``tokens_per_second``) of
    the servers that carry the pool's load and will go on carrying it: in the committed placement
    and, while a change is pending, in the pending one too. A server being added (not committed
    yet: no traffic) or drained (committed, leaving) would pull the mean down and make the pool
    look idler than the servers that stay are. None without a report."""
    if committed is None:
        return None
    serving = set(committed.ordinals) & set((pending or committed).ordinals)
    values = [
        value
        for n, r in reports.items()
        if n in serving and not r.expired and (value := getattr(r, reading)) is not None
    ]
    return round(sum(values) / len(values)) if values else None


def live_replicas(placement: Placement, live: set[int]) -> int:
    """The fewest live replicas any (layer, expert) has (0 = some expert cannot be served)."""
    columns = [i for i, ordinal in enumerate(placement.ordinals) if ordinal in live]
    if not columns:
        return 0
    counts = placement.hosting_matrix()[columns].sum(axis=0)  # [L, E]
    return int(np.min(counts))


def short_of_r(placement: Placement, live: set[int]) -> list[tuple[int, int]]:
    """(layer, expert) pairs with fewer than R live replicas, in order."""
    columns = [i for i, ordinal in enumerate(placement.ordinals) if ordinal in live]
    counts = placement.hosting_matrix()[columns].sum(axis=0)  # [L, E]
    layers = list(placement.layers)
    return [(layers[li], int(e)) for li, e in zip(*np.nonzero(counts < placement.replication), strict=True)]


PODS_NAMED = 3  # pods whose blocking reasons a condition message names (the rest are counted)


def _pod_problems(o: Observed) -> str:
    """What the first pods that are not Ready say keeps them from running (what the pool waits
    on), as a suffix of a condition message: ``" (pod p-0: reason: message; 2 more)"``, or ""."""
    blocked = [p for _, p in sorted(o.pods.items()) if p.problem and not p.ready and not p.terminating]
    if not blocked:
        return ""
    named = "; ".join(f"pod {o.pool}-{p.ordinal}: {p.problem}" for p in blocked[:PODS_NAMED])
    more = len(blocked) - PODS_NAMED
    return f" ({named}" + (f"; {more} more" if more > 0 else "") + ")"


def tells(condition: Mapping[str, object], message: str) -> bool:
    """Whether a condition's message is `message` (followed by the pods it waits on, if any)."""
    said = str(condition.get("message") or "")
    return said == message or said.startswith(message + " (pod ")


def _conditions(o: Observed, step: Step) -> list[Observation]:
    if o.placement_error:
        return [
            Observation.of(READY, False, "PlacementInvalid", o.placement_error),
            Observation.of(PROGRESSING, False, "PlacementInvalid", "fix or delete the placement ConfigMap"),
            Observation.of(DEGRADED, True, "PlacementInvalid", o.placement_error),
        ]
    problems = _pod_problems(o)
    message = step.progress_message or (
        f"{len(o.committed.ordinals) if o.committed else 0} servers, no change in flight"
    )
    progressing = Observation.of(
        PROGRESSING,
        bool(step.progressing),
        step.progressing or "Stable",
        message + problems if step.progressing else message,
    )
    if o.committed is None:
        return [
            Observation.of(
                READY, False, "PlacementPending", "the first placement is not committed yet" + problems
            ),
            progressing,
            Observation.of(DEGRADED, False, "PlacementPending", "nothing is serving yet"),
        ]
    live = {n for n in o.committed.ordinals if o.is_serving(n)}
    down = sorted(set(o.committed.ordinals) - live)
    fewest = live_replicas(o.committed, live)
    if fewest == 0:
        ready = Observation.of(
            READY,
            False,
            "ExpertUnavailable",
            f"some experts have no live replica; servers down: {down}" + problems,
        )
    else:
        ready = Observation.of(
            READY, True, "ExpertsServed", f"placement v{o.committed.version} on {len(live)} live servers"
        )
    if step.progressing == "PlacementFailed":
        degraded = Observation.of(DEGRADED, True, "PlacementFailed", step.progress_message)
    elif down:
        short = short_of_r(o.committed, live)
        examples = ", ".join(f"({layer}, {expert})" for layer, expert in short[:5])
        degraded = Observation.of(
            DEGRADED,
            True,
            "ServersUnavailable",
            f"servers {down} are not live; fewest live replicas of an expert: {fewest} "
            f"(R={o.committed.replication}); {len(short)} (layer, expert) pairs below R"
            + (f", e.g. {examples}" if short else "")
            + problems,
        )
    else:
        degraded = Observation.of(
            DEGRADED, False, "AllServersLive", f"every expert has >= {fewest} live replicas"
        )
    return [ready, progressing, degraded]
