"""A streamed Response that fails midway ends with ``response.failed``, as OpenAI's does."""

from __future__ import annotations

from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import pytest

from eaas.runtime.httpd import ClientGone
from eaas.runtime.serving.http_api import ApiError
from eaas.runtime.serving.response_output import response_events


def _chunk(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def _failing(error: BaseException) -> Iterator[dict[str, Any]]:
    yield _chunk("Hello")
    yield _chunk(", wor")
    raise error


def test_an_error_after_the_first_delta_ends_the_stream_with_response_failed() -> None:
    error = ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "expert (3, 17) has no live server")
    events = list(response_events({"input": "hi"}, _failing(error), "tiny"))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 2
    assert kinds[-1] == "response.failed"
    assert "response.completed" not in kinds and "response.output_text.done" not in kinds
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "expert (3, 17) has no live server"}
    [message] = failed["output"]
    assert message["content"][0]["text"] == "Hello, wor"
    assert message["status"] == "in_progress"


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (ApiError(HTTPStatus.TOO_MANY_REQUESTS, "queue full"), "rate_limit_exceeded", "queue full"),
        (ApiError(HTTPStatus.BAD_REQUEST, "no token allowed"), "invalid_prompt", "no token allowed"),
        (RuntimeError("engine worker died"), "server_error", "engine worker died"),
    ],
)
def test_the_failure_names_its_code_and_message(error: Exception, code: str, message: str) -> None:
    events = list(response_events({"input": "hi"}, _failing(error), "tiny"))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": code, "message": message}


def test_a_client_that_went_away_gets_no_failure_event_and_the_answer_is_closed() -> None:
    closed = []

    class Chunks:
        def __init__(self) -> None:
            self.inner = _failing(ClientGone())

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return self

        def __next__(self) -> dict[str, Any]:
            return next(self.inner)

        def close(self) -> None:
            closed.append(True)

    events = response_events({"input": "hi"}, Chunks(), "tiny")
    with pytest.raises(ClientGone):
        for event in events:
            assert event["type"] != "response.failed"
    assert closed == [True]
