"""Where a pod reads the placement: its mounted ConfigMap files, and a watch on the ConfigMap itself.

The operator publishes a pool's placement in its ConfigMap (:mod:`eaas.runtime.placement.stored`):
``placement.json`` committed, ``pending.json`` being loaded. The pods mount it, but a kubelet
refreshes a mounted ConfigMap only at its sync period plus its cache's TTL (a minute or more),
and every placement change needs two or three such propagations (pending → servers load →
commit → clients route). So each pod that knows its ConfigMap's name and namespace also
**watches** the object (a list, then a watch, both with ``fieldSelector=metadata.name=<name>``,
as the pod's ServiceAccount: the same credentials as its Lease). A change reaches the pod as
soon as the API server stores it.

:class:`PlacementSource` hands its reader the (committed, pending) bytes of whichever of the two
is newer, and never older ones than it handed before. "Newer" is by the placements' versions:
the key ``(newest version of the two, committed version)``, which grows with every placement the
operator publishes (a pending placement gets a version above every earlier one; committing it
raises the committed version). The files stay the fallback: where the API server cannot be
reached (or refuses: no RBAC), and without Kubernetes (``eaas local``), where no ConfigMap exists.

Watch errors (API server gone, 403, an expired resourceVersion) are logged with what to do,
retried with backoff (0.5 s doubling to :data:`MAX_RETRY_S`), and the next attempt lists again;
they never stop the serving.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaas.runtime.contract import PENDING_KEY, PLACEMENT_KEY
from eaas.runtime.lease import api_client, describe, raw_options, response_json
from eaas.runtime.placement import stored
from eaas.runtime.placement.placement import Placement, PlacementError
from eaas.runtime.server.daemon import DaemonLoop

log = logging.getLogger("eaas.placement.source")

FileStamp = tuple[int, int, int, int] | None  # (device, inode, mtime ns, size); None = absent
Newness = tuple[int, int]  # (newest version of committed and pending, committed version)

MIN_RETRY_S = 0.5
MAX_RETRY_S = 4.0  # after an API server outage the watch is back within this (a list of one object)
WATCH_S = 60  # one watch request's length (the API server ends it; the next resumes)
FIRST_SYNC_WAIT_S = 3.0  # how long a starting reader waits for the watch's first listing


@dataclass(frozen=True)
class PlacementBytes:
    """The bytes of ``placement.json`` and ``pending.json`` (None: absent), and where they came from."""

    committed: bytes | None
    pending: bytes | None
    origin: str  # a directory, or ``ConfigMap <namespace>/<name>``: named in errors

    @property
    def empty(self) -> bool:
        return self.committed is None and self.pending is None

    def parse(self) -> tuple[Placement | None, Placement | None]:
        """(committed, pending); ``PlacementError`` names the origin, the key and the problem."""
        placements: list[Placement | None] = []
        for key, raw in ((PLACEMENT_KEY, self.committed), (PENDING_KEY, self.pending)):
            try:
                placements.append(None if raw is None else stored.unpack(raw))
            except PlacementError as error:
                raise PlacementError(f"{self.origin} {key}: {error}") from error
        return placements[0], placements[1]

    def same_contents(self, other: PlacementBytes | None) -> bool:
        return other is not None and (self.committed, self.pending) == (other.committed, other.pending)


def newness(committed: Placement | None, pending: Placement | None) -> Newness | None:
    """How new a (committed, pending) pair is; None for no placement at all."""
    versions = [p.version for p in (committed, pending) if p is not None]
    if not versions:
        return None
    return max(versions), committed.version if committed is not None else 0


class MountedFiles:
    """The placement files of a mounted ConfigMap (either may be absent, or not asked for:
    an attention client reads only the committed one). Read again only when a file's stat changed."""

    def __init__(self, committed_path: Path, pending_path: Path | None = None) -> None:
        self.committed_path = Path(committed_path)
        self.pending_path = Path(pending_path) if pending_path is not None else None
        self.origin = str(self.committed_path.parent)
        self._stamps: tuple[FileStamp, FileStamp] | None = None
        self._last = PlacementBytes(None, None, self.origin)

    @classmethod
    def directory(cls, directory: Path) -> MountedFiles:
        """``placement.json`` and ``pending.json`` of a mounted placement ConfigMap."""
        return cls(Path(directory) / PLACEMENT_KEY, Path(directory) / PENDING_KEY)

    def read(self) -> PlacementBytes:
        stamps = self._stamp_all()
        if stamps == self._stamps:
            return self._last
        texts = PlacementBytes(
            _read(self.committed_path),
            _read(self.pending_path) if self.pending_path is not None else None,
            self.origin,
        )
        if self._stamp_all() == stamps:  # not written while we read (else: read again next time)
            self._stamps, self._last = stamps, texts
        return texts

    def _stamp_all(self) -> tuple[FileStamp, FileStamp]:
        pending = _stamp(self.pending_path) if self.pending_path is not None else None
        return _stamp(self.committed_path), pending


