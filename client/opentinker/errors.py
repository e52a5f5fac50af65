"""Exceptions of the client. Every server refusal carries the status, the detail and, where the
server names them, the offending fields (``errors``: ``[{"field": "a.b", "reason": ...}]``).

Each class has the CLI exit code that reports it, so scripts can tell failures apart.
"""

from __future__ import annotations

import re
from typing import Any

# Exit codes of the CLI (documented in client/README.md and `opentinker --help`).
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_SERVER = 5
EXIT_TIMEOUT = 6
EXIT_INTERRUPTED = 130


class OpenTinkerError(Exception):
    """Base class of every error this package raises."""

    exit_code = EXIT_SERVER


class ConfigError(OpenTinkerError):
    """No server URL or API key configured, or an unreadable config file."""

    exit_code = EXIT_USAGE


class UsageError(OpenTinkerError):
    """A local mistake: a missing file, options that do not go together."""

    exit_code = EXIT_USAGE


class SpecError(OpenTinkerError):
    """A spec or override refused before it is sent (unknown key, wrong type, bad YAML)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, errors: list[dict[str, str]] | None = None) -> None:
        self.errors = errors or []
        super().__init__(message)


class NetworkError(OpenTinkerError):
    """The server could not be reached (after retries, where the call may be retried)."""

    exit_code = EXIT_SERVER


class UnexpectedResponse(OpenTinkerError):
    """A success status with a body that is not what the API sends: HTML from a proxy in front
    of the server, or JSON of another shape (a ``--url`` that is not the service's root)."""

    exit_code = EXIT_SERVER


class WaitTimeout(OpenTinkerError, TimeoutError):
    """``Job.wait`` gave up after its timeout; the job itself goes on (``job`` is the record).

    Also a ``TimeoutError``, which ``wait`` raised before this class existed.
    """

    exit_code = EXIT_TIMEOUT

    def __init__(self, job: Any, timeout: float) -> None:
        self.job = job
        self.timeout = timeout
        super().__init__(f"job {job.id} still {job.state} after {timeout:g} s; it keeps running")


class ApiError(OpenTinkerError):
    """The server answered with an error status."""

    exit_code = EXIT_SERVER

    def __init__(
        self,
        status: int,
        detail: str,
        errors: list[dict[str, str]] | None = None,
        body: Any = None,
    ) -> None:
        self.status = status
        self.detail = detail
        self.errors = errors or []
        self.body = body
        super().__init__(self._message())

    def _message(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The detail, then each field's reason that the detail does not already say."""
        out = [f"{self.detail} (HTTP {self.status})"]
        seen: set[str] = set()
        for e in self.errors:
            field, reason = e.get("field") or "", e.get("reason", "")
            line = f"{field}: {reason}" if field else reason
            if line in seen or self._said([*field.split(": "), reason]):
                continue
            seen.add(line)
            out.append(f"  {line}")
        return out

    def _said(self, parts: list[str]) -> bool:
        # Dataset rows come as "row 3: prompt"; the detail names the first as "row 3, prompt".
        return all(re.search(rf"(?<!\w){re.escape(p)}(?!\w)", self.detail) for p in parts if p)

    @property
    def field(self) -> str | None:
        """The first offending field, if the server named one."""
        return self.errors[0].get("field") if self.errors else None

    @property
    def reason(self) -> str:
        return self.errors[0].get("reason", self.detail) if self.errors else self.detail


class ValidationError(ApiError):
    """400: the request (e.g. the job spec) is invalid; ``errors`` names each field."""

    exit_code = EXIT_USAGE


class AuthError(ApiError):
    """401/403: no key, a revoked or expired key, or not allowed to do this."""

    exit_code = EXIT_AUTH


class NotFound(ApiError):
    """404: no such object, or it belongs to another team (the server does not say which)."""

    exit_code = EXIT_NOT_FOUND


class Conflict(ApiError):
    """409: e.g. cancelling a finished job, a dataset name taken, a key already rotated."""

    exit_code = EXIT_USAGE


class TooLarge(ApiError):
    """413: an upload over the server's size limit."""

    exit_code = EXIT_USAGE


class QuotaError(ApiError):
    """A team quota refused the request: ``quota`` names it, with its ``limit`` and ``current``.

    ``retryable`` is True for 429 (e.g. too many queued jobs: retry later).
    """

    exit_code = EXIT_USAGE

    @property
    def quota(self) -> str | None:
        return self.body.get("quota") if isinstance(self.body, dict) else None

    @property
    def limit(self) -> Any:
        return self.body.get("limit") if isinstance(self.body, dict) else None

    @property
    def current(self) -> Any:
        return self.body.get("current") if isinstance(self.body, dict) else None

    @property
    def retryable(self) -> bool:
        return self.status == 429


class ServerError(ApiError):
    """5xx: the server failed."""

    exit_code = EXIT_SERVER


class JobFailed(OpenTinkerError):
    """A job followed to its end finished FAILED or CANCELLED (``job`` holds the record)."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, job: Any) -> None:
        self.job = job
        reason = f": {job.error_code} {job.error_message}".rstrip() if job.error_code else ""
        super().__init__(f"job {job.id} ended {job.state}{reason}")


def _flatten(body: Any, prefix: str = "") -> list[dict[str, str]]:
    """DRF's ``{"field": ["msg"], "nested": {"f": ["msg"]}}`` as ``[{field, reason}]``."""
    out: list[dict[str, str]] = []
    if isinstance(body, dict):
        for key, value in body.items():
            out += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(body, list):
        for item in body:
            if isinstance(item, (dict, list)):
                out += _flatten(item, prefix)
            else:
                out.append({"field": prefix, "reason": str(item)})
    elif body is not None:
        out.append({"field": prefix, "reason": str(body)})
    return out


def summarise(text: str, limit: int = 100) -> str:
    """A body that is not JSON (an HTML error page, usually) as one short line."""
    plain = " ".join(re.sub(r"<[^>]*>", " ", text).split())
    return plain if len(plain) <= limit else plain[: limit - 1] + "\u2026"


def not_json(status: int, content_type: str, text: str) -> str:
    """What to say about a body that should have been JSON and is not."""
    kind = content_type.split(";")[0].strip() or "no content type"
    # A 404 page, or a 200 page in place of JSON, is what a URL off the API's root gets.
    hint = ": is --url the service's root?" if status == 404 or 200 <= status < 300 else ""
    snippet = summarise(text)
    return f"not JSON ({kind}){hint}" + (f" {snippet!r}" if snippet else "")


def error_from_response(
    status: int, body: Any, text: str = "", *, content_type: str = "", location: str = ""
) -> ApiError:
    """Map an error response to the exception class a caller can catch."""
    detail = ""
    errors: list[dict[str, str]] = []
    if isinstance(body, dict):
        detail = str(body.get("detail") or "")
        raw = body.get("errors")
        if isinstance(raw, list):
            errors = [
                {"field": str(e.get("field", "")), "reason": str(e.get("reason", e))}
                if isinstance(e, dict)
                else {"field": "", "reason": str(e)}
                for e in raw
            ]
            # Dataset row errors also carry the row number: keep it in the field name.
            for e, r in zip(errors, raw):
                if isinstance(r, dict) and r.get("row"):
                    e["field"] = f"row {r['row']}: {e['field']}"
        elif not detail:
            # A plain serializer error: {"field": ["reason"], ...}.
            errors = _flatten({k: v for k, v in body.items() if k not in ("detail",)})
            detail = "invalid request"
    elif isinstance(body, list):
        if all(not isinstance(item, (dict, list)) for item in body):
            # DRF's ValidationError("message") arrives as ["message"]: the messages are the detail.
            detail = "; ".join(str(item) for item in body)
        else:
            errors = _flatten(body)
    if 300 <= status < 400:
        # httpx does not follow redirects: say where the server points, most likely the fix.
        detail = f"redirected to {location}" if location else "redirected"
    elif body is None:
        detail = not_json(status, content_type, text) if text.strip() else "empty response"
    if not detail:
        detail = "invalid request" if errors else f"HTTP {status}"
    cls: type[ApiError]
    if isinstance(body, dict) and "quota" in body and status in (403, 429):
        cls = QuotaError
    elif status == 400:
        cls = ValidationError
    elif status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = NotFound
    elif status == 409:
        cls = Conflict
    elif status == 413:
        cls = TooLarge
    elif status == 429:
        cls = QuotaError
    else:
        cls = ServerError
    return cls(status, detail, errors, body)
