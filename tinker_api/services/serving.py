"""OpenAI-style serving: which policies a caller may name, and queueing their requests.

A model name is one of (first match wins):

- a base model (``tiny``): the registry's enabled rows;
- ``job:<id>``: the final policy of one of the team's jobs (its adapter, or its model when it
  trained every weight); ``job:<id>:<checkpoint>``: one of its native checkpoints (the
  weights of the saved training state);
- the name of one of the team's jobs: the newest job of that name with a final policy;
- ``tinker://<run>/sampler_weights/<name>``: a Tinker sampler checkpoint.

Another team's jobs and checkpoints are unknown (``NotFound``), like every other id. The
request itself goes to the model worker of the policy's base model (``tinker_api.worker``),
which renders the prompt with the base model's own tokenizer: the web process loads none.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from accounts.models import Quota
from jobs import artifacts
from jobs.models import BaseModel, Job
from jobs.quotas import check_month_budget
from jobs.spec import SpecError, parse_spec
from tinker_api import events, futures, wire
from tinker_api.models import Checkpoint
from tinker_api.services.lookups import Caller, NotFound, get_checkpoint
from tinker_api.services.queue import ensure_worker
from tinker_api.services.sampling import sample_queue_limit
from workers import conf

JOB_PREFIX = "job:"
TINKER_PREFIX = "tinker://"
# /v1/models looks at this many of the team's newest jobs (each costs a look at its files).
LISTED_JOBS = 200


class UnknownModel(NotFound):
    """A name that is no base model and none of the caller's policies."""


class Busy(Exception):
    """No room now: the team's concurrency limit or the base model's queue (retry later).

    ``retry_after``: seconds the caller should wait; ``headers``: what the answer adds."""

    retry_after: float = 1.0
    # Shared and never mutated: RateLimited sets its own.
    headers: dict[str, str] = {}


