"""Training models: creation (quota, LoRA and optimizer checks), forward/backward, optimizer
steps and loading a saved state."""

from __future__ import annotations

import functools
import json
import secrets
from pathlib import Path
from typing import Any

from django.db import IntegrityError, transaction

from accounts.models import Quota
from tinker_api import images, wire
from tinker_api import schemas as s
from tinker_api.models import Checkpoint, TrainingModel
from tinker_api.services.lookups import (
    Caller,
    Refused,
    base_model,
    get_checkpoint,
    get_model,
    live_session,
    written_checkpoint,
)
from tinker_api.services.queue import check_budget, ordered, refuse_unparsed, submit
from workers import conf


def max_models_per_team() -> int:
    return conf.int_setting("OPENTINKER_TINKER_MAX_MODELS_PER_TEAM", minimum=0)


def _check_model_quota(caller: Caller) -> None:
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
    rid = submit(caller, model, 0, {"op": "create", "config": model.worker_config()})
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
        # Another request created it first; any other integrity error is not ours to hide.
        existing = TrainingModel.objects.filter(pk=model_id).first()
        if existing is None:
            raise
        return existing


def get_info(caller: Caller, model_id: str) -> s.GetInfoResponse:
    model = get_model(caller, model_id)
    base = base_model(model.base_model)
    directory = base.resolved_path()
    # What the SDK loads the tokenizer from and the cookbook picks a renderer by: the hub id
    # a client anywhere can fetch, else the local path (a client on this host).
    path = base.hub_id or str(directory)
    try:
        arch = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        arch = None
    return s.GetInfoResponse(
        model_id=model.id,
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
    try:
        batch = wire.decode_forward_backward(
            raw, content_type=content_type, forward_only=forward_only, check=False
        )
    except wire.WireError as exc:
        refuse_unparsed(caller, wire.forward_backward_position(raw, content_type), exc)
        raise
    model = get_model(caller, batch.model_id)
    with ordered(caller, model, batch.seq_id):
        check_budget(caller)
        base = base_model(model.base_model)
        count, image_token = images.counter_for(base.resolved_path())
        wire.expand_images(batch, count, image_token)
        wire.check_batch(batch, vocab_size(base.resolved_path()))
        if batch.loss_fn == "custom":
            raise wire.WireError(
                "loss_fn 'custom' is not run on this server: use forward_backward_custom, "
                "which computes the loss on the client"
            )
        longest = max(len(d.tokens) for d in batch.data)
        if longest > base.max_context:
            raise wire.WireError(
                f"a datum has {longest} tokens, over {base.name}'s context of {base.max_context}"
            )
    return submit(
        caller,
        model,
        batch.seq_id,
        {"op": "fwdbwd", "forward_only": batch.forward_only, "ctype": content_type or wire.JSON},
        body=raw,
    )


def vocab_size(directory: Path) -> int | None:
    """The embedding rows of a base model (its ``config.json``), cached per file version."""
    config = directory / "config.json"
    try:
        return _vocab_size(str(config), config.stat().st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _vocab_size(config: str, _mtime_ns: int) -> int | None:
    try:
        data = json.loads(Path(config).read_text())
    except (OSError, ValueError):
        return None
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def optim_step(caller: Caller, req: s.OptimStepRequest) -> str:
    model = get_model(caller, req.model_id)
    with ordered(caller, model, req.seq_id):
        check_budget(caller)
        if req.adam_params is None:
            kind = (req.optimizer_params or {}).get("type")
            raise wire.WireError(f"optimizer {kind!r} is not supported; send adam_params")
    adam = req.adam_params.model_dump()
    return submit(caller, model, req.seq_id, {"op": "optim", "adam": adam})


def _check_no_token(req: s.LoadWeightsRequest) -> None:
    if req.weights_access_token is not None:
        raise wire.WireError(
            "weights_access_token: this server does not load another account's checkpoints; "
            "load a checkpoint of your own team without a token"
        )


def _training_state(caller: Caller, path: str, *, into: TrainingModel | None = None) -> Checkpoint:
    """The training state at ``path``, written. Loaded ``into`` the model that saves it, it
    may still be queued: that model's worker runs the save before the load (seq_id order)."""
    ckpt = get_checkpoint(caller, path)
    if ckpt.kind != Checkpoint.Kind.TRAINING:
        raise wire.WireError(f"{path} holds sampler weights; load a tinker://.../weights/ path")
    if into is not None and ckpt.model_id == into.id and ckpt.size_bytes is None:
        return ckpt
    return written_checkpoint(caller, path)


def load_weights(caller: Caller, req: s.LoadWeightsRequest) -> tuple[str, str]:
    """(request_id, model_id): into an existing model (legacy) or a new one from the state."""
    if not req.creates_model:
        model = get_model(caller, req.model_id or "")
        with ordered(caller, model, req.seq_id) as turn:
            _check_no_token(req)
            file = str(_training_state(caller, req.path, into=model).file_path())
        rid = submit(
            caller,
            model,
            turn.seq,
            {"op": "load", "file": file, "optimizer": req.optimizer, "path": req.path},
        )
        return rid, model.id
    _check_no_token(req)
    ckpt = _training_state(caller, req.path)
    file = str(ckpt.file_path())
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
    rid = submit(
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
