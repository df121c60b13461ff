# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""coordination.k8s.io Leases: create, renew, and optimistic concurrency (what leader election uses)."""

from __future__ import annotations

import datetime

import pytest
from kubernetes import client

from e2e.cluster import Cluster

pytestmark = pytest.mark.e2e


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def test_lease_is_created_renewed_and_guarded_by_resource_version(cluster: Cluster, namespace: str) -> None:
    leases = cluster.coordination
    acquired = _now()
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="eaas-operator"),
        spec=client.V1LeaseSpec(
            holder_identity="replica-a",
            lease_duration_seconds=15,
            acquire_time=acquired,
            renew_time=acquired,
            lease_transitions=0,
        ),
    )
    created = leases.create_namespaced_lease(namespace, lease)
    assert created.spec.holder_identity == "replica-a"

    # Renew: a newer renewTime under the resourceVersion we read.
    renewed_at = acquired + datetime.timedelta(seconds=5, microseconds=123456)
    created.spec.renew_time = renewed_at
    renewed = leases.replace_namespaced_lease("eaas-operator", namespace, created)
    assert renewed.metadata.resource_version != created.metadata.resource_version
    stored = leases.read_namespaced_lease("eaas-operator", namespace)
    assert stored.spec.renew_time == renewed_at  # MicroTime keeps microseconds
    assert stored.spec.acquire_time == acquired

    # A writer holding the stale resourceVersion loses: 409 Conflict, and the lease is unchanged.
    created.spec.holder_identity = "replica-b"
    with pytest.raises(client.ApiException) as conflict:
        leases.replace_namespaced_lease("eaas-operator", namespace, created)
    assert conflict.value.status == 409
    assert leases.read_namespaced_lease("eaas-operator", namespace).spec.holder_identity == "replica-a"

    # A takeover with the current resourceVersion succeeds.
    stored.spec.holder_identity = "replica-b"
    stored.spec.lease_transitions = 1
    stored.spec.acquire_time = stored.spec.renew_time = _now()
    taken = leases.replace_namespaced_lease("eaas-operator", namespace, stored)
    assert (taken.spec.holder_identity, taken.spec.lease_transitions) == ("replica-b", 1)
