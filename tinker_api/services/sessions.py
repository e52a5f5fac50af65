"""Tinker sessions: created by a ``ServiceClient``, kept alive by its heartbeats, ended by it
or by silence."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import timedelta

from django.utils import timezone

from tinker_api import futures
from tinker_api import schemas as s
from tinker_api.models import TinkerSession, TrainingModel
from tinker_api.schema_limits import metadata_out
from tinker_api.services.lookups import Caller, get_session
from workers import conf


def create_session(caller: Caller, req: s.CreateSessionRequest) -> TinkerSession:
    return TinkerSession.objects.create(
        id=f"s-{uuid.uuid4().hex}",
        team_id=caller.team_id,
        api_key=caller.key,
        tags=req.tags,
        user_metadata=req.user_metadata,
        display_name=req.display_name or "",
        project_id=req.project_id or "",
        sdk_version=req.sdk_version[:64],
    )


def heartbeat(caller: Caller, session_id: str) -> bool:
    """False when the session has finished (the SDK stops heartbeating on 410)."""
    row = get_session(caller, session_id)
    if row.finished:
        return False
    TinkerSession.objects.filter(pk=row.pk).update(last_heartbeat=timezone.now())
    return True


def finish_session(caller: Caller, session_id: str, req: s.SessionFinishRequest) -> None:
    row = get_session(caller, session_id)
    # The first reason wins: a conditional update.
    finished = TinkerSession.objects.filter(pk=row.pk, finished_at__isnull=True).update(
        finished_at=timezone.now(), finish_reason=req.reason.type, finish_detail=req.detail or ""
    )
    if not finished:
        return
    by_base: dict[str, list[str]] = {}
    for model in TrainingModel.objects.filter(session=row):
        by_base.setdefault(model.base_model, []).append(model.id)
        # The state a model worker left when it gave its block back serves no one now.
        model.drop_spill()
    for base, models in by_base.items():
        # Only a running worker holds these models; none to start for a goodbye.
        current = futures.worker_of(base)
        if current and futures.worker_alive(current):
            request_id = futures.new_request_id()
            futures.create(request_id, team_id=caller.team_id, kind="close", base=base)
            futures.enqueue(base, {"op": "close", "rid": request_id, "models": models})


def session_timeout() -> int:
    """A session silent this long (the SDK heartbeats every 10 s) is over: its models go."""
    return conf.int_setting("OPENTINKER_TINKER_SESSION_TIMEOUT_SECONDS", minimum=10)


def end_silent_sessions(model_ids: Collection[str], timeout_seconds: int) -> list[str]:
    """Of ``model_ids``, those whose session is over: finished, or silent for
    ``timeout_seconds`` (its client is gone), which ends it here as ``interrupted``."""
    cutoff = timezone.now() - timedelta(seconds=timeout_seconds)
    rows = TrainingModel.objects.filter(pk__in=model_ids).values_list(
        "id", "session_id", "session__last_heartbeat", "session__finished_at"
    )
    silent = {sid for _m, sid, beat, done in rows if done is None and beat < cutoff}
    _interrupt(silent)
    return [m for m, sid, _beat, done in rows if done is not None or sid in silent]


def list_sessions(caller: Caller, limit: int, offset: int) -> list[str]:
    """The team's session ids, newest first."""
    qs = TinkerSession.objects.for_team(caller.team_id).order_by("-created")
    return list(qs.values_list("id", flat=True)[offset : offset + limit])


def session_info(caller: Caller, session_id: str) -> s.GetSessionResponse:
    session = get_session(caller, session_id)
    return s.GetSessionResponse(
        training_run_ids=list(session.models.values_list("id", flat=True)),
        sampler_ids=list(session.sampling_sessions.values_list("id", flat=True)),
        user_metadata=metadata_out(session.user_metadata),
        display_name=session.display_name or None,
    )


def end_abandoned_sessions(timeout_seconds: int) -> int:
    """End every session silent for ``timeout_seconds`` (its client is gone) as
    ``interrupted``, and delete the live states model workers left for its models; returns
    how many ended. A model worker that still holds such a model closes it at its next reap."""
    cutoff = timezone.now() - timedelta(seconds=timeout_seconds)
    silent = list(
        TinkerSession.objects.filter(
            finished_at__isnull=True, last_heartbeat__lt=cutoff
        ).values_list("pk", flat=True)[:1000]
    )
    ended = _interrupt(silent)
    for model in TrainingModel.objects.filter(session_id__in=silent):
        model.drop_spill()
    return ended


def _interrupt(session_ids: Collection[str]) -> int:
    """End those of ``session_ids`` still open as interrupted (their client went silent)."""
    return TinkerSession.objects.filter(pk__in=session_ids, finished_at__isnull=True).update(
        finished_at=timezone.now(), finish_reason="interrupted", finish_detail="no heartbeat"
    )
