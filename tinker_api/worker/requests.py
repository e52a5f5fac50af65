"""One request as the model worker reads it from the stream, and how it fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tinker_api import futures
from tinker_api.wire import WireError

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
    def team(self) -> int | None:
        """The team the request's GPU time is charged to (None: a request of the service's
        own, such as closing a session's models)."""
        team = self.fields.get("team")
        return int(team) if team is not None else None

    @property
    def seq(self) -> int:
        return int(self.fields.get("seq", 0))


def rows_of(op: Op) -> int:
    """The generation rows a sample or chat request takes: ``n`` per prompt."""
    f = op.fields
    prompts = f.get("prompts") if f.get("mode") not in (None, "chat") else None
    return max(1, int(f.get("n") or 1)) * max(1, len(prompts or [None]))


def fitting(ops: list[Op], room: int, *, at_least_one: bool) -> int:
    """How many of ``ops``, taken in order, fit in ``room`` rows; with ``at_least_one`` the
    first always counts, so that a request larger than a whole batch still runs, alone. In
    order rather than any that fit, so that a large request is not passed over for ever."""
    for taken, op in enumerate(ops):
        room -= rows_of(op)
        if room < 0 and (taken or not at_least_one):
            return taken
    return len(ops)


def fail_request(op: Op, exc: Exception, what: str) -> None:
    """End `op`'s future with `exc`: a `RequestError` as the caller's error (its category),
    anything else as a server error, logged with its traceback (call from the handler)."""
    if isinstance(exc, RequestError):
        futures.fail(op.rid, str(exc), exc.category)
        return
    if isinstance(exc, WireError):
        # The request's own fault, found by the checks the web process also runs.
        futures.fail(op.rid, str(exc), "user")
        return
    log.exception("request %s (%s) failed", op.rid, what)
    futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")