def config_map_bytes(config_map: Mapping[str, Any] | None, origin: str) -> PlacementBytes:
    """The file bytes a ConfigMap's keys project to: ``binaryData`` base64-decoded, ``data`` encoded
    (what an older operator wrote); a key in neither is absent. None (deleted): both absent."""
    binary = (config_map or {}).get("binaryData") or {}
    data = (config_map or {}).get("data") or {}

    def value(key: str) -> bytes | None:
        if key in binary:
            try:
                return base64.b64decode(binary[key], validate=True)
            except ValueError:  # not base64 (written by hand?): bytes that do not parse, reported so
                return str(binary[key]).encode()
        if key in data:
            return str(data[key]).encode()
        return None

    return PlacementBytes(value(PLACEMENT_KEY), value(PENDING_KEY), origin)


class ConfigMapWatch(DaemonLoop):
    """Lists, then watches, one ConfigMap in a daemon thread; :attr:`latest` is its newest state
    (None until the first listing succeeded; empty bytes while the ConfigMap does not exist)."""

    def __init__(self, namespace: str, name: str, kubeconfig: Path | None = None) -> None:
        self.namespace, self.name, self.kubeconfig = namespace, name, kubeconfig
        self.origin = f"ConfigMap {namespace}/{name}"
        self.latest: PlacementBytes | None = None
        self.synced = threading.Event()  # set by the first successful listing
        self.tried = threading.Event()  # set once the first listing succeeded or failed
        self.changed = threading.Event()  # set on every new state (a reader may wait on it)
        self.failures = 0  # in a row
        self._api: Any = None
        self._response: Any = None  # the open watch (closed by stop())
        super().__init__("eaas-placement-configmap")

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:  # unblock a read that waits for the next event
            with contextlib.suppress(Exception):  # already closed, or no socket left to shut
                response.shutdown()
        super().stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list_and_watch()
                self.failures = 0
            except Exception as error:  # API, network, config errors: retry, never stop serving
                if self._stop.is_set():
                    break
                self.failures += 1
                self.tried.set()
                delay = min(MAX_RETRY_S, MIN_RETRY_S * 2 ** (self.failures - 1))
                if self.failures == 1 or self.failures % 10 == 0:
                    log.warning(
                        "%s not watched (%d failure(s) in a row): %s%s; following the mounted files, "
                        "retrying in %.1f s",
                        self.origin,
                        self.failures,
                        describe(error),
                        _hint(error, self.name),
                        delay,
                    )
                self._stop.wait(delay)

    def _list_and_watch(self) -> None:
        from kubernetes import client

        if self._api is None:
            self._api = client.CoreV1Api(api_client(self.kubeconfig))
        selector = f"metadata.name={self.name}"
        listing = response_json(
            self._api.list_namespaced_config_map(self.namespace, field_selector=selector, **raw_options(10.0))
        )
        items = listing.get("items") or []
        self._set(items[0] if items else None)
        if self.failures:
            log.info("%s: watched again", self.origin)
        self.failures = 0
        self.synced.set()
        self.tried.set()
        version = str((listing.get("metadata") or {}).get("resourceVersion", ""))
        while not self._stop.is_set():  # one watch request after another, from the last version seen
            version = self._watch(selector, version)
            if not version:
                return  # expired ("410 Gone"): list again

    def _watch(self, selector: str, version: str) -> str:
        """One watch request from `version`; the version to resume from ("" to list again)."""
        from kubernetes.watch.watch import iter_resp_lines

        self._response = self._api.list_namespaced_config_map(
            self.namespace,
            field_selector=selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=WATCH_S,
            _preload_content=False,
            _request_timeout=(10.0, WATCH_S + 10.0),
        )
        try:
            for line in _lines(iter_resp_lines(self._response)):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return ""
                    raise PlacementWatchError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if kind in ("ADDED", "MODIFIED"):
                    self._set(obj)
                elif kind == "DELETED":
                    self._set(None)
        finally:
            self._response.release_conn()
            self._response = None
        return version

    def _set(self, config_map: Mapping[str, Any] | None) -> None:
        texts = config_map_bytes(config_map, self.origin)
        if texts.same_contents(self.latest):
            return
        self.latest = texts
        self.changed.set()