class RateLimited(Busy):
    """The team's requests or tokens per minute (its quota) are used up until ``retry_after``."""

    def __init__(self, message: str, *, retry_after: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


class NotServable(Exception):
    """A name the caller may see that cannot be sampled (yet): a training state, a job with no
    final weights, a base model that is disabled."""


@dataclass(frozen=True)
class Served:
    """A policy to sample: its base model and the worker's description of its weights."""

    name: str
    base: BaseModel
    target: dict[str, Any]
    created: int
    owned_by: str


def _job_target(job: Job, checkpoint: str | None) -> tuple[BaseModel, dict[str, Any]]:
    """The base model and the worker's target of a job's final policy or one checkpoint:
    a LoRA adapter (``file``, ``scale``) beside the base, or a whole model (``full``: the
    exported model directory, or a checkpoint's training state) that the base model's worker
    loads on its own."""
    try:
        spec = parse_spec(job.spec)
    except SpecError as exc:
        raise NotServable(f"job {job.pk} has an unreadable spec") from exc
    base = BaseModel.objects.enabled().filter(name=spec.base_model).first()
    if base is None:
        raise NotServable(f"job {job.pk}'s base model {spec.base_model!r} is not enabled")
    if checkpoint is None:
        final = artifacts.model_dir(job.pk) if spec.full_finetune else artifacts.adapter_dir(job.pk)
        if final is None:
            what = "model" if spec.full_finetune else "adapter"
            raise NotServable(f"job {job.pk} has no final {what} yet (state {job.state})")
        file = str(final)
    else:
        state = artifacts.checkpoint_file(job.pk, checkpoint)
        if state is None:
            raise UnknownModel(f"job {job.pk} has no checkpoint {checkpoint!r}")
        file = str(state)
    if spec.full_finetune:
        return base, {"full": file}
    return base, {"file": file, "scale": spec.lora.alpha / spec.lora.rank}


def _job(caller: Caller, ident: str) -> Job:
    try:
        pk = uuid.UUID(ident)
    except ValueError as exc:
        raise UnknownModel(f"unknown job {ident!r}") from exc
    job = Job.objects.filter(team_id=caller.team_id, pk=pk).first()
    if job is None:
        raise UnknownModel(f"unknown job {ident!r}")
    return job


def resolve(caller: Caller, name: str) -> Served:
    """The policy ``name`` means to this caller (see the module docstring)."""
    base = BaseModel.objects.enabled().filter(name=name).first()
    if base is not None:
        return Served(name, base, {}, int(base.created.timestamp()), "system")
    if name.startswith(TINKER_PREFIX):
        return _tinker(caller, name)
    if name.startswith(JOB_PREFIX):
        ident, _, checkpoint = name[len(JOB_PREFIX) :].partition(":")
        job = _job(caller, ident)
        base, target = _job_target(job, checkpoint or None)
        return Served(name, base, target, int(job.created.timestamp()), job.team.slug)
    for job in Job.objects.filter(team_id=caller.team_id, name=name).order_by("-created"):
        if artifacts.final_policy(job.pk) is not None:
            base, target = _job_target(job, None)
            return Served(name, base, target, int(job.created.timestamp()), job.team.slug)
    raise UnknownModel(f"unknown model {name!r}")


def _sampler_target(ckpt: Checkpoint) -> dict[str, Any]:
    """What the worker's sampler cache loads: the live snapshot while its worker holds it,
    else the files (as ``/asample`` describes the same checkpoint)."""
    return {
        "model": ckpt.model_id,
        "checkpoint": ckpt.pk,
        "file": str(ckpt.file_path()),
        "rank": ckpt.model.lora_rank,
    }


def _tinker(caller: Caller, path: str) -> Served:
    try:
        ckpt = get_checkpoint(caller, path)
    except NotFound as exc:
        raise UnknownModel(str(exc)) from exc
    except wire.WireError as exc:  # a malformed tinker:// path names nothing
        raise UnknownModel(f"unknown checkpoint {path}") from exc
    if ckpt.kind != Checkpoint.Kind.SAMPLER:
        raise NotServable(f"{path} is not sampler weights; serve a sampler_weights path")
    if ckpt.size_bytes is None and ckpt.version is None:
        raise NotServable(f"the sampler weights {path} are not saved yet")
    base = BaseModel.objects.enabled().filter(name=ckpt.model.base_model).first()
    if base is None:
        raise NotServable(f"{path}'s base model {ckpt.model.base_model!r} is not enabled")
    return Served(path, base, _sampler_target(ckpt), int(ckpt.created.timestamp()), "tinker")


def list_models(caller: Caller) -> list[Served]:
    """Everything ``resolve`` would serve to this caller, base models first."""
    out = [
        Served(b.name, b, {}, int(b.created.timestamp()), "system")
        for b in BaseModel.objects.enabled().order_by("name")
    ]
    jobs = Job.objects.filter(team_id=caller.team_id).select_related("team")
    for job in jobs.order_by("-created")[:LISTED_JOBS]:
        try:
            if artifacts.final_policy(job.pk) is not None:
                base, target = _job_target(job, None)
                out.append(
                    Served(
                        f"{JOB_PREFIX}{job.pk}",
                        base,
                        target,
                        int(job.created.timestamp()),
                        job.team.slug,
                    )
                )
            for ckpt in artifacts.checkpoints(job.pk):
                if ckpt["kind"] != "native":
                    continue
                base, target = _job_target(job, ckpt["name"])
                out.append(
                    Served(
                        f"{JOB_PREFIX}{job.pk}:{ckpt['name']}",
                        base,
                        target,
                        int(ckpt["created"]) or int(job.created.timestamp()),
                        job.team.slug,
                    )
                )
        except NotServable:
            continue
    now = timezone.now()
    sampler = (
        Checkpoint.objects.for_team(caller.team_id)
        .filter(kind=Checkpoint.Kind.SAMPLER)
        .exclude(size_bytes__isnull=True, version__isnull=True)
        .select_related("model")
    )
    enabled = {b.name: b for b in BaseModel.objects.enabled()}
    for ckpt in sampler.order_by("-created"):
        if ckpt.expires_at is not None and ckpt.expires_at <= now:
            continue
        sampled_base = enabled.get(ckpt.model.base_model)
        if sampled_base is None:
            continue
        out.append(
            Served(
                ckpt.tinker_path,
                sampled_base,
                _sampler_target(ckpt),
                int(ckpt.created.timestamp()),
                "tinker",
            )
        )
    return out


def team_concurrency() -> int:
    return conf.int_setting("OPENTINKER_OPENAI_TEAM_CONCURRENCY", minimum=1)


def submit(caller: Caller, served: Served, op: dict[str, Any], *, hold_seconds: float) -> str:
    """Queue one chat or completion request; its request id. ``Busy`` when the caller's team
    has its limit of requests in flight, or the base model's queue is full. The request
    counts against its team until ``finish`` (or ``hold_seconds``, if that never comes).
    ``BudgetSpent`` once the team's GPU-hours this month are spent."""
    check_month_budget(caller.team_id)
    request_id = futures.new_request_id()
    limit = team_concurrency()
    if not events.take_slot(caller.team_id, request_id, limit, hold_seconds):
        raise Busy(
            f"your team has {limit} requests in flight (OPENTINKER_OPENAI_TEAM_CONCURRENCY); "
            "retry when one ends"
        )
    # After the concurrency slot: a request refused for concurrency spends no quota.
    try:
        _take_rate(caller)
    except Busy:
        events.release_slot(caller.team_id, request_id)
        raise
    if futures.queued_samples(served.base.name) >= sample_queue_limit():
        events.release_slot(caller.team_id, request_id)
        raise Busy(f"the queue of base model {served.base.name} is full; retry shortly")
    futures.submit(
        request_id,
        {
            **op,
            "op": "chat",
            "rid": request_id,
            "target": served.target,
            "max_context": served.base.max_context,
        },
        team_id=caller.team_id,
        base=served.base.name,
    )
    ensure_worker(served.base.name)
    return request_id


def _take_rate(caller: Caller) -> None:
    quota = Quota.objects.filter(team_id=caller.team_id).first()
    rpm = quota.openai_requests_per_minute if quota else 0
    tpm = quota.openai_tokens_per_minute if quota else 0
    if not rpm and not tpm:
        return
    ok, requests, tokens, left = events.take_rate(caller.team_id, rpm, tpm)
    # OpenAI's rate-limit headers, for clients that pace themselves by them.
    headers = {}
    if rpm:
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, rpm - requests))
        headers["x-ratelimit-reset-requests"] = f"{left:.0f}s"
    if tpm:
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tpm - tokens))
        headers["x-ratelimit-reset-tokens"] = f"{left:.0f}s"
    if not ok:
        what = f"{tpm} tokens per minute" if tpm and tokens >= tpm else f"{rpm} requests per minute"
        raise RateLimited(
            f"your team has used its {what} (its quota); retry in {left:.0f} s",
            retry_after=left,
            headers=headers,
        )


