"""The operator's log says what its first lines are: kopf's retries while the API server or the
CRDs come up are waiting, not errors; real errors stay errors."""

from __future__ import annotations

import logging

import pytest

from eaas.operator.main import log_startup_retries_as_waiting

URL = "GET https://127.0.0.1:6443/apis/eaas.io/v1alpha1/moeservices"
STORAGE = "APIServerError('storage is (re)initializing', {'code': 500}, status=500)"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> tuple[logging.Logger, Records]:
    root = logging.getLogger("test-root")  # stands for the root logger kopf's loggers reach
    handler = Records()
    root.handlers[:] = [handler]
    log_startup_retries_as_waiting(root)
    log_startup_retries_as_waiting(root)  # idempotent
    assert len(handler.filters) == 1
    return root, handler


def _log(root: logging.Logger, handler: Records, name: str, level: int, message: str) -> logging.LogRecord:
    """A record as kopf's logger `name` makes it (kopf formats its messages itself)."""
    record = logging.getLogger(name).makeRecord(name, level, __file__, 0, message, (), None)
    for each in root.handlers:
        each.handle(record)
    return handler.records[-1]


def test_a_retry_while_the_storage_initializes_is_waiting(records: tuple[logging.Logger, Records]) -> None:
    root, handler = records
    record = _log(
        root,
        handler,
        "kopf._cogs.clients.watching",
        logging.ERROR,
        f"Request attempt #1/9 failed; will retry: {URL} -> {STORAGE}",
    )
    assert (record.levelno, record.levelname) == (logging.INFO, "INFO")
    assert record.getMessage().startswith("waiting for the API server/CRDs (storage is (re)initializing): ")
    assert URL in record.getMessage()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        # the last attempt gives up: a real error
        ("kopf._cogs.clients.watching", f"Request attempt #9/9 failed; escalating: {URL} -> {STORAGE}"),
        # another failure that is retried
        (
            "kopf.objects",
            f"Request attempt #1/9 failed; will retry: {URL} -> APIServerError('etcdserver: timeout')",
        ),
        # not kopf's
        ("eaas.operator.expertpool", f"Request attempt #1/9 failed; will retry: {URL} -> {STORAGE}"),
    ],
)
def test_other_errors_stay_errors(records: tuple[logging.Logger, Records], name: str, message: str) -> None:
    root, handler = records
    record = _log(root, handler, name, logging.ERROR, message)
    assert (record.levelno, record.getMessage()) == (logging.ERROR, message)