class PlacementWatchError(Exception):
    """The API server ended a watch with an error event other than "resourceVersion expired"."""


class PlacementSource:
    """The placement bytes a pod follows: the newer of its mounted files and its ConfigMap watch.

    :meth:`read` (any one thread) returns the newest by :func:`newness` of the candidates, and never
    an older pair than it returned before (the files lag the watch by a kubelet sync; a watch that
    broke keeps its last state, which the files replace only once they are newer). A candidate that
    does not parse is returned when none that parses is as new as the last one returned, so that
    its reader reports the error (and keeps serving what it has)."""

    def __init__(self, files: MountedFiles, watch: ConfigMapWatch | None = None) -> None:
        self.files = files
        self.watch = watch
        self._last: PlacementBytes | None = None
        self._last_newness: Newness | None = None
        self._changed = watch.changed if watch is not None else threading.Event()
        # (newness, parses) by (committed, pending) bytes: a candidate is parsed once per change
        self._scores: dict[tuple[bytes | None, bytes | None], tuple[Newness | None, bool]] = {}

    @property
    def origin(self) -> str:
        if self.watch is None:
            return self.files.origin
        return f"{self.files.origin} and {self.watch.origin}"

    def start(self, wait_s: float = FIRST_SYNC_WAIT_S) -> PlacementSource:
        """Starts the watch and waits up to `wait_s` for its first listing (a starting server or
        client then begins from the ConfigMap as it is, not from files a sync behind); a refused
        or failed one ends the wait at once."""
        if self.watch is not None:
            self.watch.start()
            self.watch.tried.wait(wait_s)
        return self

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def wait(self, timeout_s: float) -> None:
        """Returns after `timeout_s`, or sooner: once the watch saw a change, or on :meth:`wake`
        (a reader that polls the files every `timeout_s` takes the watch's changes at once)."""
        self._changed.wait(timeout_s)
        self._changed.clear()

    def wake(self) -> None:
        """Ends a :meth:`wait` now (a reader that is stopping)."""
        self._changed.set()

    def read(self) -> PlacementBytes:
        candidates = [self.files.read()]
        if self.watch is not None and self.watch.latest is not None:
            candidates.append(self.watch.latest)  # last: it wins ties (equal versions, same placement)
        scores = {}
        best: PlacementBytes | None = None
        best_newness: Newness | None = None
        broken: PlacementBytes | None = None
        for texts in candidates:
            contents = (texts.committed, texts.pending)
            score = scores[contents] = self._scores.get(contents) or _score(texts)
            key, parses = score
            if not parses:
                broken = texts
            elif key is not None and (best_newness is None or key >= best_newness):
                best, best_newness = texts, key
        self._scores = scores  # kept for the candidates' current contents only
        if (
            best is not None
            and best_newness is not None
            and (self._last_newness is None or best_newness >= self._last_newness)
        ):
            if self._last is None or best_newness != self._last_newness or not best.same_contents(self._last):
                self._last, self._last_newness = best, best_newness
            return self._last
        if broken is not None:
            return broken  # nothing as new readable: the reader reports why (and keeps serving)
        if self._last is not None:
            return self._last  # older, or nothing at all now: keep what was served
        return candidates[0]


def _score(texts: PlacementBytes) -> tuple[Newness | None, bool]:
    """(newness, whether it parses)."""
    try:
        return newness(*texts.parse()), True
    except PlacementError:
        return None, False


def _hint(error: Exception, name: str) -> str:
    status = getattr(error, "status", None)
    if status == 403:
        return (
            f" (the pod's ServiceAccount needs get, list and watch on configmaps named {name}: "
            "the operator's Role <moeservice>-runtime-placement grants them)"
        )
    return ""


def _lines(lines: Iterator[str]) -> Iterator[str]:
    return (line for line in lines if line.strip())


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
