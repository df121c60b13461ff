"""Start the operator: credentials, handlers, settings, metrics, liveness, then kopf's loop."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client

from eaas.operator import handlers
from eaas.operator.kube import Kube, load_config

logger = logging.getLogger("eaas.operator")


def connection_info(api_client: client.ApiClient) -> kopf.ConnectionInfo:
    """kopf's credentials from the same client configuration the reconcilers use (one login)."""
    configuration = api_client.configuration
    if configuration.refresh_api_key_hook is not None:  # rotating ServiceAccount tokens
        configuration.refresh_api_key_hook(configuration)
    header = configuration.get_api_key_with_prefix("BearerToken") or configuration.get_api_key_with_prefix(
        "authorization"
    )
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def run(
    namespaces: list[str],
    kubeconfig: str | None = None,
    context: str | None = None,
    metrics_port: int = 8080,
    health_port: int = 8081,
    request_timeout: float = 30.0,
    runtime_cluster_role: str | None = None,
    operator_namespace: str | None = None,
) -> None:
    """Run until SIGINT/SIGTERM. Watches `namespaces`, or the whole cluster when empty."""
    api_client = load_config(kubeconfig, context)
    kube = Kube(api_client, request_timeout=request_timeout)
    ctx = handlers.make_context(kube, runtime_cluster_role, operator_namespace)
    handlers.install(ctx)

    @kopf.on.login()
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(api_client)

    @kopf.on.startup()
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        handlers.configure(settings, request_timeout)
        if not logger.isEnabledFor(logging.DEBUG):  # kopf reports every successful handler at INFO
            logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        ctx.metrics.serve(metrics_port)
        scope = ", ".join(namespaces) if namespaces else "all namespaces"
        logger.info(
            "eaas operator watching %s; metrics on :%s, health on :%s", scope, metrics_port, health_port
        )

    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,  # one replica (Recreate); no peering objects needed
        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz" if health_port else None,
    )
