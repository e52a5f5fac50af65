"""Retries against a real HTTP server that fails on purpose: idempotent calls are retried
with backoff, a submit is not, and error bodies become typed exceptions."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from opentinker import Client
from opentinker.errors import (
    AuthError,
    NetworkError,
    NotFound,
    QuotaError,
    ServerError,
    ValidationError,
)


class Flaky:
    """Answers 503 to the first ``failures`` requests of each path, then the scripted reply."""

    def __init__(self) -> None:
        self.failures = 0
        self.hits: dict[str, int] = {}
        self.replies: dict[str, tuple[int, Any]] = {}


@pytest.fixture
def flaky() -> Iterator[tuple[str, Flaky]]:
    state = Flaky()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            key = f"{self.command} {self.path.split('?')[0]}"
            state.hits[key] = state.hits.get(key, 0) + 1
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if state.hits[key] <= state.failures:
                status, body = 503, {"detail": "try later"}
            else:
                status, body = state.replies.get(key, (404, {"detail": "Not found."}))
            # A string is sent as it is, like Django's HTML error pages.
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header(
                "Content-Type", "text/html" if isinstance(body, str) else "application/json"
            )
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


ME = {"username": "olivia", "teams": [], "key": None}


def test_it_retries_idempotent_calls_until_the_server_answers(flaky: tuple[str, Flaky]) -> None:
    url, state = flaky
    state.failures = 2
    state.replies["GET /api/v1/me"] = (200, ME)
    state.replies["POST /api/v1/jobs/j1/cancel"] = (409, {"detail": "job is already SUCCEEDED"})
    with Client(url, "otk_k", retries=3) as client:
        client._http.backoff = 0.01
        assert client.me().username == "olivia"
        assert state.hits["GET /api/v1/me"] == 3
        with pytest.raises(Exception) as info:
            client._http.post("/api/v1/jobs/j1/cancel", idempotent=True)
        assert state.hits["POST /api/v1/jobs/j1/cancel"] == 3
        assert "already SUCCEEDED" in str(info.value)


def test_it_does_not_repeat_a_submit(flaky: tuple[str, Flaky]) -> None:
    url, state = flaky
    state.failures = 1
    with Client(url, "otk_k", retries=3) as client:
        client._http.backoff = 0.01
        with pytest.raises(ServerError) as info:
            client.jobs.submit({"method": "smoke"})
    assert info.value.status == 503
    assert state.hits["POST /api/v1/jobs"] == 1


def test_it_gives_up_on_an_unreachable_server_after_backing_off() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", "otk_k", retries=2) as client:
        client._http.backoff = 0.01
        with pytest.raises(NetworkError, match="/api/v1/me"):
            client.me()


@pytest.mark.parametrize(
    ("status", "body", "cls", "field", "reason"),
    [
        (
            400,
            {
                "detail": "invalid job spec",
                "errors": [{"field": "rollout.group_size", "reason": "too big"}],
            },
            ValidationError,
            "rollout.group_size",
            "too big",
        ),
        (
            400,
            {"name": ["This field is required."]},
            ValidationError,
            "name",
            "This field is required.",
        ),
        (401, {"detail": "Invalid API key."}, AuthError, None, "Invalid API key."),
        (
            404,
            {"detail": "No Job matches the given query."},
            NotFound,
            None,
            "No Job matches the given query.",
        ),
        (
            429,
            {"detail": "queue full", "quota": "max_queued_jobs", "limit": 2, "current": 2},
            QuotaError,
            None,
            "queue full",
        ),
        (
            403,
            {"detail": "month used", "quota": "gpu_hours_per_month", "limit": 1, "current": 1.5},
            QuotaError,
            None,
            "month used",
        ),
        (500, "<h1>Server Error (500)</h1>", ServerError, None, "Server Error (500)"),
    ],
)
def test_it_turns_error_bodies_into_typed_exceptions(
    flaky: tuple[str, Flaky], status: int, body: Any, cls: type, field: str | None, reason: str
) -> None:
    url, state = flaky
    state.replies["GET /api/v1/me"] = (status, body)
    with Client(url, "otk_k", retries=0) as client, pytest.raises(cls) as info:
        client.me()
    error = info.value
    assert type(error) is cls and error.status == status
    assert error.field == field and reason in error.reason
    if cls is QuotaError:
        assert error.quota == body["quota"] and error.limit == body["limit"]
        assert error.retryable is (status == 429)
