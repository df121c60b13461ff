"""A background loop in a daemon thread: subclasses implement ``_run`` (checking ``self._stop``)."""

from __future__ import annotations

import threading
from typing import Self


class DaemonLoop:
    """``start()`` runs ``_run`` in a daemon thread named ``name``; ``stop()`` sets ``_stop`` and
    joins the thread (unless called from it). As a context manager it starts on entry and stops on
    exit."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
