"""Who is calling and what they may see: another team's ids read as unknown (``NotFound``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from jobs.models import BaseModel
from tinker_api import wire
from tinker_api.models import Checkpoint, SamplingSession, TinkerSession, TrainingModel


class NotFound(Exception):
    """An id this caller cannot see: missing, or another team's (answered alike)."""


class Refused(wire.WireError):
    """A request refused by a rule (quota), not by its format: 403."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=403)


@dataclass(frozen=True)
class Caller:
    team_id: int
    user: Any
    key: Any


def base_model(name: str) -> Any:
    row = BaseModel.objects.enabled().filter(name=name).first()
    if row is None:
        names = sorted(BaseModel.objects.enabled().values_list("name", flat=True))
        raise wire.WireError(f"unknown base model {name!r}; available: {names}")
    return row


def get_session(caller: Caller, session_id: str) -> TinkerSession:
    row = TinkerSession.objects.for_team(caller.team_id).filter(pk=session_id).first()
    if row is None:
        raise NotFound(f"unknown session {session_id}")
    return row


def live_session(caller: Caller, session_id: str) -> TinkerSession:
    row = get_session(caller, session_id)
    if row.finished:
        raise wire.WireError(f"session {session_id} has finished")
    return row


def get_model(caller: Caller, model_id: str) -> TrainingModel:
    row = (
        TrainingModel.objects.for_team(caller.team_id)
        .select_related("session")
        .filter(pk=model_id)
        .first()
    )
    if row is None:
        raise NotFound(f"unknown model {model_id}")
    return row


def get_sampling_session(caller: Caller, sampling_session_id: str) -> SamplingSession:
    row = (
        SamplingSession.objects.for_team(caller.team_id)
        .select_related("checkpoint", "session")
        .filter(pk=sampling_session_id)
        .first()
    )
    if row is None:
        raise NotFound(f"unknown sampling session {sampling_session_id}")
    return row


def get_checkpoint(caller: Caller, path: str) -> Checkpoint:
    run, kind, name = wire.parse_tinker_path(path)
    row = (
        Checkpoint.objects.for_team(caller.team_id)
        .select_related("model")
        .filter(model_id=run, kind=kind, name=name)
        .first()
    )
    if row is None or (row.expires_at is not None and row.expires_at <= timezone.now()):
        raise NotFound(f"unknown checkpoint {path}")
    return row


def written_checkpoint(caller: Caller, path: str) -> Checkpoint:
    """``get_checkpoint`` of a checkpoint whose file is on disk: one whose save is still
    queued, or failed, has nothing to describe or load yet."""
    row = get_checkpoint(caller, path)
    if not row.written:
        raise NotFound(f"unknown checkpoint {path}: its save has not been written")
    return row
