"""Queueing requests for the model worker of a base model, starting one when none runs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import current_app
from django.utils import timezone

from jobs.quotas import BudgetSpent, check_month_budget
from tinker_api import futures, wire
from tinker_api import schemas as s
from tinker_api.models import TrainingModel
from tinker_api.services.lookups import Caller, NotFound, Refused, base_model
from workers import conf
from workers.celeryconf import node_queue
from workers.locktable import GpuLockTable

# Sent by name: the web process never imports the model worker (nor, through it, torch).
SERVE_BASE_MODEL = "tinker_api.serve_base_model"

# How long a worker may take from being sent to registering before another start is tried.
WORKER_START_SECONDS = 120
# A model's ``last_request`` (shown as its run's last request time) is written at most this often.
LAST_REQUEST_RESOLUTION = timedelta(seconds=10)


def ensure_worker(base: str) -> s.QueueState:
    """Start a model worker for ``base`` unless one runs or is starting; the queue state to
    report to pollers (``paused_capacity`` while no GPU block is free)."""
    if futures.worker_active(base):
        return "active"
    if not futures.mark_starting(base, WORKER_START_SECONDS):
        return "active"
    row = base_model(base)
    table = GpuLockTable(conf.get_redis())
    lease = table.allocate(f"tinker:{base}:{uuid.uuid4().hex[:8]}", 1, conf.lease_seconds())
    if lease is None:
        futures.clear_starting(base)
        return "paused_capacity"
    try:
        current_app.send_task(
            SERVE_BASE_MODEL,
            args=[base],
            kwargs={
                "base_path": str(row.resolved_path()),
                "node": lease.node,
                "gpus": list(lease.gpus),
                "lease_job_id": lease.job_id,
                "lease_token": lease.token,
            },
            queue=node_queue(lease.node),
        )
    except Exception:
        table.release(lease)
        futures.clear_starting(base)
        raise
    return "active"


def refuse(
    caller: Caller,
    model: TrainingModel,
    seq: int | None,
    error: wire.WireError,
    *,
    request_id: str | None = None,
) -> None:
    """Record a request refused at submission as a failed future under its seq_id, and tell
    the model worker to step past it: the SDK has spent that seq_id, and the model's next
    request would otherwise wait for it forever. A seq_id already submitted keeps its
    earlier request (a resubmission refused now does not undo it); ``request_id`` is the
    id this request claimed the seq_id with (``Turn.claim``), if it did."""
    if seq is None or not 1 <= seq <= s.MAX_ID:
        return
    request_id = request_id or futures.new_request_id()
    answer = futures.submit(
        request_id,
        {"op": "skip", "rid": request_id, "model": model.id, "seq": seq},
        team_id=caller.team_id,
        base=model.base_model,
        dedupe_scope=_scope(model, seq),
    )
    if answer == request_id:
        futures.fail(request_id, json.dumps(error.body()), "user")


def _scope(model: TrainingModel, seq: int) -> str:
    return f"seq:{model.id}:{seq}"


def refuse_unparsed(
    caller: Caller, position: tuple[str, int] | None, error: wire.WireError
) -> None:
    """``refuse`` for a body that failed validation before its model was looked up, when
    it names (``position``) a model of the caller's and a seq_id."""
    if position is None:
        return
    model_id, seq = position
    model = TrainingModel.objects.for_team(caller.team_id).filter(pk=model_id).first()
    if model is not None:
        refuse(caller, model, seq, error)


@dataclass
class Turn:
    """The seq_id of one ordered request of a model (``ordered``)."""

    model: TrainingModel
    seq: int
    # Set by ``claim``: the id the request holds its seq_id with, before it is queued.
    request_id: str | None = None

    def claim(self) -> str | None:
        """Hold this seq_id for this request before anything of it is written; returns the
        request id of an earlier request that holds it already (a resubmission, or another
        request sent with the same seq_id), which answers for this one: it must write
        nothing (a checkpoint row of a save that never runs would resolve as a path)."""
        request_id = futures.new_request_id()
        earlier = futures.dedupe(_scope(self.model, self.seq), request_id)
        if earlier is None:
            self.request_id = request_id
        return earlier


def check_seq(seq: int | None) -> int:
    """The seq_id of an ordered request: the SDK numbers a model's requests from 1, and 0
    is its creation's (``create_model``, ``load_weights``), whose answer it would get."""
    if seq is None:
        raise wire.WireError("seq_id is required")
    if seq < 1:
        raise wire.WireError("seq_id must be 1 or more (0 is the model's creation)")
    return seq


def check_budget(caller: Caller) -> None:
    """Refuse (403) what would run on the model workers once the team's GPU-hours this
    month are spent. Saving and loading weights still run: a team keeps its work."""
    try:
        check_month_budget(caller.team_id)
    except BudgetSpent as exc:
        raise Refused(f"{exc}; saving and loading weights still work") from exc


def check_open(model: TrainingModel) -> None:
    """A model of a finished session takes no more requests: its weights were freed, and a
    worker would otherwise rebuild it from its last save and train on as if nothing had
    happened (the SDK's close(): "further operations against it will be rejected")."""
    session = model.session
    if session.finished:
        raise wire.WireError(
            f"session {session.pk} has ended ({session.finish_reason or 'finished'}"
            f"{': ' + session.finish_detail if session.finish_detail else ''}); model "
            f"{model.pk} takes no more requests: start a new training client, from a saved "
            "state to continue"
        )


@contextmanager
def ordered(caller: Caller, model: TrainingModel, seq: int | None) -> Iterator[Turn]:
    """Checks of a request that carries ``seq``, which is checked first: a refusal still
    advances the model's sequence (``refuse``) before it answers the client."""
    turn = Turn(model, seq or 0)
    try:
        turn.seq = check_seq(seq)
        check_open(model)
        yield turn
    except NotFound as exc:
        refuse(caller, model, seq, wire.WireError(str(exc), status=404), request_id=turn.request_id)
        raise
    except wire.WireError as exc:
        refuse(caller, model, seq, exc, request_id=turn.request_id)
        raise
    except Exception:
        # A failure of the server's own (a 500): a retry of the request must run it again,
        # not find a claimed seq_id that nothing answers.
        if turn.request_id is not None:
            futures.release_dedupe(_scope(model, turn.seq), turn.request_id)
        raise


def submit(
    caller: Caller,
    model: TrainingModel,
    seq: int | None,
    op: dict[str, Any],
    *,
    body: bytes | None = None,
    turn: Turn | None = None,
) -> str:
    """Queue one ordered request of ``model``; a duplicate seq_id answers the first future.
    With a ``turn`` that claimed the seq_id, the request is queued under the claimed id."""
    if seq is None:
        raise wire.WireError("seq_id is required")
    if seq < 0:
        raise wire.WireError("seq_id must not be negative")
    request_id = (turn.request_id if turn else None) or futures.new_request_id()
    answer = futures.submit(
        request_id,
        {**op, "rid": request_id, "model": model.id, "seq": seq},
        team_id=caller.team_id,
        base=model.base_model,
        body=body,
        dedupe_scope=_scope(model, seq),
    )
    if answer != request_id:
        return answer
    # A database write per request would cost more than the request's own queueing.
    now = timezone.now()
    if now - model.last_request >= LAST_REQUEST_RESOLUTION:
        TrainingModel.objects.filter(pk=model.pk).update(last_request=now)
    ensure_worker(model.base_model)
    return request_id
