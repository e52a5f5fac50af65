"""Queueing requests for the model worker of a base model, starting one when none runs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from celery import current_app
from django.utils import timezone

from tinker_api import futures, wire
from tinker_api import schemas as s
from tinker_api.models import TrainingModel
from tinker_api.services.lookups import Caller, NotFound, base_model
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


def refuse(caller: Caller, model: TrainingModel, seq: int | None, error: wire.WireError) -> None:
    """Record a request refused at submission as a failed future under its seq_id, and tell
    the model worker to step past it: the SDK has spent that seq_id, and the model's next
    request would otherwise wait for it forever. A seq_id already submitted keeps its
    earlier request (a resubmission refused now does not undo it)."""
    if seq is None or not 1 <= seq <= s.MAX_ID:
        return
    request_id = futures.new_request_id()
    answer = futures.submit(
        request_id,
        {"op": "skip", "rid": request_id, "model": model.id, "seq": seq},
        team_id=caller.team_id,
        base=model.base_model,
        dedupe_scope=f"seq:{model.id}:{seq}",
    )
    if answer == request_id:
        futures.fail(request_id, json.dumps(error.body()), "user")


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


@contextmanager
def ordered(caller: Caller, model: TrainingModel, seq: int | None) -> Iterator[None]:
    """Checks of a request that carries ``seq``: a refusal still advances the model's
    sequence (``refuse``) before it answers the client."""
    try:
        yield
    except NotFound as exc:
        refuse(caller, model, seq, wire.WireError(str(exc), status=404))
        raise
    except wire.WireError as exc:
        refuse(caller, model, seq, exc)
        raise


def submit(
    caller: Caller,
    model: TrainingModel,
    seq: int | None,
    op: dict[str, Any],
    *,
    body: bytes | None = None,
) -> str:
    """Queue one ordered request of ``model``; a duplicate seq_id answers the first future."""
    if seq is None:
        raise wire.WireError("seq_id is required")
    if seq < 0:
        raise wire.WireError("seq_id must not be negative")
    request_id = futures.new_request_id()
    answer = futures.submit(
        request_id,
        {**op, "rid": request_id, "model": model.id, "seq": seq},
        team_id=caller.team_id,
        base=model.base_model,
        body=body,
        dedupe_scope=f"seq:{model.id}:{seq}",
    )
    if answer != request_id:
        return answer
    # A database write per request would cost more than the request's own queueing.
    now = timezone.now()
    if now - model.last_request >= LAST_REQUEST_RESOLUTION:
        TrainingModel.objects.filter(pk=model.pk).update(last_request=now)
    ensure_worker(model.base_model)
    return request_id
