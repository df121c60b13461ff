"""The names the operator and the runtime must agree on: labels, Lease annotations, placement
ConfigMap keys and mounts, the pods' environment variables and commands.

The operator writes them into the objects and pod specs it creates; the runtime inside the pods
reads them. They live here, in the runtime, because layers point one way (``kernels`` ←
``runtime`` ← ``operator``): the operator imports this module (through
:mod:`eaas.operator.naming`), the runtime never imports the operator — the way Kubernetes keeps
well-known labels in ``k8s.io/api`` rather than in a controller.
"""

from __future__ import annotations

GROUP = "eaas.io"  # the API group of the custom resources, also the prefix of our labels

# Labels ------------------------------------------------------------------------------------------
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
SERVICE_LABEL = f"{GROUP}/moeservice"
POOL_LABEL = f"{GROUP}/pool"
ORDINAL_LABEL = f"{GROUP}/ordinal"

APP = "eaas"
MANAGED_BY = "eaas-operator"
EXPERT_COMPONENT = "expert-server"
ATTENTION_COMPONENT = "attention-client"
# The heartbeat Leases of expert servers and attention clients (:mod:`eaas.runtime.lease` labels
# each with its component), as a label selector: all the operator's Lease watch asks the API for.
HEARTBEAT_LEASE_SELECTOR = f"{COMPONENT_LABEL} in ({EXPERT_COMPONENT},{ATTENTION_COMPONENT})"

# Annotations -------------------------------------------------------------------------------------
TEMPLATE_HASH_ANNOTATION = f"{GROUP}/template-hash"
PLACEMENT_VERSION_ANNOTATION = f"{GROUP}/placement-version"
LOADED_VERSION_ANNOTATION = f"{GROUP}/loaded-placement-version"
UTILIZATION_ANNOTATION = f"{GROUP}/utilization-milli"
# An attention client's mean expert time per decoder step over the last 10 s, in microseconds
EXPERT_WAIT_ANNOTATION = f"{GROUP}/expert-wait-micros"
# An attention client's p99 time per output token over the last TPOT_WINDOW_S
TPOT_ANNOTATION = f"{GROUP}/tpot-p99-micros"
TPOT_WINDOW_S = 30.0  # requests finish seldom at a low load: a wider window than the counters' 10 s
# An expert server's routed (token, expert) entries per second over the last 10 s
TOKEN_RATE_ANNOTATION = f"{GROUP}/tokens-per-second"
# A server that received SIGTERM: the time (RFC 3339, UTC) by which it will have exited. It serves
# until then, or until no placement names it; the operator drains it meanwhile.
LEAVING_ANNOTATION = f"{GROUP}/leaving-by"
# Written by the operator on a leaving server's Lease once a committed placement no longer names
# it (the value: that placement's version). The server exits once it reads this and no client holds
# a slot: a terminating pod's mounted ConfigMap is not refreshed any more, so its own files may
# never say so.
RELEASED_ANNOTATION = f"{GROUP}/released-by-placement"
# An attention client's word on the servers it routes around now: the ordinals (comma-separated,
# ascending) of the expert servers of its placement that it failed over and that have not rejoined.
# Written at once when that set changes (not at the next renewal); the operator takes it as one of
# the pieces of evidence that a server is lost (:mod:`eaas.operator.expert_step`).
FAILED_OVER_ANNOTATION = f"{GROUP}/failed-over-servers"

# Placement ConfigMap keys and mount ------------------------------------------------------------
PLACEMENT_KEY = "placement.json"  # the committed placement: what clients route by
PENDING_KEY = "pending.json"  # the next placement, being loaded by its servers (absent when none)
PLACEMENT_MOUNT = "/etc/eaas/placement"
CHECKPOINT_MOUNT = "/models"

# Environment of the pods (the runtime reads its settings from these) ---------------------------
ENV_POD_NAME = "EAAS_POD_NAME"
ENV_NAMESPACE = "EAAS_NAMESPACE"
ENV_POD_UID = "EAAS_POD_UID"  # owner of the pod's Lease, so it is deleted with the pod
ENV_SERVICE = "EAAS_MOESERVICE"
ENV_POOL = "EAAS_POOL"
ENV_ORDINAL = "EAAS_SERVER_ORDINAL"
ENV_TRANSPORT = "EAAS_TRANSPORT"
ENV_CHECKPOINT = "EAAS_CHECKPOINT"
# The checkpoint's revision (MoEService spec.model.revision, else a hash of where the checkpoint is):
# an attention client uses only expert servers of its own revision and names it in every answer.
ENV_MODEL_REVISION = "EAAS_MODEL_REVISION"
ENV_PLACEMENT_FILE = "EAAS_PLACEMENT_FILE"
ENV_PENDING_FILE = "EAAS_PENDING_PLACEMENT_FILE"
ENV_PLACEMENT_CONFIGMAP = "EAAS_PLACEMENT_CONFIGMAP"
ENV_PORT = "EAAS_PORT"
ENV_DATA_PORT = "EAAS_DATA_PORT"
ENV_DEVICE = "EAAS_DEVICE"  # where an expert server computes: "cuda" on GPU pods, else "cpu"
ENV_KERNEL_BACKEND = "EAAS_KERNEL_BACKEND"  # spec.kernelBackend, else "triton" on GPU pods and "torch" on CPU
# torch's intra-op threads: the operator gives the container's CPU request, rounded up to whole cores
# (the Downward API's requests.cpu with divisor 1); 0, when nothing is requested, keeps torch's default
ENV_THREADS = "EAAS_THREADS"
ENV_EXPERT_SERVICE = "EAAS_EXPERT_SERVICE"
ENV_EXPERT_PORT = "EAAS_EXPERT_PORT"
ENV_HEARTBEAT_INTERVAL = "EAAS_HEARTBEAT_INTERVAL_SECONDS"
ENV_HEARTBEAT_TIMEOUT = "EAAS_HEARTBEAT_TIMEOUT_SECONDS"
# How long a process serves on after SIGTERM (the pod's grace period less a margin for the exit)
ENV_DRAIN_TIMEOUT = "EAAS_DRAIN_TIMEOUT_SECONDS"
ENV_MICRO_BATCHES = "EAAS_MICRO_BATCHES"  # micro-batches per step of an attention client: 1, 2, 3 or auto
ENV_DATA_TOKENS = "EAAS_DATA_TOKENS"  # data tokens given directly (whitespace-separated)
ENV_DATA_TOKEN_FILE = "EAAS_DATA_TOKEN_FILE"  # the file of a mounted Secret that holds them
DATA_TOKEN_MOUNT = "/etc/eaas/data-token"
DATA_TOKEN_KEY = "tokens"  # key of the MoEService's data-token Secret (and file name in the mount)
ENV_API_KEYS = "EAAS_API_KEYS"  # bearer keys the attention client accepts, whitespace-separated

EXPERT_SERVER_COMMAND = ("eaas", "expert-server")
ATTENTION_CLIENT_COMMAND = ("eaas", "attention-client")
