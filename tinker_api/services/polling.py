"""``/retrieve_future``: the outcome of a future, long-polled."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from tinker_api import futures, wire
from tinker_api import schemas as s
from tinker_api.services.lookups import Caller
from tinker_api.services.queue import ensure_worker
from workers import conf


def long_poll_seconds() -> float:
    # The SDK waits 45 s for a poll; answering well before keeps its retries quiet.
    return float(conf.int_setting("OPENTINKER_TINKER_LONG_POLL_SECONDS", minimum=0))


@dataclass(frozen=True)
class PollAnswer:
    status: int
    body: bytes
    content_type: str


def retrieve(caller: Caller, request_id: str, *, protobuf: bool) -> PollAnswer:
    """The outcome of a future, waiting up to the long-poll time for it to end."""
    fut = futures.get(request_id)
    if fut is None or fut.get("team") != str(caller.team_id):
        reply = wire.expired(request_id)
        return PollAnswer(reply.status, reply.json(), wire.JSON)
    deadline = timezone.now() + timedelta(seconds=long_poll_seconds())
    queue_state: s.QueueState = "active"
    first = True
    while True:
        status = fut.get("status")
        if status == futures.FAILED:
            reply = wire.request_failed(fut.get("error", "failed"), fut.get("category", "unknown"))  # type: ignore[arg-type]
            return PollAnswer(reply.status, reply.json(), wire.JSON)
        if status == futures.DONE:
            if protobuf and "proto" in fut:
                return PollAnswer(200, fut["proto"], wire.PROTOBUF)
            return PollAnswer(200, fut.get("json", b"{}"), wire.JSON)
        if status == futures.CLAIMED:
            owner = fut.get("worker", "")
            if not futures.worker_alive(owner):
                futures.fail(
                    request_id,
                    "the model worker executing this request stopped; the model's state since "
                    "its last save_state is lost",
                    "server",
                )
                fut = futures.get(request_id) or fut
                continue
        elif status == futures.QUEUED and first and fut.get("base"):
            queue_state = ensure_worker(fut["base"])
        first = False
        remaining = (deadline - timezone.now()).total_seconds()
        if remaining <= 0:
            reply = wire.try_again(request_id, queue_state)
            return PollAnswer(reply.status, reply.json(), wire.JSON)
        futures.wait(request_id, min(remaining, 1.0))
        fut = futures.get(request_id)
        if fut is None:
            reply = wire.expired(request_id)
            return PollAnswer(reply.status, reply.json(), wire.JSON)