def finish(caller: Caller, request_id: str, tokens: int = 0) -> None:
    """The request is answered (or its client is gone): it no longer counts for its team;
    ``tokens`` (prompt + completion) count against its tokens per minute."""
    events.release_slot(caller.team_id, request_id)
    events.charge_tokens(caller.team_id, tokens)


def state(request_id: str) -> tuple[str, str] | None:
    """(status, error) of a request whose events stopped coming: ``failed`` when its worker
    failed it or died holding it, else its status; None once it is forgotten."""
    row = futures.get(request_id)
    if row is None:
        return None
    status = str(row.get("status", ""))
    if status == futures.CLAIMED:
        worker = str(row.get("worker", ""))
        if worker and not futures.worker_alive(worker):
            return futures.FAILED, "the model worker serving this request stopped"
    return status, str(row.get("error", ""))


def keep_worker(served: Served) -> None:
    """Ask again for a worker for a request still waiting (none may have had a GPU block)."""
    ensure_worker(served.base.name)


def follow(
    request_id: str,
    served: Served,
    *,
    poll_ms: int = 1000,
    nudge_seconds: float = 5.0,
    silence_seconds: float = 600.0,
) -> Iterator[dict[str, Any] | None]:
    """The request's events as they come, ending with ``done`` or ``error`` (a ``503`` one
    when its worker failed or none answered for ``silence_seconds``); None for each poll of
    ``poll_ms`` that brought nothing, so that a caller can write between them."""
    after = "0"
    heard = time.monotonic()
    nudge = heard + nudge_seconds
    while True:
        got = events.read(request_id, after, poll_ms)
        if got:
            heard = time.monotonic()
            for ident, event in events.coalesce(got):
                after = ident
                yield event
                if event["t"] in ("done", "error"):
                    return
            continue
        now = time.monotonic()
        found = state(request_id)
        if found is None or found[0] in futures.FINAL:
            message = found[1] if found and found[1] else "the request ended without an answer"
            yield {"t": "error", "status": 503, "message": message}
            return
        if found[0] == futures.QUEUED and now > nudge:
            nudge = now + nudge_seconds
            keep_worker(served)
        if now - heard > silence_seconds:
            events.cancel(request_id)
            yield {"t": "error", "status": 503, "message": "no model worker answered in time"}
            return
        yield None
