"""While the service's Redis is down, the API answers 503 in its JSON shape (DRF's under
/api/, OpenAI's under /v1/) saying so, and answers normally again once Redis is back, with
no restart of the web process.

The Valkey is the test's own, stopped and started again on its port; never the shared one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.valkeys import StoppableValkey

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(120)]


@pytest.fixture
def valkey(tmp_path: Path, settings: Any) -> Iterator[StoppableValkey]:
    server = StoppableValkey(tmp_path / "valkey")
    server.start()
    settings.REDIS_URL = server.url
    yield server
    server.stop()


def _requests(client: Any, plaintext: str) -> dict[str, Any]:
    tinker = {"HTTP_X_API_KEY": "tml-" + plaintext}
    openai = {"HTTP_AUTHORIZATION": "Bearer " + plaintext}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "tinker": lambda: client.post(
            "/api/v1/retrieve_future",
            {"request_id": "req-0123456789abcdef0123456789abcdef"},
            content_type="application/json",
            **tinker,
        ),
        "openai": lambda: client.post(
            "/v1/chat/completions", chat, content_type="application/json", **openai
        ),
    }


def test_it_answers_503_json_while_redis_is_down_and_recovers_without_a_restart(
    valkey: StoppableValkey, owner_key: tuple[Any, str]
) -> None:
    from django.test import Client

    client = Client(raise_request_exception=False)
    calls = _requests(client, owner_key[1])
    # A first answer while Redis is up: the process holds a connection to it, as a server
    # that has been running does.
    assert calls["tinker"]().status_code != 503

    valkey.stop()
    tinker = calls["tinker"]()
    assert tinker.status_code == 503, tinker.content
    assert tinker["Content-Type"].startswith("application/json")
    assert "Redis is unreachable" in tinker.json()["detail"]
    assert int(tinker["Retry-After"]) >= 1
    openai = calls["openai"]()
    assert openai.status_code == 503, openai.content
    error = openai.json()["error"]
    assert error["type"] == "server_error"
    assert "Redis is unreachable" in error["message"]

    valkey.start()
    # The same process answers again: the Tinker poll finds no such future.
    back = calls["tinker"]()
    assert back.status_code == 410, back.content
    assert back["Content-Type"].startswith("application/json")
