"""One request as the model worker reads it from the stream, and how it fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tinker_api import futures

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request that cannot run: its future fails with ``category`` (``user`` by default)."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


@dataclass
class Op:
    """One request read from the stream."""

    fields: dict[str, Any]
    body: bytes | None = None

    @property
    def kind(self) -> str:
        return str(self.fields["op"])

    @property
    def rid(self) -> str:
        return str(self.fields["rid"])

    @property
    def model(self) -> str:
        return str(self.fields.get("model", ""))

    @property
    def seq(self) -> int:
        return int(self.fields.get("seq", 0))


def fail_request(op: Op, exc: Exception, what: str) -> None:
    """End `op`'s future with `exc`: a `RequestError` as the caller's error (its category),
    anything else as a server error, logged with its traceback (call from the handler)."""
    if isinstance(exc, RequestError):
        futures.fail(op.rid, str(exc), exc.category)
        return
    log.exception("request %s (%s) failed", op.rid, what)
    futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")
