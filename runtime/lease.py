"""Heartbeats: a ``coordination.k8s.io/v1`` Lease named after the pod, renewed by a daemon thread.

Expert servers and attention clients keep one. Every ``interval_s`` the process creates or renews
the Lease (``holderIdentity`` = pod name, ``leaseDurationSeconds`` = the heartbeat timeout,
``renewTime`` = now), labelled with its pool, its role (``app.kubernetes.io/component``) and its
MoEService, so the operator lists a pool's Leases and an expert server its MoEService's attention
clients' Leases with one selector each. It is annotated with the newest placement version the
process serves (an expert server: whose experts it has loaded, and the operator commits a pending
placement only when every server in it reports that version; an attention client: the one it
routes by) and its busy fraction over the last interval in thousandths (what the built-in
autoscaler averages); an attention client also gives its expert time per decoder step over the
last 10 s (``expert-wait-micros``: what the built-in autoscaler averages with ``metric:
expertWait``). API errors are logged and retried with backoff (0.5 s doubling, at most the
interval); they never stop the serving.

RBAC the pod's ServiceAccount needs in its namespace: ``coordination.k8s.io`` ``leases``
``get``, ``create``, ``update`` (and ``list`` for an expert server, which reads its clients'
Leases: :mod:`eaas.runtime.server.client_leases`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from eaas.runtime import contract
from eaas.runtime.server.daemon import DaemonLoop

log = logging.getLogger("eaas.heartbeat")

MIN_RETRY_S = 0.5
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class LeaseSettings:
    pod_name: str
    namespace: str
    pool: str
    interval_s: float = 5.0
    timeout_s: float = 15.0
    kubeconfig: Path | None = None  # None: the in-cluster configuration (the pod's ServiceAccount)
    pod_uid: str | None = None  # when known, the Lease is owned by the pod (deleted with it)
    component: str = contract.EXPERT_COMPONENT  # the role: expert server or attention client
    service: str | None = None  # the MoEService, labelled when known

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < self.timeout_s:
            raise ValueError(
                f"heartbeat: need 0 < interval ({self.interval_s} s) < timeout ({self.timeout_s} s)"
            )


@dataclass(frozen=True)
class LeaseOptions:
    """The command-line (and pod environment) settings of a heartbeat, before they are checked."""

    pod_name: str | None
    namespace: str | None
    pool: str | None
    pod_uid: str | None
    service: str | None
    interval_s: float
    timeout_s: float
    kubeconfig: Path | None

    def settings(self, component: str, default_pool: str | None = None) -> LeaseSettings | None:
        """The Lease to keep (None outside Kubernetes: no pod name or namespace given)."""
        if not (self.pod_name and self.namespace):
            return None
        pool = self.pool or default_pool
        if not pool:
            raise click.UsageError(f"--pool: cannot tell the pool from pod name {self.pod_name!r}; set it")
        try:
            return LeaseSettings(
                self.pod_name,
                self.namespace,
                pool,
                self.interval_s,
                self.timeout_s,
                self.kubeconfig,
                self.pod_uid,
                component,
                self.service,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc


_LEASE_OPTIONS = (
    click.option(
        "--pod-name",
        envvar=contract.ENV_POD_NAME,
        show_envvar=True,
        default=None,
        help="keep a heartbeat Lease of this name (with --namespace; both set in Kubernetes pods)",
    ),
    click.option(
        "--namespace", envvar=contract.ENV_NAMESPACE, show_envvar=True, default=None, help="of the Lease"
    ),
    click.option(
        "--pool",
        envvar=contract.ENV_POOL,
        show_envvar=True,
        default=None,
        help="the pool, labelled on the Lease (an expert server's default: the pod name without -<ordinal>)",
    ),
    click.option(
        "--pod-uid", envvar=contract.ENV_POD_UID, show_envvar=True, default=None, help="owner of the Lease"
    ),
    click.option(
        "--moeservice",
        envvar=contract.ENV_SERVICE,
        show_envvar=True,
        default=None,
        help="the MoEService, labelled on the Lease (an expert server also watches its attention "
        "clients' Leases, and frees the slots of those that expired)",
    ),
    click.option(
        "--heartbeat-interval-seconds",
        type=float,
        envvar=contract.ENV_HEARTBEAT_INTERVAL,
        show_envvar=True,
        default=5.0,
        show_default=True,
        help="how often the Lease is renewed",
    ),
    click.option(
        "--heartbeat-timeout-seconds",
        type=float,
        envvar=contract.ENV_HEARTBEAT_TIMEOUT,
        show_envvar=True,
        default=15.0,
        show_default=True,
        help="the Lease's leaseDurationSeconds",
    ),
    click.option(
        "--kubeconfig",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="API server credentials for the Lease (default: the pod's in-cluster ServiceAccount)",
    ),
)


def drain_timeout_option(after_sigterm: str) -> Callable[[F], F]:
    """``--drain-timeout-seconds`` (``EAAS_DRAIN_TIMEOUT_SECONDS``, set in pods to their grace
    period less 5 s): how long a process serves on after SIGTERM, doing `after_sigterm`."""
    return click.option(
        "--drain-timeout-seconds",
        type=click.FloatRange(min=0),
        envvar=contract.ENV_DRAIN_TIMEOUT,
        show_envvar=True,
        default=25.0,
        show_default=True,
        help=f"after SIGTERM, {after_sigterm}, for at most this long (keep it below the pod's grace "
        "period); a second SIGTERM or SIGINT stops it at once",
    )


def lease_options(command: F) -> F:
    """The heartbeat's options, handed to ``command`` as one ``lease: LeaseOptions``."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        lease = LeaseOptions(
            pod_name=kwargs.pop("pod_name"),
            namespace=kwargs.pop("namespace"),
            pool=kwargs.pop("pool"),
            pod_uid=kwargs.pop("pod_uid"),
            service=kwargs.pop("moeservice"),
            interval_s=kwargs.pop("heartbeat_interval_seconds"),
            timeout_s=kwargs.pop("heartbeat_timeout_seconds"),
            kubeconfig=kwargs.pop("kubeconfig"),
        )
        return command(*args, lease=lease, **kwargs)

    decorated: Any = wrapper
    for option in reversed(_LEASE_OPTIONS):
        decorated = option(decorated)
    return decorated  # type: ignore[no-any-return]


