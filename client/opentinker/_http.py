"""One HTTP session to the server: authentication, retries with backoff, errors as exceptions.

A network failure is retried only where repeating the call is harmless: every GET and the
POSTs the server treats as idempotent (cancel, revoke). A refused connection is retried for
any call, since the request never reached the server.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import httpx

from . import __version__
from .config import redact
from .errors import ConfigError, NetworkError, UnexpectedResponse, error_from_response, not_json

RETRY_STATUSES = frozenset({502, 503, 504})


class Transport:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self._key = api_key
        try:
            self._http = httpx.Client(
                base_url=self.url,
                headers={
                    "Authorization": f"Bearer {api_key}",
                    "Accept": "application/json",
                    "User-Agent": f"opentinker-client/{__version__}",
                },
                timeout=timeout,
                transport=transport,
            )
        except httpx.InvalidURL as exc:
            raise ConfigError(f"invalid server URL {self.url!r}: {exc}") from None
        except UnicodeEncodeError:
            raise ConfigError(f"the API key {redact(api_key)} is not ASCII") from None

    def close(self) -> None:
        self._http.close()

    def _delay(self, attempt: int) -> float:
        # Exponential with jitter, so many clients of a restarted server do not stampede.
        return float(self.backoff * (2**attempt) * (0.5 + random.random()))

    def _send(self, method: str, path: str, *, idempotent: bool, **kwargs: Any) -> httpx.Response:
        attempt = 0
        error: httpx.TransportError
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.LocalProtocolError as exc:
                # Our own request is malformed: sending it again cannot help.
                raise ConfigError(self._redacted(f"{method} {self.url}{path}: {exc}")) from None
            except httpx.ConnectError as exc:
                retry, error = True, exc
            except httpx.TransportError as exc:
                retry, error = idempotent, exc
            else:
                retry_status = idempotent and response.status_code in RETRY_STATUSES
                if retry_status and attempt < self.retries:
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                return response
            if not retry or attempt >= self.retries:
                raise NetworkError(self._redacted(f"{method} {self.url}{path}: {error}")) from error
            time.sleep(self._delay(attempt))
            attempt += 1

    def _redacted(self, message: str) -> str:
        # httpx quotes a bad header as bytes (b'Bearer otk_...\\r'): every spelling goes.
        spellings = {self._key, self._key.strip(), repr(self._key)[1:-1]}
        spellings.add(repr(self._key.encode("utf-8", "replace"))[2:-1])
        for spelling in sorted(filter(None, spellings), key=len, reverse=True):
            message = message.replace(spelling, redact(self._key))
        return message

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            body: Any = response.json()
        except ValueError:
            body = None
        raise error_from_response(
            response.status_code,
            body,
            response.text,
            content_type=response.headers.get("content-type", ""),
            location=response.headers.get("location", ""),
        )

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("content-type", "")
            what = not_json(response.status_code, kind, response.text)
            request = response.request
            raise UnexpectedResponse(
                f"unexpected response from the server ({request.method} {request.url.path}: "
                f"HTTP {response.status_code}, {what})"
            ) from None

    def request(
        self, method: str, path: str, *, idempotent: bool | None = None, **kwargs: Any
    ) -> Any:
        """Send, raise on an error status, return the decoded JSON (None for 204)."""
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "OPTIONS", "PUT", "DELETE")
        response = self._check(self._send(method, path, idempotent=idempotent, **kwargs))
        if response.status_code == 204 or not response.content:
            return None
        return self._json(response)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def paginate(self, path: str, params: dict[str, Any] | None = None) -> Iterator[Any]:
        """Every item of a cursor-paginated list (``{"next", "results"}``) or a plain list."""
        url: str | None = path
        while url:
            body = self.get(url, params=params)
            params = None  # the next URL carries the query
            if isinstance(body, list):
                yield from body
                return
            if not isinstance(body, dict) or not isinstance(body.get("results", []), list):
                raise UnexpectedResponse(
                    f"unexpected response from the server (GET {path}: not a list or a page)"
                )
            yield from body.get("results", [])
            url = body.get("next")

    def page(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.get(path, params=params)
        if isinstance(body, list):
            return {"results": body, "next": None}
        if not isinstance(body, dict) or not isinstance(body.get("results", []), list):
            raise UnexpectedResponse(
                f"unexpected response from the server (GET {path}: not a list or a page)"
            )
        return body

    @contextmanager
    def stream(self, path: str, headers: dict[str, str] | None = None) -> Iterator[httpx.Response]:
        """A streamed GET (downloads); retried like a GET until the body starts arriving."""
        attempt = 0
        while True:
            try:
                with self._http.stream("GET", path, headers=headers) as response:
                    if not response.is_success:
                        response.read()
                        self._check(response)
                    yield response
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt >= self.retries:
                    raise NetworkError(f"GET {self.url}{path}: {exc}") from exc
                time.sleep(self._delay(attempt))
                attempt += 1


def fetch_resuming(http: Transport, path: str, out: IO[bytes]) -> None:
    """Stream ``path`` into ``out``. A body cut off mid-way (a dropped connection, a proxy's
    timeout) continues from the bytes already written, asking for the rest (``Range``) of
    the same file (``If-Range`` with its validator), up to ``http.retries`` times; a server
    that answers with the whole file instead (it changed meanwhile, or takes no ranges)
    starts it over."""
    written, validator, attempt = 0, "", 0
    while True:
        headers = {"Range": f"bytes={written}-", "If-Range": validator} if written else None
        try:
            with http.stream(path, headers=headers) as response:
                if response.status_code != 206:
                    out.seek(0)
                    out.truncate()
                    written = 0
                takes_ranges = response.headers.get("accept-ranges") == "bytes"
                validator = response.headers.get("etag", "") if takes_ranges else ""
                for chunk in response.iter_bytes(1 << 16):
                    out.write(chunk)
                    written += len(chunk)
            return
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout) as exc:
            if not validator or attempt >= http.retries:
                raise NetworkError(
                    http._redacted(f"GET {http.url}{path}: broke off after {written} bytes: {exc}")
                ) from exc
            time.sleep(http._delay(attempt))
            attempt += 1
