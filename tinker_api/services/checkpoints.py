"""Checkpoints and training runs: every write of a checkpoint row, from the web process (a
save asked for, a TTL, a deletion) and from the model worker (the file it wrote)."""

from __future__ import annotations

import re
import shutil
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from tinker_api import schemas as s
from tinker_api import wire
from tinker_api.models import Checkpoint, SamplingSession, TrainingModel
from tinker_api.schema_limits import metadata_out
from tinker_api.services.lookups import Caller, get_checkpoint, get_model
from tinker_api.services.queue import Turn, ordered, submit

# Names the SDK puts into tinker:// paths: no "/" and nothing that walks up a directory.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# Name prefix of the sampler checkpoints of unnamed saves with kind="inflight".
INFLIGHT_PREFIX = "inflight-"


def _checkpoint_file(model: TrainingModel, kind: str, name: str) -> str:
    folder = Checkpoint(kind=kind).segment
    suffix = ".pt" if kind == Checkpoint.Kind.TRAINING else ""
    return f"tinker/{model.team_id}/{model.id}/{folder}/{name}{suffix}"


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise wire.WireError(
            f"invalid checkpoint name {name!r}: letters, digits, '.', '_' and '-', 1-200 chars"
        )


def _new_checkpoint(
    model: TrainingModel,
    kind: str,
    name: str,
    *,
    ttl_seconds: int | None,
    overwrite: bool,
    user_metadata: dict[str, str] | None,
    seq: int,
) -> Checkpoint:
    """The row of a save, written once every check of its request has passed and its seq_id
    is claimed (``Turn.claim``): a refused or deduplicated save writes nothing."""
    check_name(name)
    existing = Checkpoint.objects.filter(model=model, kind=kind, name=name).first()
    if existing is not None and not (
        # A resubmission whose claim had expired reuses the row of its first submission.
        overwrite or existing.seq == seq
    ):
        raise wire.WireError(f"checkpoint {existing.tinker_path} exists; pass overwrite")
    expires = timezone.now() + timedelta(seconds=ttl_seconds) if ttl_seconds else None
    try:
        with transaction.atomic():
            if existing is not None:
                existing.delete()
            return Checkpoint.objects.create(
                model=model,
                team_id=model.team_id,
                kind=kind,
                name=name,
                file=_checkpoint_file(model, kind, name),
                expires_at=expires,
                user_metadata=user_metadata or None,
                seq=seq,
            )
    except IntegrityError:
        # Another save of the same name, with another seq_id, got there first.
        raise wire.WireError(
            f"checkpoint tinker://{model.id}/{Checkpoint(kind=kind).segment}/{name} exists; "
            "pass overwrite"
        ) from None


def save_weights(caller: Caller, req: s.SaveWeightsRequest) -> str:
    model = get_model(caller, req.model_id)
    with ordered(caller, model, req.seq_id) as turn:
        name = req.path or f"step-{turn.seq}"
        check_name(name)
        earlier = turn.claim()
        if earlier is not None:
            return earlier
        ckpt = _new_checkpoint(
            model,
            Checkpoint.Kind.TRAINING,
            name,
            ttl_seconds=req.ttl_seconds,
            overwrite=req.overwrite,
            user_metadata=req.user_metadata,
            seq=turn.seq,
        )
    op = {"op": "save_state", "checkpoint": ckpt.pk}
    return submit(caller, model, turn.seq, op, turn=turn)


def save_weights_for_sampler(caller: Caller, req: s.SaveWeightsForSamplerRequest) -> str:
    model = get_model(caller, req.model_id)
    with ordered(caller, model, req.seq_id) as turn:
        if req.path is not None:
            check_name(req.path)
        earlier = turn.claim()
        if earlier is not None:
            return earlier
        op = _sampler_rows(caller, model, req, turn)
    return submit(caller, model, turn.seq, op, turn=turn)


def _sampler_rows(
    caller: Caller, model: TrainingModel, req: s.SaveWeightsForSamplerRequest, turn: Turn
) -> dict[str, Any]:
    """The rows of a sampler save (its checkpoint, and the sampling session an unnamed save
    creates); the model worker's op."""
    op: dict[str, Any] = {"op": "save_sampler"}
    ckpt = _new_checkpoint(
        model,
        Checkpoint.Kind.SAMPLER,
        req.path if req.path is not None else _unnamed_sampler(model, req, turn.seq),
        ttl_seconds=req.ttl_seconds,
        overwrite=req.path is None,
        user_metadata=req.user_metadata,
        seq=turn.seq,
    )
    if req.path is None:
        sampling_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
        SamplingSession.objects.update_or_create(
            id=sampling_id,
            defaults={"model_path": ckpt.tinker_path},
            create_defaults={
                "session_id": model.session_id,
                "team_id": caller.team_id,
                "base_model": model.base_model,
                "model_path": ckpt.tinker_path,
            },
        )
        op["sampling_session_id"] = sampling_id
    return {**op, "checkpoint": ckpt.pk}


