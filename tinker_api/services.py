"""The Tinker protocol's operations, called by the views.

Each mutating call checks ownership (another team's ids are unknown), validates what it can
at submission (bad input is a 400 the SDK shows at once), and queues the work for the model
worker of the model's base model through ``tinker_api.futures``. A resubmission of the same
protocol id (``model_id`` + ``seq_id``, ...) answers the future of the first one.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from tinker_api import futures, wire
from tinker_api import schemas as s
from tinker_api.models import Checkpoint, SamplingSession, TinkerSession, TrainingModel
from workers import conf

# Names the SDK puts into tinker:// paths: no "/" and nothing that walks up a directory.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# How long a worker may take from being sent to registering before another start is tried.
WORKER_START_SECONDS = 120
# A model's ``last_request`` (shown as its run's last request time) is written at most this often.
LAST_REQUEST_RESOLUTION = timedelta(seconds=10)
DEFAULT_MAX_TOKENS = 256
# Name prefix of the sampler checkpoints of unnamed saves with kind="inflight".
INFLIGHT_PREFIX = "inflight-"


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


def max_models_per_team() -> int:
    return conf._int_setting("OPENTINKER_TINKER_MAX_MODELS_PER_TEAM", 64, minimum=0)


def sample_queue_limit() -> int:
    """Queued sample requests per base model above which backpressure answers 429."""
    return conf._int_setting("OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT", 256, minimum=1)


def long_poll_seconds() -> float:
    # The SDK waits 45 s for a poll; answering well before keeps its retries quiet.
    return float(conf._int_setting("OPENTINKER_TINKER_LONG_POLL_SECONDS", 10, minimum=0))


# --------------------------------------------------------------------------- lookups


def base_model(name: str) -> Any:
    from jobs.models import BaseModel

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
    row = TrainingModel.objects.for_team(caller.team_id).filter(pk=model_id).first()
    if row is None:
        raise NotFound(f"unknown model {model_id}")
    return row


def get_sampling_session(caller: Caller, sampling_session_id: str) -> SamplingSession:
    row = (
        SamplingSession.objects.for_team(caller.team_id)
        .select_related("checkpoint")
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


# --------------------------------------------------------------------------- sessions


def create_session(caller: Caller, req: s.CreateSessionRequest) -> TinkerSession:
    return TinkerSession.objects.create(
        id=f"s-{uuid.uuid4().hex}",
        team_id=caller.team_id,
        api_key=caller.key,
        tags=req.tags,
        user_metadata=req.user_metadata,
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
    for model_id, base in TrainingModel.objects.filter(session=row).values_list("id", "base_model"):
        by_base.setdefault(base, []).append(model_id)
    for base, models in by_base.items():
        # Only a running worker holds these models; none to start for a goodbye.
        current = futures.worker_of(base)
        if current and futures.worker_alive(current):
            request_id = futures.new_request_id()
            futures.create(request_id, team_id=caller.team_id, kind="close", base=base)
            futures.enqueue(base, {"op": "close", "rid": request_id, "models": models})


# --------------------------------------------------------------------------- workers


def ensure_worker(base: str) -> s.QueueState:
    """Start a model worker for ``base`` unless one runs or is starting; the queue state to
    report to pollers (``paused_capacity`` while no GPU block is free)."""
    from workers.locktable import GpuLockTable

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
    from opentinker_site.celery import node_queue
    from tinker_api.modelworker import serve_base_model

    try:
        serve_base_model.apply_async(
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


def _submit(
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


# --------------------------------------------------------------------------- models


def _check_model_quota(caller: Caller) -> None:
    from accounts.models import Quota

    quota = Quota.objects.filter(team_id=caller.team_id).first()
    if quota is not None and quota.max_gpus == 0:
        raise Refused("your team's quota allows no GPUs")
    live = TrainingModel.objects.for_team(caller.team_id).filter(session__finished_at__isnull=True)
    if live.count() >= max_models_per_team():
        raise Refused(
            f"your team has {max_models_per_team()} models in unfinished sessions, the limit"
        )


def create_model(caller: Caller, req: s.CreateModelRequest) -> tuple[str, str]:
    """(request_id, model_id) of a new LoRA model."""
    session = live_session(caller, req.session_id)
    base = base_model(req.base_model)
    lora = req.lora_config or s.LoraConfig(rank=32)
    if lora.rank > base.max_lora_rank:
        raise wire.WireError(
            f"lora rank {lora.rank} is over {base.name}'s maximum {base.max_lora_rank}"
        )
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise wire.WireError(
            "lora_config: train_attn, train_mlp and train_unembed are all false; nothing to train"
        )
    _check_optimizer(req.optimizer_config)
    model_id = wire.model_id_for(session.id, req.model_seq_id)
    model = _model_once(
        caller,
        session,
        model_id,
        base_model=base.name,
        lora_rank=lora.rank,
        seed=lora.seed if lora.seed is not None else secrets.randbelow(2**31),
        train_unembed=lora.train_unembed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
        optimizer_config=req.optimizer_config.model_dump(),
        user_metadata=req.user_metadata,
    )
    rid = _submit(caller, model, 0, {"op": "create", "config": model.worker_config()})
    return rid, model_id


def _check_optimizer(config: s.OptimizerConfig) -> None:
    """Only AdamW runs here (``optim_step`` takes ``adam_params``): refuse another family at
    creation, not at the first step."""
    if config.type != "adamw":
        raise wire.WireError(
            f"optimizer_config.type {config.type!r} is not supported by this server; use 'adamw'"
        )
    extra = sorted(set(config.model_dump()) - {"type"})
    if extra:
        raise wire.WireError(f"optimizer_config: adamw takes no fields, got {extra}")


def _model_once(caller: Caller, session: Any, model_id: str, **fields: Any) -> TrainingModel:
    """The model row for `model_id`, created on first sight: a retried create_model or
    load_weights (same session and model_seq_id) finds the row the first attempt wrote."""
    model = TrainingModel.objects.filter(pk=model_id).first()
    if model is not None:
        return model
    _check_model_quota(caller)
    try:
        with transaction.atomic():
            return TrainingModel.objects.create(
                id=model_id,
                session=session,
                team_id=caller.team_id,
                created_by=caller.user,
                **fields,
            )
    except IntegrityError:
        return TrainingModel.objects.get(pk=model_id)


def get_info(caller: Caller, model_id: str) -> s.GetInfoResponse:
    model = get_model(caller, model_id)
    directory = base_model(model.base_model).resolved_path()
    path = str(directory)
    try:
        arch = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        arch = None
    return s.GetInfoResponse(
        model_id=model.id,
        # The SDK and the cookbook load the tokenizer from here, offline: a local path.
        model_data=s.ModelData(arch=arch, model_name=path, tokenizer_id=path),
        optimizer_config=s.OptimizerConfig.model_validate(model.optimizer_config or {}),
        is_lora=True,
        lora_rank=model.lora_rank,
        model_name=path,
    )


def forward_backward(
    caller: Caller,
    body: bytes,
    *,
    content_type: str | None,
    content_encoding: str | None,
    forward_only: bool,
) -> str:
    raw = wire.decompress(body, content_encoding)
    batch = wire.decode_forward_backward(raw, content_type=content_type, forward_only=forward_only)
    if batch.loss_fn == "custom":
        raise wire.WireError(
            "loss_fn 'custom' is not run on this server: use forward_backward_custom, which "
            "computes the loss on the client"
        )
    model = get_model(caller, batch.model_id)
    base = base_model(model.base_model)
    longest = max(len(d.tokens) for d in batch.data)
    if longest > base.max_context:
        raise wire.WireError(
            f"a datum has {longest} tokens, over {base.name}'s context of {base.max_context}"
        )
    return _submit(
        caller,
        model,
        batch.seq_id,
        {"op": "fwdbwd", "forward_only": batch.forward_only, "ctype": content_type or wire.JSON},
        body=raw,
    )


def optim_step(caller: Caller, req: s.OptimStepRequest) -> str:
    model = get_model(caller, req.model_id)
    if req.adam_params is None:
        kind = (req.optimizer_params or {}).get("type")
        raise wire.WireError(f"optimizer {kind!r} is not supported; send adam_params")
    adam = req.adam_params.model_dump()
    return _submit(caller, model, req.seq_id, {"op": "optim", "adam": adam})


def _checkpoint_file(model: TrainingModel, kind: str, name: str) -> str:
    folder = "weights" if kind == Checkpoint.Kind.TRAINING else "sampler_weights"
    suffix = ".pt" if kind == Checkpoint.Kind.TRAINING else ""
    return f"tinker/{model.team_id}/{model.id}/{folder}/{name}{suffix}"


def _new_checkpoint(
    model: TrainingModel,
    kind: str,
    name: str,
    *,
    ttl_seconds: int | None,
    overwrite: bool,
    user_metadata: dict[str, str] | None,
    seq: int | None,
) -> Checkpoint:
    if not _NAME.match(name):
        raise wire.WireError(
            f"invalid checkpoint name {name!r}: letters, digits, '.', '_' and '-', 1-200 chars"
        )
    existing = Checkpoint.objects.filter(model=model, kind=kind, name=name).first()
    if existing is not None:
        # A retried submission of the same request reuses its row.
        if overwrite or (existing.user_metadata or {}).get("_seq") == str(seq):
            existing.delete()
        else:
            raise wire.WireError(f"checkpoint {existing.tinker_path} exists; pass overwrite")
    expires = timezone.now() + timedelta(seconds=ttl_seconds) if ttl_seconds else None
    return Checkpoint.objects.create(
        model=model,
        team_id=model.team_id,
        kind=kind,
        name=name,
        file=_checkpoint_file(model, kind, name),
        expires_at=expires,
        user_metadata={**(user_metadata or {}), "_seq": str(seq)},
    )


def save_weights(caller: Caller, req: s.SaveWeightsRequest) -> str:
    model = get_model(caller, req.model_id)
    name = req.path or f"step-{req.seq_id}"
    ckpt = _new_checkpoint(
        model,
        Checkpoint.Kind.TRAINING,
        name,
        ttl_seconds=req.ttl_seconds,
        overwrite=req.overwrite,
        user_metadata=req.user_metadata,
        seq=req.seq_id,
    )
    return _submit(caller, model, req.seq_id, {"op": "save_state", "checkpoint": ckpt.pk})


def save_weights_for_sampler(caller: Caller, req: s.SaveWeightsForSamplerRequest) -> str:
    model = get_model(caller, req.model_id)
    op: dict[str, Any] = {"op": "save_sampler"}
    if req.path is not None:
        name = req.path
    else:
        # "inflight" saves are marked by name: each one also moves the model's earlier
        # inflight sampling sessions onto its weights (modelworker._op_save_sampler).
        prefix = INFLIGHT_PREFIX if req.kind == "inflight" else "session-"
        name = f"{prefix}{req.sampling_session_seq_id}-seq-{req.seq_id}"
        sampling_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
        SamplingSession.objects.get_or_create(
            id=sampling_id,
            defaults={
                "session_id": model.session_id,
                "team_id": caller.team_id,
                "base_model": model.base_model,
            },
        )
        op["sampling_session_id"] = sampling_id
    ckpt = _new_checkpoint(
        model,
        Checkpoint.Kind.SAMPLER,
        name,
        ttl_seconds=req.ttl_seconds,
        overwrite=req.path is None,
        user_metadata=req.user_metadata,
        seq=req.seq_id,
    )
    if req.path is None:
        SamplingSession.objects.filter(pk=op["sampling_session_id"]).update(
            model_path=ckpt.tinker_path
        )
    return _submit(caller, model, req.seq_id, {**op, "checkpoint": ckpt.pk})


def load_weights(caller: Caller, req: s.LoadWeightsRequest) -> tuple[str, str]:
    """(request_id, model_id): into an existing model (legacy) or a new one from the state."""
    if req.weights_access_token is not None:
        raise wire.WireError(
            "weights_access_token: this server does not load another account's checkpoints; "
            "load a checkpoint of your own team without a token"
        )
    ckpt = get_checkpoint(caller, req.path)
    if ckpt.kind != Checkpoint.Kind.TRAINING:
        raise wire.WireError(f"{req.path} holds sampler weights; load a tinker://.../weights/ path")
    file = str(ckpt.file_path())
    if not req.creates_model:
        model = get_model(caller, req.model_id or "")
        rid = _submit(
            caller,
            model,
            req.seq_id,
            {"op": "load", "file": file, "optimizer": req.optimizer, "path": req.path},
        )
        return rid, model.id
    session = live_session(caller, req.session_id or "")
    if req.optimizer_config is not None:
        _check_optimizer(req.optimizer_config)
    source = ckpt.model
    if req.base_model is not None and req.base_model != source.base_model:
        raise wire.WireError(
            f"base_model: {req.path} was trained on {source.base_model!r}; this server loads a "
            f"checkpoint only onto its own base model, not {req.base_model!r}"
        )
    assert req.model_seq_id is not None
    model_id = wire.model_id_for(session.id, req.model_seq_id)
    model = _model_once(
        caller,
        session,
        model_id,
        base_model=source.base_model,
        lora_rank=source.lora_rank,
        seed=source.seed,
        train_unembed=source.train_unembed,
        train_mlp=source.train_mlp,
        train_attn=source.train_attn,
        optimizer_config=(
            source.optimizer_config
            if req.optimizer or req.optimizer_config is None
            else req.optimizer_config.model_dump()
        ),
        user_metadata=req.user_metadata or source.user_metadata,
        init_checkpoint=file,
    )
    rid = _submit(
        caller,
        model,
        0,
        {
            "op": "create",
            "config": model.worker_config(),
            "init": file,
            "optimizer": req.optimizer,
            "path": req.path,
        },
    )
    return rid, model_id


# --------------------------------------------------------------------------- sampling


def create_sampling_session(caller: Caller, req: s.CreateSamplingSessionRequest) -> str:
    session = live_session(caller, req.session_id)
    sampling_id = f"{session.id}:sample:{req.sampling_session_seq_id}"
    existing = SamplingSession.objects.filter(pk=sampling_id).first()
    if existing is not None:
        return existing.id
    ckpt = None
    if req.model_path:
        ckpt = get_checkpoint(caller, req.model_path)
        if ckpt.kind != Checkpoint.Kind.SAMPLER:
            raise wire.WireError(
                f"{req.model_path} is a training state; sample from a sampler_weights path"
            )
        base = ckpt.model.base_model
    else:
        base = base_model(req.base_model or "").name
    SamplingSession.objects.get_or_create(
        id=sampling_id,
        defaults={
            "session": session,
            "team_id": caller.team_id,
            "base_model": base,
            "model_path": req.model_path or "",
            "checkpoint": ckpt,
        },
    )
    return sampling_id


def _sampling_target(session: SamplingSession) -> dict[str, Any]:
    ckpt = session.checkpoint
    if ckpt is None:
        if session.model_path:
            raise wire.WireError("the sampler weights of this session are not saved yet")
        return {}
    return {
        "model": ckpt.model_id,
        "checkpoint": ckpt.pk,
        "file": str(ckpt.file_path()),
        "rank": ckpt.model.lora_rank,
    }


def _stop_params(stop: str | list[str] | list[int] | None) -> dict[str, Any]:
    """The SDK's three stop forms: None keeps EOS stopping; a string or strings, or token
    ids, stop as well as EOS; an empty list disables every stop, EOS included."""
    if stop is None:
        return {"stop_strings": [], "stop_ids": [], "stop_on_eos": True}
    if isinstance(stop, str):
        stop = [stop]
    if not stop:
        return {"stop_strings": [], "stop_ids": [], "stop_on_eos": False}
    if all(isinstance(x, str) for x in stop):
        if any(x == "" for x in stop):
            raise wire.WireError("sampling_params.stop: stop strings must not be empty")
        return {"stop_strings": [str(x) for x in stop], "stop_ids": [], "stop_on_eos": True}
    ids = [int(x) for x in stop]
    if any(t < 0 for t in ids):
        raise wire.WireError("sampling_params.stop: stop token ids must not be negative")
    return {"stop_strings": [], "stop_ids": ids, "stop_on_eos": True}


def _request_sampling_session(caller: Caller, req: s.SampleRequest) -> SamplingSession:
    """The sampling session a sample runs in. The 0.38 SDK always names one; a request that
    names ``model_path`` or ``base_model`` instead (older clients, curl) samples from that
    through an unsaved session that lives for this request only (no seq_id dedupe)."""
    if req.sampling_session_id is not None:
        return get_sampling_session(caller, req.sampling_session_id)
    if req.model_path is None and req.base_model is None:
        raise wire.WireError("send sampling_session_id, model_path or base_model")
    if req.model_path is not None:
        ckpt = get_checkpoint(caller, req.model_path)
        if ckpt.kind != Checkpoint.Kind.SAMPLER:
            raise wire.WireError(
                f"{req.model_path} is a training state; sample from a sampler_weights path"
            )
        return SamplingSession(
            id="",
            team_id=caller.team_id,
            base_model=ckpt.model.base_model,
            model_path=req.model_path,
            checkpoint=ckpt,
        )
    return SamplingSession(
        id="", team_id=caller.team_id, base_model=base_model(req.base_model or "").name
    )


def sample(
    caller: Caller, req: s.SampleRequest, *, backpressure: bool
) -> tuple[str | None, list[str]]:
    """(request_id, sample_sequence_ids); request_id None means "queue full, retry"."""
    session = _request_sampling_session(caller, req)
    prompt = wire.sample_prompt(req)
    targets = (
        None
        if req.target_prompt_logprobs is None
        else wire.prompt_targets(req.target_prompt_logprobs, len(prompt))
    )
    base = base_model(session.base_model)
    sp = req.sampling_params
    room = base.max_context - len(prompt)
    max_tokens = sp.max_tokens if sp.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
    if max_tokens < 1:
        raise wire.WireError("max_tokens must be at least 1")
    if len(prompt) + max_tokens > base.max_context:
        raise wire.WireError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed {base.name}'s "
            f"context of {base.max_context}"
        )
    wire.check_topk_sample(req, max_tokens)
    stop = _stop_params(sp.stop)
    if backpressure and futures.queued_samples(base.name) >= sample_queue_limit():
        return None, []
    target = _sampling_target(session)
    request_id = futures.new_request_id()
    futures.create(request_id, team_id=caller.team_id, kind="sample", base=base.name)
    earlier = None
    if session.id and req.seq_id is not None:
        earlier = futures.dedupe(f"sample:{session.id}:{req.seq_id}", request_id)
    if earlier is not None:
        request_id = earlier
    else:
        futures.enqueue(
            base.name,
            {
                "op": "sample",
                "rid": request_id,
                "target": target,
                "prompt": prompt,
                "n": req.num_samples,
                "prompt_logprobs": bool(req.prompt_logprobs),
                "topk_prompt": req.topk_prompt_logprobs,
                "last_n": req.prompt_logprobs_last_n,
                "targets": None if targets is None else targets.ids.tolist(),
                "targets_csr": None if targets is None or targets.csr is None else targets.csr,
                "alt_k": req.prompt_alt_tokens_k,
                # Sequence ids are "<request_id>:<i>"; the worker records each one's tokens
                # and logprobs for StableReinforce when asked.
                "record": bool(req.record_stability_info),
                "params": {
                    "max_tokens": max_tokens,
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "top_k": sp.top_k,
                    "seed": sp.seed,
                    "topk": req.topk_sample_logprobs,
                    **stop,
                },
            },
        )
        ensure_worker(base.name)
    return request_id, [f"{request_id}:{i}" for i in range(req.num_samples)]


# --------------------------------------------------------------------------- futures


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


# --------------------------------------------------------------------------- checkpoints


def _checkpoint_out(c: Checkpoint) -> s.Checkpoint:
    meta = {k: v for k, v in (c.user_metadata or {}).items() if not k.startswith("_")}
    return s.Checkpoint(
        checkpoint_id=f"{'weights' if c.kind == Checkpoint.Kind.TRAINING else 'sampler_weights'}/{c.name}",
        checkpoint_type=c.kind,  # type: ignore[arg-type]
        time=c.created,
        tinker_path=c.tinker_path,
        size_bytes=c.size_bytes,
        user_metadata=meta or None,
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


def training_run(caller: Caller, model: TrainingModel) -> s.TrainingRun:
    done = model.checkpoints.exclude(size_bytes__isnull=True)
    last = done.filter(kind=Checkpoint.Kind.TRAINING).first()
    last_sampler = done.filter(kind=Checkpoint.Kind.SAMPLER).first()
    meta = model.user_metadata or None
    return s.TrainingRun(
        training_run_id=model.id,
        base_model=model.base_model,
        model_owner=str(model.team_id),
        is_lora=True,
        lora_rank=model.lora_rank,
        last_request_time=model.last_request,
        last_checkpoint=_checkpoint_out(last) if last else None,
        last_sampler_checkpoint=_checkpoint_out(last_sampler) if last_sampler else None,
        user_metadata={str(k): str(v) for k, v in meta.items()} if meta else None,
    )
