"""Following the placement ConfigMap: a running server loads the experts a new placement gives it.

The operator's placement ConfigMap is mounted as a directory with ``placement.json`` (committed:
what clients route by) and, during a change, ``pending.json`` (what servers must load before it
is committed); kubelet replaces the files in place when the ConfigMap changes. Every
``poll_s`` the watcher stats both files (cheap) and reads them only when a stat changed; a
content change becomes a :class:`Target` — the experts this ordinal must serve — and the server
is re-hosted (only new experts read from the checkpoint; the loop swaps stacks between batches).

While a placement is pending, a server serves the union of its committed and pending experts:
clients still route by the committed placement, so nothing they may send is dropped before the
commit; once committed (``pending.json`` gone), the experts only the old placement had are
dropped — once no attached client still routes by an older placement: a client's requests finish
on the placement they started with (it says which when it attaches a slot), so the experts only
that placement had stay until its slots are released or their connections die. A server that is
in neither placement (being drained) keeps serving what it has.
A file that does not parse, or a placement whose experts cannot be loaded, is logged and counted
(``eaas_expert_server_placement_errors_total``, ``/v1/info`` ``placement_error``); the server
keeps serving its current experts and retries when the files change again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.placement import Placement, PlacementError, stored
from eaas.runtime.placement.placement import LayerExpert
from eaas.runtime.server.daemon import DaemonLoop
from eaas.runtime.server.peers import holders_in

if TYPE_CHECKING:
    from eaas.runtime.server.expert_server import ExpertServer

log = logging.getLogger("eaas.server.placement")

FileStamp = tuple[int, int, int, int] | None  # (device, inode, mtime ns, size); None = absent


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


class PlacementFiles:
    """``placement.json`` and ``pending.json`` of one directory (either may be absent)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.committed_path = self.directory / PLACEMENT_KEY
        self.pending_path = self.directory / PENDING_KEY

    def stamps(self) -> tuple[FileStamp, FileStamp]:
        return _stamp(self.committed_path), _stamp(self.pending_path)

    def read_texts(self) -> tuple[bytes | None, bytes | None]:
        """The files' contents as they are (packed or JSON: :mod:`eaas.runtime.placement.stored`)."""
        return _read(self.committed_path), _read(self.pending_path)

    def parse(self, texts: tuple[bytes | None, bytes | None]) -> tuple[Placement | None, Placement | None]:
        """(committed, pending); raises ``PlacementError`` naming the file and the problem."""
        placements: list[Placement | None] = []
        for path, text in zip((self.committed_path, self.pending_path), texts, strict=True):
            try:
                placements.append(None if text is None else stored.unpack(text))
            except PlacementError as error:
                raise PlacementError(f"{path}: {error}") from error
        return placements[0], placements[1]

    def read(self) -> tuple[Placement | None, Placement | None]:
        return self.parse(self.read_texts())


def initial_target(files: PlacementFiles, ordinal: int) -> Target:
    """What a starting server loads; raises ``PlacementError`` when there is nothing for it."""
    committed, pending = files.read()
    if committed is None and pending is None:
        raise PlacementError(f"{files.directory}: neither {PLACEMENT_KEY} nor {PENDING_KEY} exists")
    target = target_for(ordinal, committed, pending)
    if target is None:
        versions = ", ".join(
            f"{key} v{p.version} has servers {list(p.ordinals)}"
            for key, p in ((PLACEMENT_KEY, committed), (PENDING_KEY, pending))
            if p is not None
        )
        raise PlacementError(f"{files.directory}: server {ordinal} is in no placement ({versions})")
    return target


class PlacementWatcher(DaemonLoop):
    """Polls a :class:`PlacementFiles` in a daemon thread and re-hosts ``server`` on changes."""

    def __init__(
        self,
        server: ExpertServer,
        files: PlacementFiles,
        poll_s: float = 1.0,
        on_version: Callable[[], None] | None = None,
    ) -> None:
        """`on_version` is called after the server's placement version changed (its heartbeat
        tells the operator at once, which commits a pending placement once all its servers did)."""
        if poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {poll_s}")
        self.server = server
        self.files = files
        self.poll_s = poll_s
        self.on_version = on_version
        self._stamps: tuple[FileStamp, FileStamp] | None = None
        self._digest = ""
        self._lingering: Target | None = None  # the target whose drops wait for older clients
        # Whether the files, as last read, name this server (None: none read yet). A leaving
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
                log.exception("checking the placement files failed")
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
        """One poll: re-host when the files' contents changed to a placement that moves experts."""
        stamps = self.files.stamps()
        if stamps == self._stamps:
            return
        texts = self.files.read_texts()
        if self.files.stamps() != stamps:  # written while we read: look again next poll
            return
        self._stamps = stamps
        digest = hashlib.sha256(repr(texts).encode()).hexdigest()
        if digest == self._digest:
            return
        self._digest = digest
        try:
            committed, pending = self.files.parse(texts)
        except PlacementError as error:
            self._fail(str(error))
            return
        self.server.placement_error = None  # the files are good again
        if self.server.config.peers is not None:
            self.server.config.peers.follow(holders_in(committed, pending))
        ordinal = self.server.config.ordinal
        if committed is not None or pending is not None:
            self.named = any(p is not None and ordinal in p.ordinals for p in (committed, pending))
        if committed is None and pending is None:
            log.warning("%s: no placement file; keeping placement v%d", self.files.directory, self._version())
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
                self._stamps, self._digest = None, ""
        except (ValueError, OSError) as error:
            self._fail(f"placement v{target.version}: cannot load its experts: {error}")

    def _fail(self, message: str) -> None:
        self.server.placement_error = message
        self.server.metrics.placement_errors.inc()
        log.error("%s; still serving placement v%d", message, self._version())

    def _version(self) -> int:
        return self.server.placement_version


def _stamp(path: Path) -> FileStamp:
    try:
        st = os.stat(path)  # follows kubelet's ..data symlinks to the current file
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