def _unnamed_sampler(model: TrainingModel, req: s.SaveWeightsForSamplerRequest, seq: int) -> str:
    # "inflight" saves are marked by name: each one also moves the model's earlier inflight
    # sampling sessions onto its weights (record_sampler_saved).
    prefix = INFLIGHT_PREFIX if req.kind == "inflight" else "session-"
    return f"{prefix}{req.sampling_session_seq_id}-seq-{seq}"


def record_state_saved(checkpoint_pk: int, *, size_bytes: int, step: int) -> None:
    """The model worker wrote a training state's file: from now on it is listed and loadable."""
    Checkpoint.objects.filter(pk=checkpoint_pk).update(size_bytes=size_bytes, step=step)


def record_sampler_saved(
    ckpt: Checkpoint,
    *,
    size_bytes: int,
    step: int,
    version: int,
    sampling_session_id: str | None,
) -> None:
    """The model worker wrote sampler weights (snapshot ``version``); the sampling session
    the save named samples from them from now on."""
    Checkpoint.objects.filter(pk=ckpt.pk).update(size_bytes=size_bytes, step=step, version=version)
    if not sampling_session_id:
        return
    SamplingSession.objects.filter(pk=sampling_session_id).update(checkpoint=ckpt)
    if ckpt.name.startswith(INFLIGHT_PREFIX):
        # The inflight contract: a later inflight save reaches the clients of the earlier
        # ones too (their next samples run on these weights).
        SamplingSession.objects.filter(
            checkpoint__model_id=ckpt.model_id, checkpoint__name__startswith=INFLIGHT_PREFIX
        ).update(checkpoint=ckpt, model_path=ckpt.tinker_path)


def _checkpoint_out(c: Checkpoint) -> s.Checkpoint:
    return s.Checkpoint(
        checkpoint_id=f"{c.segment}/{c.name}",
        checkpoint_type=c.kind,  # type: ignore[arg-type]
        time=c.created,
        tinker_path=c.tinker_path,
        size_bytes=c.size_bytes,
        public=c.public,
        user_metadata=metadata_out(c.user_metadata),
        expires_at=c.expires_at,
    )


def purge_expired(team_id: int) -> int:
    """Delete the team's checkpoints whose TTL has passed, files included."""
    gone = list(Checkpoint.objects.for_team(team_id).filter(expires_at__lte=timezone.now()))
    for c in gone:
        delete_checkpoint_row(c)
    return len(gone)


def delete_checkpoint_row(c: Checkpoint) -> None:
    path = c.file_path()
    c.delete()
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def list_checkpoints(caller: Caller, model_id: str | None) -> list[s.Checkpoint]:
    purge_expired(caller.team_id)
    qs = Checkpoint.objects.for_team(caller.team_id).exclude(size_bytes__isnull=True)
    if model_id is not None:
        qs = qs.filter(model=get_model(caller, model_id))
    return [_checkpoint_out(c) for c in qs]


def _checkpoint_by_id(caller: Caller, run: str, segment: str, name: str) -> Checkpoint:
    return get_checkpoint(caller, f"tinker://{run}/{segment}/{name}")


def delete_checkpoint(caller: Caller, run: str, segment: str, name: str) -> None:
    delete_checkpoint_row(_checkpoint_by_id(caller, run, segment, name))


def set_checkpoint_ttl(caller: Caller, run: str, segment: str, name: str, ttl: int | None) -> None:
    c = _checkpoint_by_id(caller, run, segment, name)
    expires = timezone.now() + timedelta(seconds=ttl) if ttl else None
    Checkpoint.objects.filter(pk=c.pk).update(expires_at=expires)


def set_checkpoint_public(caller: Caller, run: str, segment: str, name: str, public: bool) -> None:
    c = _checkpoint_by_id(caller, run, segment, name)
    Checkpoint.objects.filter(pk=c.pk).update(public=public)


def training_run(caller: Caller, model: TrainingModel) -> s.TrainingRun:
    done = model.checkpoints.exclude(size_bytes__isnull=True)
    last = done.filter(kind=Checkpoint.Kind.TRAINING).first()
    last_sampler = done.filter(kind=Checkpoint.Kind.SAMPLER).first()
    return s.TrainingRun(
        training_run_id=model.id,
        base_model=model.base_model,
        model_owner=str(model.team_id),
        is_lora=True,
        lora_rank=model.lora_rank,
        last_request_time=model.last_request,
        last_checkpoint=_checkpoint_out(last) if last else None,
        last_sampler_checkpoint=_checkpoint_out(last_sampler) if last_sampler else None,
        user_metadata=metadata_out(model.user_metadata),
    )
