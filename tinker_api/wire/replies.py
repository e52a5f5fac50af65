"""The JSON answers of future-returning calls and of polls (``/retrieve_future``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinker_api import schemas as s


@dataclass(frozen=True)
class Reply:
    """An HTTP status and a JSON body, for the views to send as they are."""

    status: int
    body: dict[str, Any]

    def json(self) -> bytes:
        return json.dumps(self.body).encode()


def future_created(
    request_id: str,
    *,
    model_id: str | None = None,
    sample_sequence_ids: Sequence[str] | None = None,
) -> Reply:
    """The immediate answer of every future-returning call."""
    body = s.UntypedAPIFuture(
        request_id=request_id,
        model_id=model_id,
        sample_sequence_ids=None if sample_sequence_ids is None else list(sample_sequence_ids),
    )
    return Reply(200, body.model_dump(exclude_none=True))


def try_again(
    request_id: str,
    queue_state: s.QueueState = "active",
    queue_state_reason: str | None = None,
) -> Reply:
    """A poll of a pending future. 408 makes the SDK re-poll at once without a warning
    (a 200 ``try_again`` works too but logs a warning on every poll)."""
    body = s.TryAgainResponse(
        request_id=request_id, queue_state=queue_state, queue_state_reason=queue_state_reason
    )
    return Reply(408, body.model_dump(exclude_none=True))


def request_failed(error: str, category: s.ErrorCategory = "user") -> Reply:
    """A finished future that failed: 200 with ``{error, category}``; the SDK raises
    ``RequestFailedError`` with the message (category ``user`` marks the caller's fault)."""
    return Reply(200, s.RequestFailedResponse(error=error, category=category).model_dump())


def expired(request_id: str) -> Reply:
    """A future the server no longer holds. 410 makes the SDK resubmit the original request
    where it can (sampling); elsewhere it surfaces as an error."""
    return Reply(
        410,
        {
            "detail": f"request {request_id} is unknown: its result expired, or the server lost "
            "it with its queue (a Redis restarted without its data); it will not run, send it "
            "again"
        },
    )


def sampling_backpressure(retry_after_s: float = 1.0) -> Reply:
    """The answer to an ``/asample`` that carries ``X-Tinker-Sampling-Backpressure: 1`` while
    the sampler queue is full: the SDK pauses all sampling of its session for 1 to 5 s and
    sends the same request again."""
    return Reply(429, {"detail": f"sampler busy, retry in {retry_after_s:g} s"})
