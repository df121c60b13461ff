"""Start the operator: credentials, handlers, settings, metrics, liveness, then kopf's loop."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client

from eaas.operator import handlers
from eaas.operator.kube import Kube, load_config

logger = logging.getLogger("eaas.operator")

# The API server's answer (500) to requests for a resource whose storage is not ready yet: right
# after it starts, or after a CRD is created, until it serves that resource.
STORAGE_INITIALIZING = "storage is (re)initializing"


class StartupRetries(logging.Filter):
    """kopf logs every retried API request at ERROR. A retry because the API server's storage is
    (re)initializing is the API server or the CRDs coming up, not an error: it is logged at INFO
    as what it is. Every other record passes unchanged, and so does the request's last attempt
    (kopf's ``escalating``), which stays an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not record.name.startswith("kopf"):
            return True
        message = record.getMessage()
        if "failed; will retry:" in message and STORAGE_INITIALIZING in message:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = (
                "waiting for the API server/CRDs (%s): %s",
                (STORAGE_INITIALIZING, message),
            )
        return True


def log_startup_retries_as_waiting(target: logging.Logger | None = None) -> None:
    """Put :class:`StartupRetries` on the handlers of `target` (the root logger), where the
    records of all of kopf's loggers arrive (a logger's own filters see only its own records)."""
    for handler in (target or logging.getLogger()).handlers:
        if not any(isinstance(f, StartupRetries) for f in handler.filters):
            handler.addFilter(StartupRetries())


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
    log_startup_retries_as_waiting()

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
