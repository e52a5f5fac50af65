"""Helpers to drive the real ``tinker`` SDK against in-process handlers.

The SDK's own resource classes build and send every request (serialization, headers,
compression) through an httpx ``MockTransport``; the handler answers with what
``tinker_api`` encodes, and the SDK parses that with its own types and converters.
Import this only after ``pytest.importorskip("tinker")``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tinker import types
from tinker._client import AsyncTinker


@dataclass
class SdkWire:
    """Records what the SDK sent; answers with ``status`` and ``body`` (bytes or JSON)."""

    status: int = 200
    body: Any = field(default_factory=lambda: {"request_id": "req-1"})
    content_type: str = "application/json"
    requests: list[httpx.Request] = field(default_factory=list)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if isinstance(self.body, bytes):
            return httpx.Response(
                self.status, content=self.body, headers={"content-type": self.content_type}
            )
        return httpx.Response(self.status, json=self.body)

    def call(self, fn: Callable[[AsyncTinker], Awaitable[Any]], **client_config: Any) -> Any:
        async def run() -> Any:
            client = AsyncTinker(
                api_key="tml-test-key",
                base_url="http://testserver",
                max_retries=0,
                # As the SDK's InternalClientHolder builds its clients: responses are
                # validated against the SDK types, not merely constructed.
                _strict_response_validation=True,
                http_client=httpx.AsyncClient(transport=httpx.MockTransport(self._handle)),
                _client_config=types.ClientConfigResponse(
                    use_pyqwest_transport=False, **client_config
                ),
            )
            try:
                return await fn(client)
            finally:
                await client.close()

        return asyncio.run(run())

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]
