"""Leaving on purpose: what an expert server does between SIGTERM and its exit.

``kubectl delete pod``, an eviction, ``kubectl drain`` and a node's graceful shutdown all send
SIGTERM and give the pod its grace period before SIGKILL. A server that exited at once would break
R for every expert it holds until the operator noticed; instead it uses the grace period to hand
its experts over:

1. It keeps serving — every slot, every attach — but reports not ready (``/readyz`` 503) and
   announces on its Lease when it will be gone (:data:`~eaas.runtime.contract.LEAVING_ANNOTATION`),
   renewing it at once. The operator reads the announcement (or the pod's deletion) and drains the
   server like a retirement: the placement without it is loaded by the others and committed while
   it still serves.
2. It exits once no placement names it any more (neither ``placement.json`` nor ``pending.json``)
   *and* no client holds a slot on it: a client routes by the placement it read, and releases the
   old placement's slots only when it switches to the new one, so the last request routed here has
   been answered. A client that hung keeps its slot until its own Lease expires (the slots of such
   clients are freed by :mod:`~eaas.runtime.server.client_leases`).
3. Whatever happens, it exits when ``timeout_s`` has passed (the grace period less a margin): an
   operator that is down, or a client that never lets go, cannot turn a drain into a SIGKILL.

A second SIGTERM, or SIGINT, stops the server at once. Without a placement directory (``eaas
local``, a placement file read once) nothing can take the server's experts over, so SIGTERM stops
it at once too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from eaas.runtime.server.daemon import DaemonLoop

if TYPE_CHECKING:
    from eaas.runtime.server.expert_server import ExpertServer

log = logging.getLogger("eaas.server.departure")

POLL_S = 0.05


class Departure(DaemonLoop):
    """Started on the first SIGTERM: stops ``server`` once :meth:`may_go` (polled every 50 ms).

    ``named()`` says whether the placement files (as last read) name this server; None while
    nothing has been read. ``announce`` is called once, with the deadline, when leaving begins
    (the heartbeat renews its Lease with the announcement)."""

    def __init__(
        self,
        server: ExpertServer,
        named: Callable[[], bool | None],
        timeout_s: float,
        announce: Callable[[datetime], None] = lambda deadline: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s < 0:
            raise ValueError(f"drain timeout: must be >= 0 s, got {timeout_s}")
        self.server = server
        self.named = named
        self.timeout_s = timeout_s
        self.announce = announce
        self.clock = clock
        self.started: float | None = None
        self._begun = threading.Lock()
        super().__init__("eaas-departure")

    @property
    def leaving(self) -> bool:
        return self.started is not None

    def begin(self) -> bool:
        """Starts leaving (False when it already had: the caller then stops the server at once).
        Safe from a signal handler: it only sets state and starts a thread."""
        if not self._begun.acquire(blocking=False):
            return False
        self.started = self.clock()
        deadline = datetime.now(UTC) + timedelta(seconds=self.timeout_s)
        self.server.leaving_deadline = deadline
        log.info(
            "SIGTERM: leaving; serving on until no placement names this server and no client holds "
            "a slot (at most %.0f s)",
            self.timeout_s,
        )
        self.start()
        self.announce(deadline)
        return True

    def may_go(self) -> str:
        """Why the server may exit now ("" while it must stay)."""
        assert self.started is not None
        if self.clock() - self.started >= self.timeout_s:
            return "timeout"
        if self.named() is False and not self.server.attached_slots():
            return "released"
        return ""

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            reason = self.may_go()
            if reason:
                waited = self.clock() - (self.started or 0.0)
                if reason == "timeout":
                    log.warning(
                        "leaving: still named by a placement or holding slots (%s) after %.1f s; "
                        "exiting anyway",
                        self._holding(),
                        waited,
                    )
                else:
                    log.info("leaving: no placement names this server and no client holds a slot; exiting")
                self.server.loop.stop_event.set()
                return

    def _holding(self) -> str:
        named = self.named()
        slots = self.server.attached_slots()
        parts = [f"placement names it: {named}"] + ([f"{len(slots)} slot(s) attached"] if slots else [])
        return ", ".join(parts)
