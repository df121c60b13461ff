"""``eaas operator``: run the Kubernetes operator (in a pod, or locally with a kubeconfig)."""

from __future__ import annotations

import logging

import click


@click.command("operator")
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    envvar="EAAS_OPERATOR_NAMESPACES",
    help="Watch only this namespace (repeatable); default: all namespaces. "
    "Env: EAAS_OPERATOR_NAMESPACES (space-separated).",
)
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False),
    envvar="KUBECONFIG",
    help="Kubeconfig to use; default: in-cluster ServiceAccount, else ~/.kube/config.",
)
@click.option("--context", "kube_context", default=None, help="Kubeconfig context (default: current).")
@click.option(
    "--metrics-port",
    default=8080,
    show_default=True,
    envvar="EAAS_OPERATOR_METRICS_PORT",
    help="Port of /metrics (0 = off).",
)
@click.option(
    "--health-port",
    default=8081,
    show_default=True,
    envvar="EAAS_OPERATOR_HEALTH_PORT",
    help="Port of /healthz for liveness probes (0 = off).",
)
@click.option("--request-timeout", default=30.0, show_default=True, help="Seconds per API request.")
@click.option(
    "--runtime-cluster-role",
    envvar="EAAS_RUNTIME_CLUSTER_ROLE",
    show_envvar=True,
    default=None,
    help="ClusterRole the runtime pods need (the chart's <release>-runtime): each MoEService's "
    "ServiceAccount is bound to it in its namespace. Unset: bind it yourself.",
)
@click.option(
    "--operator-namespace",
    envvar="EAAS_OPERATOR_POD_NAMESPACE",
    show_envvar=True,
    default=None,
    help="Namespace of the operator's own pod: NetworkPolicies let it reach the expert servers' "
    "control ports (the chart sets it).",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def operator(
    namespaces: tuple[str, ...],
    kubeconfig: str | None,
    kube_context: str | None,
    metrics_port: int,
    health_port: int,
    request_timeout: float,
    runtime_cluster_role: str | None,
    operator_namespace: str | None,
    verbose: bool,
) -> None:
    """Run the EaaS operator: reconciles MoEServices, AttentionPools and ExpertPools."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from eaas.operator.main import run  # kopf and the handlers load only when the command runs

    run(
        namespaces=list(namespaces),
        kubeconfig=kubeconfig,
        context=kube_context,
        metrics_port=metrics_port,
        health_port=health_port,
        request_timeout=request_timeout,
        runtime_cluster_role=runtime_cluster_role,
        operator_namespace=operator_namespace,
    )
