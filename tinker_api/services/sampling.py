"""Sampling sessions and ``/asample``: checks at submission, then the queue of the base model."""

from __future__ import annotations

import functools
from typing import Any

from tinker_api import futures, images, wire
from tinker_api import schemas as s
from tinker_api.models import Checkpoint, SamplingSession
from tinker_api.services.lookups import (
    Caller,
    base_model,
    get_checkpoint,
    get_sampling_session,
    live_session,
)
from tinker_api.services.queue import check_budget, ensure_worker
from tinker_api.services.training import vocab_size
from workers import conf

DEFAULT_MAX_TOKENS = 256


def sample_queue_limit() -> int:
    """Queued sample requests per base model above which backpressure answers 429."""
    return conf.int_setting("OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT", minimum=1)


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


def stop_params(stop: str | list[str] | list[int] | None) -> dict[str, Any]:
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
        row = get_sampling_session(caller, req.sampling_session_id)
        if row.session.finished:
            raise wire.WireError(
                f"sampling session {row.pk} belongs to session {row.session_id}, which has "
                "ended: create a sampling client in a new session"
            )
        return row
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


def _check_topk_vocabulary(req: s.SampleRequest, vocab: int | None) -> None:
    """A top-k wider than the vocabulary asks for tokens that do not exist."""
    if vocab is None:
        return
    for name, k in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
    ):
        if k > vocab:
            raise wire.WireError(f"{name}: {k} is over the base model's vocabulary of {vocab}")


def sample(
    caller: Caller, req: s.SampleRequest, *, backpressure: bool
) -> tuple[str | None, list[str]]:
    """(request_id, sample_sequence_ids); request_id None means "queue full, retry"."""
    session = _request_sampling_session(caller, req)
    check_budget(caller)
    base = base_model(session.base_model)
    _check_topk_vocabulary(req, vocab_size(base.resolved_path()))
    count, image_token = images.counter_for(base.resolved_path())
    prompt, pictures = wire.sample_prompt(
        req, None if count is None else functools.partial(count, where="prompt"), image_token
    )
    targets = (
        None
        if req.target_prompt_logprobs is None
        else wire.prompt_targets(req.target_prompt_logprobs, len(prompt))
    )
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
    stop = stop_params(sp.stop)
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
                "team": caller.team_id,
                "target": target,
                "prompt": prompt,
                "images": [image.to_json() for image in pictures],
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
