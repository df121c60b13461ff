"""``ExpertServer``: hosted experts + transports + the loop + the control port, in one process.

    server = ExpertServer.from_placement("ckpt/", placement, ordinal=0)
    server.start()            # loop and control port in background threads
    ...  server.url  ...      # http://127.0.0.1:<port>: clients attach here
    server.stop()

``serve_forever()`` runs the loop in the calling thread instead (the CLI does that).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from eaas.kernels import get_backend
from eaas.runtime.auth import Tokens
from eaas.runtime.model import CheckpointReader, ExpertStack
from eaas.runtime.model.checkpoint import DTYPES
from eaas.runtime.placement import Placement
from eaas.runtime.protocol import ServerLimits, slot_capacity_bytes
from eaas.runtime.server.batch import warm_up
from eaas.runtime.server.control import ControlError, ControlServer
from eaas.runtime.server.loop import LoopOptions, ServerLoop
from eaas.runtime.server.metrics import ServerMetrics
from eaas.runtime.server.peers import Offer, PeerSource
from eaas.runtime.server.restack import hosted_layers, load_experts, restack
from eaas.runtime.server.stats import LoadCounter
from eaas.runtime.transport import (
    OfferRefused,
    ServerTransport,
    SlotsExhausted,
    TransportOptions,
    get_transport,
)
from eaas.runtime.transport.shm_segment import sweep_stale_segments

log = logging.getLogger("eaas.server")


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` -> a device with its index; a clear error when CUDA is missing."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: must be cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but this process sees no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {name!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class ServerConfig:
    checkpoint: Path
    hosted: tuple[tuple[int, int], ...]  # (layer, expert) pairs to load and serve
    ordinal: int = 0
    placement_version: int = 0
    host: str = "127.0.0.1"  # address of the control port and the tcp transport
    control_port: int = 0  # 0 = any free port
    tcp_port: int = 0
    transports: tuple[str, ...] = ("shm", "tcp")
    max_clients: int = 16  # slots per transport
    max_tokens: int = 512  # tokens per request (clients split larger batches)
    kernel_backend: str = "torch"  # overrides loop.kernel_backend
    dtype: str | None = None  # weight dtype; None = the checkpoint's
    device: str = "cpu"  # where the experts live and compute: "cpu", "cuda" or "cuda:N"
    loop: LoopOptions = field(default_factory=LoopOptions)
    data_tokens: Tokens = field(default_factory=Tokens)  # bearer tokens the slot routes require (none: open)
    peers: PeerSource | None = None  # live servers to fetch experts from before the checkpoint
    revision: str | None = None  # the checkpoint's revision: clients of another revision refuse this server


class ExpertServer:
    def __init__(self, config: ServerConfig) -> None:
        if not config.hosted:
            raise ValueError(f"server {config.ordinal}: hosts no (layer, expert) pair; nothing to serve")
        if config.dtype is not None and config.dtype not in (*DTYPES, "fp8"):
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, fp8, got {config.dtype!r}")
        keep_fp8 = config.dtype == "fp8"
        if keep_fp8 and config.kernel_backend == "grouped_mm":
            raise ValueError("dtype fp8: the grouped_mm backend has no FP8 path; use --kernel-backend triton")
        if config.max_tokens < 1 or config.max_clients < 1:
            raise ValueError("max_tokens and max_clients must be >= 1")
        get_backend(config.kernel_backend)  # unknown names fail here, not on the first request
        for name in config.transports:
            get_transport(name)
        self.device = resolve_device(config.device)
        self.config = config
        self.instance = uuid.uuid4().hex[:12]
        reader = CheckpointReader(config.checkpoint)
        self.model = reader.config
        dtype = DTYPES[config.dtype] if config.dtype and not keep_fp8 else None
        stack, self.from_peers = load_experts(
            reader, config.hosted, dtype, keep_fp8, config.peers, progress=True
        )
        stack = stack.to(self.device)
        self._warm_up(stack, config.kernel_backend, config.max_tokens)
        capacity = slot_capacity_bytes(config.max_tokens, self.model.top_k, self.model.hidden_size)
        limits = ServerLimits(
            hidden=self.model.hidden_size,
            num_experts=self.model.num_experts,
            max_top_k=self.model.top_k,
            max_tokens=config.max_tokens,
            capacity_bytes=capacity,
            moe_layers=frozenset(self.model.moe_layers),
            hosted_layers=hosted_layers(stack),
        )
        self.placement_version = config.placement_version  # of the experts the loop serves now
        self.placement_error: str | None = None  # the last placement change that failed, if any
        self._rehost_lock = threading.Lock()
        # (transport, slot) -> the placement version its client routes by (when it said so)
        self._slot_versions: dict[tuple[str, int], int] = {}
        # (transport, slot) -> the client's Lease and when the slot attached (when it named one)
        self._slot_leases: dict[tuple[str, int], tuple[str, float]] = {}
        self._slot_lock = threading.Lock()  # attaching vs freeing by Lease: never free a new client's slot
        sweep_stale_segments()
        self.transports: dict[str, ServerTransport] = {}
        try:
            for name in config.transports:
                options = TransportOptions(
                    max_clients=config.max_clients,
                    capacity_bytes=capacity,
                    host=config.host,
                    tcp_port=config.tcp_port,
                    tag=f"s{config.ordinal}",
                    device=str(self.device),
                )
                self.transports[name] = get_transport(name).server(options)
            self.metrics = ServerMetrics()
            self.metrics.hosted_experts.set(len(stack.pairs))
            self.metrics.placement_version.set(config.placement_version)
            self.load = LoadCounter(self.model.num_layers, self.model.num_experts, self.device)
            loop_options = replace(config.loop, kernel_backend=config.kernel_backend)
            self.loop = ServerLoop(
                stack, list(self.transports.values()), limits, self.metrics, self.load, loop_options
            )
            self.control = ControlServer(self, config.host, config.control_port, config.data_tokens)
        except BaseException:
            for transport in self.transports.values():
                transport.close()
            raise
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False
        # Set on SIGTERM (:mod:`eaas.runtime.server.departure`): when the server will be gone. It
        # serves on (slots and attaches) but reports not ready until then.
        self.leaving_deadline: datetime | None = None

    @classmethod
    def from_placement(
        cls, checkpoint: str | Path, placement: Placement, ordinal: int, **options: Any
    ) -> ExpertServer:
        """The server ``ordinal`` of ``placement``, hosting exactly ``placement.experts_of(ordinal)``."""
        hosted = tuple(placement.experts_of(ordinal))
        return cls(
            ServerConfig(
                Path(checkpoint), hosted, ordinal=ordinal, placement_version=placement.version, **options
            )
        )

    # --- hosted experts --------------------------------------------------------------------------
    @property
    def stack(self) -> ExpertStack:
        """The experts the loop serves now (replaced as a whole by :meth:`rehost`)."""
        return self.loop.stack

    @property
    def limits(self) -> ServerLimits:
        return self.loop.limits

    def rehost(self, pairs: Iterable[tuple[int, int]], version: int, timeout_s: float = 30.0) -> bool:
        """Serve exactly ``pairs`` as placement ``version``, from the next batch on.

        Loads only the pairs not hosted now (kept ones are reused, not re-read), builds a new
        stack while the loop keeps serving the old one, hands it to the loop and waits until the
        loop has adopted it between two batches. Returns False when the loop stopped first.
        Raises ``ValueError``/``OSError`` (pair not in the model, unreadable checkpoint); the old
        experts are then still served.
        """
        with self._rehost_lock:
            old = self.stack
            reader = CheckpointReader(self.config.checkpoint)
            stack, num_loaded = restack(old, reader, pairs, self.config.peers)
            self._warm_up(stack, self.config.kernel_backend, self.config.max_tokens)  # before the loop has it
            limits = replace(self.limits, hosted_layers=hosted_layers(stack))
            adopted = threading.Event()

            def on_adopted() -> None:  # in the loop thread, between batches
                self.placement_version = version
                self.metrics.hosted_experts.set(len(stack.pairs))
                self.metrics.placement_version.set(version)
                adopted.set()

            self.loop.swap_stack(stack, limits, on_adopted)
            deadline = time.monotonic() + timeout_s
            while not adopted.wait(0.05):
                if self.loop.stop_event.is_set() or time.monotonic() > deadline:
                    return False
            kept = len(set(old.pairs) & set(stack.pairs))
            log.info(
                "placement v%d: serving %d experts (%d loaded, %d kept, %d dropped)",
                version,
                len(stack.pairs),
                num_loaded,
                kept,
                len(old.pairs) - kept,
            )
            return True

    def experts(self, pairs: list[tuple[int, int]]) -> Offer:
        """The weights of those of `pairs` this server hosts, for a peer that must host them too."""
        return Offer.of(self.stack, pairs, self.instance)

    def set_placement_version(self, version: int) -> None:
        """A newer placement that gives this server the experts it already serves."""
        self.placement_version = version
        self.metrics.placement_version.set(version)

    def _warm_up(self, stack: ExpertStack, backend: str, max_tokens: int) -> None:
        """``batch.warm_up``; a failure is logged, not raised (each request then reports it)."""
        try:
            seconds = warm_up(stack, backend, max_tokens)
        except Exception as exc:
            log.warning(
                "server %d: warm-up of %d experts failed: %s", self.config.ordinal, len(stack.pairs), exc
            )
            return
        log.info(
            "server %d: warm-up ran each of %d experts once in %.2f s",
            self.config.ordinal,
            len(stack.pairs),
            seconds,
        )

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.control.port}"

    @property
    def tcp_port(self) -> int | None:
        tcp = self.transports.get("tcp")
        return getattr(tcp, "port", None)

    def start(self) -> ExpertServer:
        """Serves in background threads; returns at once (ready to attach)."""
        self._thread = threading.Thread(
            target=self._run_loop, name=f"eaas-server-{self.config.ordinal}", daemon=True
        )
        self._thread.start()
        self.control.start()
        self._ready.set()
        self.metrics.ready.set(1)
        return self

    def serve_forever(self) -> None:
        """Serves in the calling thread until ``stop()`` (or a signal handler calling it)."""
        self.control.start()
        self._ready.set()
        self.metrics.ready.set(1)
        try:
            self._run_loop()
        finally:
            self.close()

    def _run_loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            if self.device.type == "cuda":
                # The loop computes on a stream of its own: never the legacy default stream, which
                # would wait for (and be waited on by) every other stream of the process.
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(torch.cuda.Stream(self.device)):
                    self.loop.run()
            else:
                self.loop.run()
        except Exception:
            log.exception("server loop crashed")
            raise
        finally:
            self._ready.clear()
            self.metrics.ready.set(0)

    def stop(self) -> None:
        """Stops serving (from any thread) and releases ports and shared memory."""
        self.loop.stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.stop_event.set()
        self.control.stop()
        for transport in self.transports.values():
            transport.close()

    def __enter__(self) -> ExpertServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what the control port serves ----------------------------------------------------------
    def is_healthy(self) -> bool:
        return not self.loop.stop_event.is_set()

    def is_serving(self) -> bool:
        """Experts loaded and the loop running: slots may be attached (also while leaving)."""
        return self._ready.is_set() and not self.loop.stop_event.is_set()

    def is_ready(self) -> bool:
        """Serving and not leaving (``/readyz``)."""
        return self.is_serving() and self.leaving_deadline is None

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def info(self) -> dict[str, Any]:
        m = self.model
        transports: dict[str, Any] = {name: t.describe() for name, t in self.transports.items()}
        if "tcp" in transports:
            transports["tcp"]["port"] = self.tcp_port
        stack = self.stack
        return {
            "ordinal": self.config.ordinal,
            "instance": self.instance,
            "pid": os.getpid(),
            "placement_version": self.placement_version,
            "placement_error": self.placement_error,
            "leaving_by": self.leaving_deadline.isoformat() if self.leaving_deadline else None,
            "model": {
                "family": m.family,
                "hidden_size": m.hidden_size,
                "num_layers": m.num_layers,
                "num_experts": m.num_experts,
                "top_k": m.top_k,
                "moe_layers": m.moe_layers,
                "revision": self.config.revision,
            },
            "hosted": [list(pair) for pair in stack.pairs],
            "transports": transports,
            "max_tokens": self.limits.max_tokens,
            "capacity_bytes": self.limits.capacity_bytes,
            "kernel_backend": self.config.kernel_backend,
            "device": str(self.device),
            "dtype": str(stack.w13.dtype).removeprefix("torch."),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "ordinal": self.config.ordinal,
            "instance": self.instance,
            "placement_version": self.placement_version,
            "busy_seconds": self.loop.busy_seconds,  # computing batches since start: the cost per token
            **self.load.to_json(self.model.moe_layers),
        }

    def slots(self) -> list[dict[str, Any]]:
        return [{"transport": name, **row} for name, t in self.transports.items() for row in t.slots()]

    def attach(
        self,
        client_id: str,
        transport: str,
        placement_version: int | None = None,
        lease: str | None = None,
        offer: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not self.is_serving():
            raise ControlError(HTTPStatus.SERVICE_UNAVAILABLE, "server is not ready")
        if transport not in self.transports:
            raise ControlError(
                HTTPStatus.BAD_REQUEST,
                f"transport: this server offers {', '.join(self.transports)}, got {transport!r}",
            )
        with self._slot_lock:
            try:
                handle = self.transports[transport].attach(client_id, offer)
            except SlotsExhausted as exc:
                raise ControlError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc
            except OfferRefused as exc:
                raise ControlError(HTTPStatus.BAD_REQUEST, str(exc)) from exc
            key = (transport, int(handle["slot"]))
            if placement_version is None:
                self._slot_versions.pop(key, None)
            else:
                self._slot_versions[key] = placement_version
            if lease is None:
                self._slot_leases.pop(key, None)
            else:
                self._slot_leases[key] = (lease, time.monotonic())
        log.info(
            "client %s attached to %s slot %d%s",
            client_id,
            transport,
            handle["slot"],
            f" (Lease {lease})" if lease else "",
        )
        return {
            **handle,
            "instance": self.instance,
            "ordinal": self.config.ordinal,
            "max_tokens": self.limits.max_tokens,
        }

    def detach(self, transport: str, slot: int, client_id: str | None = None) -> bool:
        """Frees a slot; with `client_id`, only while that client holds it (its connection may have
        broken and the slot gone to another client before this release arrived)."""
        t = self.transports.get(transport)
        with self._slot_lock:
            if client_id is not None and t is not None:
                holders = {
                    int(row["slot"]): row["client_id"] for row in t.slots() if row["state"] != "OFFLINE"
                }
                if holders.get(slot) != client_id:
                    return False
            self._slot_versions.pop((transport, slot), None)
            self._slot_leases.pop((transport, slot), None)
            return t is not None and t.detach(slot)

    def attached_slots(self) -> set[tuple[str, int]]:
        """(transport, slot) of the slots a client holds (not released, reaped or OFFLINE)."""
        return {(row["transport"], int(row["slot"])) for row in self.slots() if row["state"] != "OFFLINE"}

    def reap_expired_leases(self, expired: Callable[[str, float], bool]) -> list[tuple[str, int, str]]:
        """Frees every attached slot whose client's Lease is ``expired(lease, attached_at)``;
        returns them as (transport, slot, lease)."""
        freed = []
        with self._slot_lock:
            attached = self.attached_slots()
            for key, (lease, attached_at) in list(self._slot_leases.items()):
                if key not in attached:  # released or reaped since: its client is gone anyway
                    del self._slot_leases[key]
                    continue
                if not expired(lease, attached_at):
                    continue
                transport, slot = key
                del self._slot_leases[key]
                self._slot_versions.pop(key, None)
                if self.transports[transport].detach(slot):
                    freed.append((transport, slot, lease))
        for transport, slot, lease in freed:
            log.warning("freed %s slot %d: the Lease %s of its client expired", transport, slot, lease)
            self.metrics.reaped_slots.labels("lease_expired").inc()
        return freed

    def oldest_client_placement(self) -> int | None:
        """The oldest placement version an attached client still routes by (None: none said).

        A slot whose client detached or whose connection died (OFFLINE) no longer counts."""
        attached = self.attached_slots()
        versions = [v for key, v in list(self._slot_versions.items()) if key in attached]
        return min(versions) if versions else None
