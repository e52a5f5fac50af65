"""Retries against a real HTTP server that fails on purpose: idempotent calls are retried
with backoff, a submit is not, and error bodies become typed exceptions."""

from __future__ import annotations

import json
import socket
import threading
import time
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
    UnexpectedResponse,
    ValidationError,
)
from tests.client.fakes import FakeApi, Reply, dataset, job


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


def test_a_body_that_does_not_decode_is_an_unexpected_response(fake_api: FakeApi) -> None:
    # A proxy that labels a plain body gzip: one line, not httpx's traceback.
    fake_api.reply("GET /api/v1/me", 200, b"not gzip at all", content_encoding="gzip")
    with (
        Client(fake_api.url, "otk_k", retries=0) as client,
        pytest.raises(UnexpectedResponse) as info,
    ):
        client.me()
    assert str(info.value) == (
        "unexpected response from the server (GET /api/v1/me: the body is not in the encoding "
        "its Content-Encoding names: Error -3 while decompressing data: incorrect header check)"
    )


def test_a_submit_that_timed_out_says_it_may_have_been_made(fake_api: FakeApi) -> None:
    def slow() -> Reply:
        time.sleep(1)
        return Reply(201, job("QUEUED"))

    fake_api.replies["POST /api/v1/jobs"] = slow
    fake_api.replies["GET /api/v1/me"] = slow
    with Client(fake_api.url, "otk_k", timeout=0.2, retries=0) as client:
        with pytest.raises(NetworkError) as submit:
            client.jobs.submit({"method": "smoke"})
        with pytest.raises(NetworkError) as read:
            client.me()
    assert str(submit.value).endswith(
        "timed out (the server may have acted on it: check before sending it again)"
    )
    assert str(read.value).endswith("/api/v1/me: timed out")
    assert fake_api.count("POST /api/v1/jobs") == 1


def test_pages_are_read_from_the_configured_server_only_once(fake_api: FakeApi) -> None:
    first, second = dataset("a"), dataset("b")
    # Behind a proxy the server may name itself by another host: only the cursor is taken.
    fake_api.reply(
        "GET /api/v1/datasets",
        200,
        {"results": [first], "next": "http://10.0.0.7:8000/api/v1/datasets?cursor=c2&env=math"},
    )
    fake_api.reply("GET /api/v1/datasets?cursor=c2&env=math", 200, {"results": [second]})
    with Client(fake_api.url, "otk_k", retries=0) as client:
        assert [d.name for d in client.datasets.list(env="math")] == ["a", "b"]
        assert fake_api.hits == [
            "GET /api/v1/datasets?env=math",
            "GET /api/v1/datasets?cursor=c2&env=math",
        ]
        # A next link back to a page already read would list for ever.
        fake_api.reply(
            "GET /api/v1/datasets?cursor=c2&env=math",
            200,
            {"results": [second], "next": "/api/v1/datasets?cursor=c2&env=math"},
        )
        with pytest.raises(UnexpectedResponse, match="the next page is one already read"):
            client.datasets.list(env="math")
