"""AttentionPool reconcile: apply the Deployment and Service, report the clients' readiness."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from eaas.operator import naming
from eaas.operator.api.kinds import ATTENTIONPOOL
from eaas.operator.api.pools import AttentionPoolSpec
from eaas.operator.builders import attentionpool as build
from eaas.operator.reconcile.context import Context, describe_validation_error
from eaas.operator.status import deployment_conditions, invalid_spec


def reconcile(ctx: Context, body: Mapping[str, Any]) -> None:
    name = body["metadata"]["name"]
    base_status: dict[str, Any] = {"selector": naming.selector_string(build.selector(name))}
    try:
        spec = AttentionPoolSpec.from_k8s(body.get("spec"))
    except ValidationError as error:
        ctx.write_status(
            ATTENTIONPOOL.kind, body, base_status, invalid_spec(describe_validation_error(error))
        )
        return
    deployment = ctx.kube.apply(build.deployment(body, spec))
    ctx.apply_seldom(build.service(body, spec))
    ctx.apply_seldom(build.disruption_budget(body, spec))
    observed = deployment.get("status") or {}
    generation_seen = observed.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    status = {
        **base_status,
        "replicas": int(observed.get("replicas") or 0),
        "readyReplicas": int(observed.get("readyReplicas") or 0),
        "endpoint": build.endpoint(body, spec),
    }
    ctx.write_status(
        ATTENTIONPOOL.kind, body, status, deployment_conditions(spec.replicas, deployment, generation_seen)
    )