def pool_of(pod_name: str, ordinal: int) -> str | None:
    """The pool in an expert-server pod name ``<pool>-<ordinal>`` (None when not of that form)."""
    suffix = f"-{ordinal}"
    if pod_name.endswith(suffix) and len(pod_name) > len(suffix):
        return pod_name.removesuffix(suffix)
    return None


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    settings: LeaseSettings,
    now: datetime,
    loaded_version: int,
    utilization_milli: int,
    previous: dict[str, Any] | None = None,
    expert_wait_micros: int | None = None,
    tokens_per_second: int | None = None,
    leaving_by: datetime | None = None,
    tpot_micros: int | None = None,
    failed_over: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The Lease to write: ``previous`` (as read, with its resourceVersion) renewed, or a new one.
    An attention client also gives its ``expert_wait_micros`` (:class:`ExpertWait`) and its p99
    time per output token ``tpot_micros`` (:class:`RecentP99`; None, and the annotation goes, when
    no request finished in the window), an expert server its routed ``tokens_per_second``
    (:class:`TokenRate`); a process that received SIGTERM the time it will be gone by
    (``leaving_by``). An attention client gives the expert servers it routes around now
    (``failed_over``, ordinals; empty: the annotation goes)."""
    lease: dict[str, Any] = json.loads(json.dumps(previous)) if previous else {}
    lease["apiVersion"] = "coordination.k8s.io/v1"
    lease["kind"] = "Lease"
    metadata = lease.setdefault("metadata", {})
    metadata["name"] = settings.pod_name
    metadata["namespace"] = settings.namespace
    labels = {contract.POOL_LABEL: settings.pool, contract.COMPONENT_LABEL: settings.component}
    if settings.service:
        labels[contract.SERVICE_LABEL] = settings.service
    metadata["labels"] = (metadata.get("labels") or {}) | labels
    metadata["annotations"] = (metadata.get("annotations") or {}) | {
        contract.LOADED_VERSION_ANNOTATION: str(loaded_version),
        contract.UTILIZATION_ANNOTATION: str(utilization_milli),
    }
    if expert_wait_micros is not None:
        metadata["annotations"][contract.EXPERT_WAIT_ANNOTATION] = str(expert_wait_micros)
    if tokens_per_second is not None:
        metadata["annotations"][contract.TOKEN_RATE_ANNOTATION] = str(tokens_per_second)
    if tpot_micros is not None:
        metadata["annotations"][contract.TPOT_ANNOTATION] = str(tpot_micros)
    else:  # no reading now: an old one must not be taken for the present
        metadata["annotations"].pop(contract.TPOT_ANNOTATION, None)
    if failed_over:
        metadata["annotations"][contract.FAILED_OVER_ANNOTATION] = ",".join(map(str, sorted(failed_over)))
    else:
        metadata["annotations"].pop(contract.FAILED_OVER_ANNOTATION, None)
    if leaving_by is not None:
        metadata["annotations"][contract.LEAVING_ANNOTATION] = micro_time(leaving_by)
    else:  # a new process of the same pod name is not leaving, nor released
        metadata["annotations"].pop(contract.LEAVING_ANNOTATION, None)
        metadata["annotations"].pop(contract.RELEASED_ANNOTATION, None)
    if settings.pod_uid:  # owned by this pod (a Lease left by an earlier pod of the name is taken over)
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": settings.pod_name, "uid": settings.pod_uid}
        ]
    spec = lease.setdefault("spec", {})
    stamp = micro_time(now)
    if spec.get("holderIdentity") != settings.pod_name:
        if spec.get("holderIdentity"):
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec["holderIdentity"] = settings.pod_name
        spec["acquireTime"] = stamp
    spec.setdefault("acquireTime", stamp)
    spec["leaseDurationSeconds"] = math.ceil(settings.timeout_s)
    spec["renewTime"] = stamp
    return lease


UTILIZATION_WINDOW_S = 10.0


class _Window:
    """Readings of monotonically growing counters, kept over the last `window_s` seconds: the
    oldest within the window (or the newest before it, when the readings are further apart) is
    what a rate or a mean is taken from, as a Prometheus rate over a window."""

    def __init__(self, read: Callable[[], tuple[float, ...]], window_s: float, clock: Callable[[], float]):
        self._read = read
        self._window_s = window_s
        self._clock = clock
        self._readings: deque[tuple[float, tuple[float, ...]]] = deque([(clock(), read())])

    def _slide(self) -> tuple[float, tuple[float, ...], float, tuple[float, ...]]:
        """Reads now: (then, the counters then, now, the counters now)."""
        now, values = self._clock(), self._read()
        self._readings.append((now, values))
        while len(self._readings) > 2 and self._readings[1][0] <= now - self._window_s:
            self._readings.popleft()
        then, before = self._readings[0]
        return then, before, now, values


class _Rate(_Window):
    """Rate per second of one monotonically growing counter over the last `window_s` seconds (the
    readings of the calls to :meth:`rate`)."""

    def __init__(
        self,
        counter: Callable[[], float],
        window_s: float = UTILIZATION_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(lambda: (counter(),), window_s, clock)

    def rate(self) -> float:
        """Growth per second over the window (0 before a second reading, never negative)."""
        then, (before,), now, (after,) = self._slide()
        return max(0.0, (after - before) / (now - then)) if now > then else 0.0


class Utilization(_Rate):
    """Busy fraction of a monotonically growing busy-seconds counter over the last `window_s`
    seconds: one heartbeat's interval alone is too short a sample of a bursty load (the built-in
    autoscaler would act on noise), and the adapter's rule for the HPA reads the same quantity
    over a window."""

    def milli(self) -> int:
        """Busy thousandths (0-1000) over the window."""
        return min(1000, round(1000 * self.rate()))


class TokenRate(_Rate):
    """Routed tokens per second of a monotonically growing count of (token, expert) entries a
    server computed (``total_tokens`` of ``/v1/stats``), over the last `window_s` seconds: the
    load itself, in proportion to the work a server is given, so it falls as 1 / servers when one
    is added, whatever the fixed costs of a batch."""

    def per_second(self) -> int:
        """Whole tokens per second over the window (0 before a second reading)."""
        return round(self.rate())


class ExpertWait(_Window):
    """An attention client's mean expert time per decoder step (``eaas_attention_step_expert_seconds``)
    over the last `window_s` seconds, from its running totals (seconds, steps). No step in the
    window reads 0: an idle client asks nothing of the pool."""

    def __init__(
        self,
        totals: Callable[[], tuple[float, int]],
        window_s: float = UTILIZATION_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(totals, window_s, clock)

    def micros(self) -> int:
        """Mean microseconds per step over the window."""
        _, (seconds_then, steps_then), _, (seconds, steps) = self._slide()
        if steps <= steps_then:
            return 0
        return max(0, round(1e6 * (seconds - seconds_then) / (steps - steps_then)))


class RecentP99:
    """The p99 of the samples recorded (any thread) over the last `window_s` seconds: an attention
    client's time per output token of each finished request (the SLO's quantity)."""

    def __init__(
        self, window_s: float = contract.TPOT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._samples.append((now, seconds))
            self._forget(now)  # also where nothing reads it (no Lease, no scrape): memory stays bounded

    def micros(self) -> int | None:
        """The p99 in microseconds over the window (nearest rank), None without a sample."""
        with self._lock:
            self._forget(self._clock())
            values = sorted(seconds for _, seconds in self._samples)
        if not values:
            return None
        return round(1e6 * values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)])

    def _forget(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()


class Heartbeat(DaemonLoop):
    """Creates and renews the Lease in a daemon thread: ``start()``, ``stop()``."""

    def __init__(
        self,
        settings: LeaseSettings,
        loaded_version: Callable[[], int],
        busy_seconds: Callable[[], float],
        expert_wait: Callable[[], tuple[float, int]] | None = None,
        routed_tokens: Callable[[], float] | None = None,
        tpot: Callable[[], int | None] | None = None,
        failed_over: Callable[[], tuple[int, ...]] | None = None,
    ) -> None:
        """`expert_wait`: an attention client's running (expert seconds, decoder steps); `tpot`
        its p99 time per output token now (us, :class:`RecentP99`); `failed_over` the servers it
        routes around now; `routed_tokens`: an expert server's running count of (token, expert)
        entries computed. What changes between renewals and should reach the operator at once
        (a client's failovers, a server's loaded placement) calls :meth:`nudge`."""
        self.settings = settings
        self.leaving_by: datetime | None = None  # set by :meth:`leave`
        self._wake = threading.Event()
        self._loaded_version = loaded_version
        self._utilization = Utilization(busy_seconds)
        self._expert_wait = ExpertWait(expert_wait) if expert_wait is not None else None
        self._token_rate = TokenRate(routed_tokens) if routed_tokens is not None else None
        self._tpot = tpot
        self._failed_over = failed_over
        self._api: Any = None
        self._lease: dict[str, Any] | None = None  # as last read or written (carries resourceVersion)
        self.renewals = 0
        self.failures = 0  # in a row
        super().__init__("eaas-heartbeat")

    @property
    def released(self) -> bool:
        """The operator wrote on the Lease that no committed placement names this server."""
        annotations = ((self._lease or {}).get("metadata") or {}).get("annotations") or {}
        return contract.RELEASED_ANNOTATION in annotations

    def leave(self, by: datetime) -> None:
        """Announces on the Lease that the process will be gone by `by`, renewing it now."""
        self.leaving_by = by
        self._wake.set()

    def nudge(self) -> None:
        """Renew now rather than at the next interval: something the operator acts on changed
        (any thread; nudges that come while a renewal is under way give one more renewal)."""
        self._wake.set()

    def stop(self) -> None:
        self._wake.set()
        super().stop()

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.is_set():
            due = time.monotonic() + delay
            # A nudge renews at once, except while the API server refuses: then the backoff holds.
            while (
                self._wake.wait(max(0.0, due - time.monotonic()))
                and self.failures
                and not self._stop.is_set()
            ):
                self._wake.clear()
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.beat()
                self.failures = 0
                delay = self.settings.interval_s
            except Exception as error:  # API errors, network errors, config errors: retry
                self.failures += 1
                delay = min(self.settings.interval_s, MIN_RETRY_S * 2 ** (self.failures - 1))
                log.warning(
                    "heartbeat: Lease %s/%s not renewed (%d failure(s) in a row): %s; retrying in %.1f s",
                    self.settings.namespace,
                    self.settings.pod_name,
                    self.failures,
                    describe(error),
                    delay,
                )

    def beat(self) -> None:
        """Creates or renews the Lease once (raises on API errors)."""
        from kubernetes.client.exceptions import ApiException

        api = self._client()
        name, namespace = self.settings.pod_name, self.settings.namespace
        timeout = max(1.0, min(self.settings.interval_s, 10.0))
        version, milli = self._loaded_version(), self._utilization.milli()
        wait = self._expert_wait.micros() if self._expert_wait is not None else None
        tokens = self._token_rate.per_second() if self._token_rate is not None else None
        tpot = self._tpot() if self._tpot is not None else None
        failed = self._failed_over() if self._failed_over is not None else None
        leaving = self.leaving_by
        for attempt in range(2):
            if self._lease is None:
                try:
                    self._lease = response_json(
                        api.read_namespaced_lease(name, namespace, **raw_options(timeout))
                    )
                except ApiException as error:
                    if error.status != 404:
                        raise
                    body = lease_body(
                        self.settings,
                        datetime.now(UTC),
                        version,
                        milli,
                        None,
                        wait,
                        tokens,
                        leaving,
                        tpot,
                        failed,
                    )
                    self._lease = response_json(
                        api.create_namespaced_lease(namespace, body, **raw_options(timeout))
                    )
                    self.renewals += 1
                    log.info("heartbeat: created Lease %s/%s", namespace, name)
                    return
            body = lease_body(
                self.settings,
                datetime.now(UTC),
                version,
                milli,
                self._lease,
                wait,
                tokens,
                leaving,
                tpot,
                failed,
            )
            try:
                self._lease = response_json(
                    api.replace_namespaced_lease(name, namespace, body, **raw_options(timeout))
                )
                self.renewals += 1
                return
            except ApiException as error:
                self._lease = None  # changed or deleted behind our back: read it again
                if error.status not in (404, 409) or attempt:
                    raise

    def _client(self) -> Any:
        if self._api is None:
            self._api = coordination_api(self.settings.kubeconfig)
        return self._api


def api_client(kubeconfig: Path | None) -> Any:
    """An ``ApiClient`` from ``kubeconfig``, or from the pod's in-cluster configuration (its
    ServiceAccount): what every request of a pod to the API server goes through."""
    from kubernetes import client, config

    if kubeconfig is not None:
        return config.new_client_from_config(config_file=str(kubeconfig))
    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def coordination_api(kubeconfig: Path | None) -> Any:
    """A ``CoordinationV1Api`` from ``kubeconfig``, or from the pod's in-cluster configuration."""
    from kubernetes import client

    return client.CoordinationV1Api(api_client(kubeconfig))


def raw_options(timeout_s: float) -> dict[str, Any]:
    """Request options: a timeout, and the JSON body instead of a model (we keep plain dicts)."""
    return {"_preload_content": False, "_request_timeout": timeout_s}


def response_json(response: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(response.data)
    return data


def describe(error: Exception) -> str:
    status = getattr(error, "status", None)
    if status is not None and hasattr(error, "body"):
        try:
            message = json.loads(error.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        return f"{status} {getattr(error, 'reason', '')}: {message}".strip()
    return f"{type(error).__name__}: {error}"
