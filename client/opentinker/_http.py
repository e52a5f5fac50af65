"""One HTTP session to the server: authentication, retries with backoff, errors as exceptions.

A network failure is retried only where repeating the call is harmless: every GET and the
POSTs the server treats as idempotent (cancel, revoke). A refused connection is retried for
any call, since the request never reached the server.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import httpx

from . import __version__
from .config import redact
from .errors import (
    ConfigError,
    NetworkError,
    UnexpectedResponse,
    error_from_response,
    not_json,
    summarise,
)

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
            except httpx.DecodingError as exc:
                raise UnexpectedResponse(undecodable(method, path, exc)) from None
            else:
                retry_status = idempotent and response.status_code in RETRY_STATUSES
                if retry_status and attempt < self.retries:
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                return response
            if not retry or attempt >= self.retries:
                message = f"{method} {self.url}{path}: {error}"
                never_sent = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
                if not (idempotent or never_sent):
                    # Sent, maybe acted on, answer lost: a submit repeated blindly runs twice.
                    message += " (the server may have acted on it: check before sending it again)"
                raise NetworkError(self._redacted(message)) from error
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
        query: Any = params
        seen: set[str] = set()
        while True:
            body = self.get(path, params=query)
            if isinstance(body, list):
                yield from body
                return
            page = self._page(body, path)
            yield from page["results"]
            if not page.get("next"):
                return
            query = next_query(page["next"], path, seen)

    def page(self, path: str, params: Any = None) -> dict[str, Any]:
        body = self.get(path, params=params)
        if isinstance(body, list):
            return {"results": body, "next": None}
        return self._page(body, path)

    @staticmethod
    def _page(body: Any, path: str) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("results", []), list):
            raise UnexpectedResponse(
                f"unexpected response from the server (GET {path}: not a list or a page)"
            )
        return {"results": [], **body}

    @contextmanager
    def stream(self, path: str, headers: dict[str, str] | None = None) -> Iterator[httpx.Response]:
        """A streamed GET (downloads); retried like a GET until the body starts arriving."""
        attempt = 0
        while True:
            try:
                with self._http.stream("GET", path, headers=headers) as response:
                    if response.status_code not in RETRY_STATUSES or attempt >= self.retries:
                        if not response.is_success:
                            response.read()
                            self._check(response)
                        yield response
                        return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt >= self.retries:
                    raise NetworkError(self._redacted(f"GET {self.url}{path}: {exc}")) from exc
            time.sleep(self._delay(attempt))
            attempt += 1


def next_query(link: Any, path: str, seen: set[str]) -> httpx.QueryParams:
    """The query (the cursor) of a page's ``next`` link, the only part of it used: its scheme
    and host are what the server thinks it is called, which behind a proxy can be another
    origin, and the key is never sent anywhere but ``--url``. A link seen before would read
    the same pages for ever."""
    try:
        query = httpx.URL(link).params if isinstance(link, str) else None
    except httpx.InvalidURL:
        query = None
    if query is None:
        raise UnexpectedResponse(
            f"unexpected response from the server (GET {path}: a next link {link!r})"
        )
    if str(query) in seen:
        raise UnexpectedResponse(
            f"unexpected response from the server (GET {path}: the next page is one already "
            f"read, {link!r})"
        )
    seen.add(str(query))
    return query


def undecodable(method: str, path: str, exc: Exception) -> str:
    return (
        f"unexpected response from the server ({method} {path}: the body is not in the "
        f"encoding its Content-Encoding names: {exc})"
    )


def _check_download(response: httpx.Response, path: str, written: int) -> int | None:
    """The file's size if the response says it; refuse what is not (a piece of) the file."""
    where = f"unexpected response from the server (GET {path}: HTTP {response.status_code}"
    if response.headers.get("content-type", "").split(";")[0].strip() == "text/html":
        # The server never sends a file as HTML: a proxy's login or error page.
        response.read()
        raise UnexpectedResponse(
            f"{where}, an HTML page instead of the file: is --url the service's root? "
            f"{summarise(response.text)!r})"
        )
    if response.status_code != 206:
        return None
    found = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("content-range", ""))
    if found is None or int(found[1]) != written:
        # Appended at the wrong offset, the bytes would make a corrupt file.
        raise UnexpectedResponse(
            f"{where}, asked for the bytes from {written}, got "
            f"{response.headers.get('content-range', 'no Content-Range')!r})"
        )
    return None if found[2] == "*" else int(found[2])


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
                size = _check_download(response, path, written)
                if response.status_code != 206:
                    out.seek(0)
                    out.truncate()
                    written = 0
                takes_ranges = response.headers.get("accept-ranges") == "bytes"
                validator = response.headers.get("etag", "") if takes_ranges else ""
                for chunk in response.iter_bytes(1 << 16):
                    out.write(chunk)
                    written += len(chunk)
            if size is not None and written != size:
                raise UnexpectedResponse(
                    f"unexpected response from the server (GET {path}: the range sent ends "
                    f"at byte {written} of {size})"
                )
            return
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout) as exc:
            # Nothing written yet (a server slow to answer, making a model's zip): asking again
            # loses nothing. Past that, only the rest of the same file may be appended.
            if (written and not validator) or attempt >= http.retries:
                broke = f"broke off after {written} bytes: " if written else ""
                raise NetworkError(http._redacted(f"GET {http.url}{path}: {broke}{exc}")) from exc
            time.sleep(http._delay(attempt))
            attempt += 1
        except httpx.DecodingError as exc:
            raise UnexpectedResponse(undecodable("GET", path, exc)) from None
        except httpx.TransportError as exc:
            raise NetworkError(http._redacted(f"GET {http.url}{path}: {exc}")) from exc
