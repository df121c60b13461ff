"""The Lease watch asks the API server for the heartbeat Leases of EaaS pods only."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import kopf
from kopf._cogs.structs.references import Resource

from eaas.operator import handlers, naming
from eaas.operator.api.kinds import ATTENTIONPOOL, EXPERTPOOL, GROUP, MOESERVICE, VERSION
from eaas.operator.lease_watch import LeaseWatch
from eaas.operator.renewals import RenewalClock
from eaas.runtime.lease import LeaseSettings, lease_body


def selectors(settings: kopf.OperatorSettings, resource: Resource) -> list[str]:
    """The label selectors kopf sends when it lists and watches `resource`."""
    return list(settings.watching.label_selectors.collect(resource))


def test_only_the_lease_watch_carries_the_heartbeat_selector() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings, 30.0)
    leases = Resource("coordination.k8s.io", "v1", "leases", kind="Lease", namespaced=True)
    assert selectors(settings, leases) == [naming.HEARTBEAT_LEASE_SELECTOR]
    for kind in (MOESERVICE, ATTENTIONPOOL, EXPERTPOOL):  # every custom resource is watched whole
        assert (
            selectors(settings, Resource(GROUP, VERSION, kind.plural, kind=kind.kind, namespaced=True)) == []
        )


def test_the_selector_takes_every_lease_the_runtime_writes_and_no_other() -> None:
    match = re.fullmatch(r"(\S+) in \(([^)]*)\)", naming.HEARTBEAT_LEASE_SELECTOR)
    assert match is not None
    key, values = match.group(1), set(match.group(2).split(","))
    for component in (naming.EXPERT_COMPONENT, naming.ATTENTION_COMPONENT):
        settings = LeaseSettings("p-0", "ns", "p", 1.0, 5.0, component=component, service="m")
        labels = lease_body(settings, datetime.now(UTC), 1, 0)["metadata"]["labels"]
        assert labels[key] in values
    # What the operator's Lease handler acts on is what the selector takes: a Lease of another
    # component (or none, as a node's heartbeat or a leader election has) concerns no pool.
    watch = LeaseWatch(RenewalClock())
    for labels in ({}, {key: "controller"}, {naming.POOL_LABEL: "p"}):
        other = {"metadata": {"namespace": "ns", "name": "x", "labels": labels}, "spec": {}}
        assert watch.seen(other, "MODIFIED", 0.0) is None
