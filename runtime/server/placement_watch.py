"""Following the placement ConfigMap: a running server loads the experts a new placement gives it.

The operator's placement ConfigMap holds ``placement.json`` (committed: what clients route by)
and, during a change, ``pending.json`` (what servers must load before it is committed). The
server reads them from a :class:`~eaas.runtime.placement.source.PlacementSource`: the ConfigMap
as its watch on the object last saw it, or the mounted files (which the kubelet refreshes only
every minute or so) where those are newer or the API server cannot be reached. Every ``poll_s``
the watcher asks the source (cheap: files are read only when a stat changed, the watch keeps its
state in memory); a content change becomes a :class:`Target` — the experts this ordinal must
serve — and the server is re-hosted (only new experts read from the checkpoint; the loop swaps
stacks between batches).

While a placement is pending, a server serves the union of its committed and pending experts:
clients still route by the committed placement, so nothing they may send is dropped before the
commit; once committed (``pending.json`` gone), the experts only the old placement had are
dropped — once no attached client still routes by an older placement: a client's requests finish
on the placement they started with (it says which when it attaches a slot), so the experts only
that placement had stay until its slots are released or their connections die. A server that is
in neither placement (being drained) keeps serving what it has.
A placement that does not parse, or whose experts cannot be loaded, is logged and counted
(``eaas_expert_server_placement_errors_total``, ``/v1/info`` ``placement_error``); the server
keeps serving its current experts and retries when the placement changes again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.placement import Placement, PlacementError
from eaas.runtime.placement.placement import LayerExpert
from eaas.runtime.placement.source import PlacementBytes, PlacementSource
from eaas.runtime.server.daemon import DaemonLoop
from eaas.runtime.server.peers import holders_in

if TYPE_CHECKING:
    from eaas.runtime.server.expert_server import ExpertServer

log = logging.getLogger("eaas.server.placement")


@dataclass(frozen=True)
class Target:
    """What one server must serve: its pairs, reported as placement ``version``."""

    version: int
    pairs: frozenset[LayerExpert]


def target_for(ordinal: int, committed: Placement | None, pending: Placement | None) -> Target | None:
    """The experts ``ordinal`` serves under (committed, pending); None when it is in neither.

    With a pending placement that names it: the union of both sets, as the pending version (the
    operator commits once every pending server reports that version). Otherwise the committed set.
    """
    in_committed = committed is not None and ordinal in committed.ordinals
    in_pending = pending is not None and ordinal in pending.ordinals
    pairs: set[LayerExpert] = set()
    if in_committed:
        assert committed is not None
        pairs.update(committed.experts_of(ordinal))
    if in_pending:
        assert pending is not None
        pairs.update(pending.experts_of(ordinal))
        return Target(pending.version, frozenset(pairs))
    if in_committed:
        assert committed is not None
        return Target(committed.version, frozenset(pairs))
    return None


def initial_target(source: PlacementSource, ordinal: int) -> Target:
    """What a starting server loads; raises ``PlacementError`` when there is nothing for it."""
    texts = source.read()
    committed, pending = texts.parse()
    if committed is None and pending is None:
        raise PlacementError(f"{source.origin}: neither {PLACEMENT_KEY} nor {PENDING_KEY} exists")
    target = target_for(ordinal, committed, pending)
    if target is None:
        versions = ", ".join(
            f"{key} v{p.version} has servers {list(p.ordinals)}"
            for key, p in ((PLACEMENT_KEY, committed), (PENDING_KEY, pending))
            if p is not None
        )
        raise PlacementError(f"{texts.origin}: server {ordinal} is in no placement ({versions})")
    return target


class PlacementWatcher(DaemonLoop):
    """Polls a :class:`PlacementSource` in a daemon thread and re-hosts ``server`` on changes."""

    def __init__(
        self,
        server: ExpertServer,
        source: PlacementSource,
        poll_s: float = 1.0,
        on_version: Callable[[], None] | None = None,
    ) -> None:
        """`on_version` is called after the server's placement version changed (its heartbeat
        tells the operator at once, which commits a pending placement once all its servers did)."""
        if poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {poll_s}")
        self.server = server
        self.source = source
        self.poll_s = poll_s
        self.on_version = on_version
        self._texts: PlacementBytes | None = None  # as last read
        self._digest = ""
        self._lingering: Target | None = None  # the target whose drops wait for older clients
        # Whether the placement, as last read, names this server (None: none read yet). A leaving
        # server (:mod:`eaas.runtime.server.departure`) goes once they do not.
        self.named: bool | None = None
        super().__init__("eaas-placement-watch")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            version = self._version()
            try:
                self.check()
                self.release_lingering()
            except Exception:  # a bug here must not stop the watching, nor the serving
                log.exception("checking the placement failed")
            if self._version() != version and self.on_version is not None:
                self.on_version()

    def _older_clients(self, version: int) -> bool:
        oldest = self.server.oldest_client_placement()
        return oldest is not None and oldest < version

    def release_lingering(self) -> None:
        """Drops the experts kept for clients on an older placement once none is attached."""
        target = self._lingering
        if target is None or self._older_clients(target.version):
            return
        self._lingering = None
        if target.version == self._version():
            log.info("no client routes by an older placement now: dropping its experts")
            self._rehost(target)

    def check(self) -> None:
        """One poll: re-host when the placement changed to one that moves experts."""
        texts = self.source.read()
        if texts is self._texts:  # the source hands the same object while nothing changed
            return
        self._texts = texts
        digest = hashlib.sha256(repr((texts.committed, texts.pending)).encode()).hexdigest()
        if digest == self._digest:
            return
        self._digest = digest
        try:
            committed, pending = texts.parse()
        except PlacementError as error:
            self._fail(str(error))
            return
        self.server.placement_error = None  # the placement is good again
        if self.server.config.peers is not None:
            self.server.config.peers.follow(holders_in(committed, pending))
        ordinal = self.server.config.ordinal
        if committed is not None or pending is not None:
            self.named = any(p is not None and ordinal in p.ordinals for p in (committed, pending))
        if committed is None and pending is None:
            log.warning("%s: no placement; keeping placement v%d", texts.origin, self._version())
            return
        self._apply(target_for(ordinal, committed, pending))

    def _apply(self, target: Target | None) -> None:
        server, version = self.server, self._version()
        if target is None:
            log.info(
                "server %d is in no placement any more (being drained): keeps serving placement v%d",
                server.config.ordinal,
                version,
            )
            return
        if target.version < version:
            log.warning("ignoring placement v%d: older than the loaded v%d", target.version, version)
            return
        self._lingering = None
        current = frozenset(server.stack.pairs)
        if not current <= target.pairs and self._older_clients(target.version):
            # Requests that started on an older placement may still route the dropped experts here.
            self._lingering = target
            target = Target(target.version, target.pairs | current)
            log.info(
                "placement v%d: keeping %d experts for clients still on v%d",
                target.version,
                len(target.pairs - self._lingering.pairs),
                self.server.oldest_client_placement(),
            )
        if target.pairs == frozenset(server.stack.pairs):
            if target.version != version:
                server.set_placement_version(target.version)
                log.info("placement v%d: same %d experts, nothing to load", target.version, len(target.pairs))
            return
        self._rehost(target)

    def _rehost(self, target: Target) -> None:
        try:
            if not self.server.rehost(target.pairs, target.version):  # not taken (stopping): retry
                self._texts, self._digest = None, ""
        except (ValueError, OSError) as error:
            self._fail(f"placement v{target.version}: cannot load its experts: {error}")

    def _fail(self, message: str) -> None:
        self.server.placement_error = message
        self.server.metrics.placement_errors.inc()
        log.error("%s; still serving placement v%d", message, self._version())

    def _version(self) -> int:
        return self.server.placement_version
