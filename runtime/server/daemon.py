"""A background loop in a daemon thread: subclasses implement ``_run`` (checking ``self._stop``);
and how a server process ends (:func:`end_process`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn, Self


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


def end_process(code: int = 0) -> NoReturn:
    """Ends a server process whose work is done and whose resources are released, without the
    interpreter's teardown. With torch imported, tearing the modules down costs most of a
    CPU-second (``benchmarks/process_exit.py``), which the servers of a retiring pool would take
    from the pods still serving beside them. Logging and the standard streams are flushed first;
    atexit handlers do not run (nothing of ours registers one: every transport unlinks and closes
    its own memory in ``close``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
