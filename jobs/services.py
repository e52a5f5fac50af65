"""Every job transition, in one place.

Each state change is a conditional UPDATE (``filter(pk=..., state__in=..., attempt=...)``)
plus a ``JobEvent`` in the same transaction. Zero rows updated means someone else got there
first (a cancel, the reaper, a newer attempt): the caller stops, it does not retry blindly.
Functions called by workers return ``bool``; ``cancel_job`` and ``submit_job``, called for
API users, raise exceptions that carry a clear message.

The state machine::

    QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    QUEUED -> CANCELLED | FAILED       STARTING -> FAILED | CANCELLED
    STARTING | RUNNING -> QUEUED (requeue, attempt += 1) or FAILED (out of attempts)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from functools import partial
from typing import Any
from uuid import UUID

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from accounts.models import Quota, Team

from .datasets import BUILTIN_REF_PREFIX, find_team_dataset
from .models import (
    ACTIVE_STATES,
    FINAL_STATES,
    BaseModel,
    Job,
    JobEvent,
    JobKind,
    JobMetric,
    JobState,
)
from .spec import JobSpec, SpecError, check_base_model_limits, parse_spec

logger = logging.getLogger(__name__)

JobId = UUID | str

# Which states each final state may be entered from.
_FINISH_FROM: dict[str, tuple[str, ...]] = {
    JobState.SUCCEEDED: (JobState.RUNNING,),
    JobState.FAILED: (JobState.QUEUED, JobState.STARTING, JobState.RUNNING),
    JobState.CANCELLED: (JobState.QUEUED, JobState.STARTING, JobState.RUNNING),
}


class QuotaExceeded(Exception):
    """A submission over one of the team's quotas. ``quota`` names it."""

    # max_queued_jobs is transient (wait and retry: 429); the others need an admin (403).
    RETRYABLE = frozenset({"max_queued_jobs"})

    def __init__(self, quota: str, limit: float, current: float) -> None:
        self.quota = quota
        self.limit = limit
        self.current = current
        super().__init__(f"quota exceeded: {quota} (limit {limit:g}, current {current:g})")

    @property
    def retryable(self) -> bool:
        return self.quota in self.RETRYABLE


class GpuRequestTooLarge(Exception):
    """The job asks for more GPUs than the largest node has: it could never be placed."""

    def __init__(self, requested: int, largest: int) -> None:
        self.requested = requested
        self.largest = largest
        super().__init__(f"the job asks for {requested} GPUs but the largest node has {largest}")


class IllegalTransition(Exception):
    """A transition the job's current state does not allow (e.g. cancelling a finished job)."""


# --- hooks into workers/ (lazy: workers depends on jobs, not the other way round) -----------


def _optional(module: str, attr: str) -> Any | None:
    """``module.attr`` if the workers package provides it yet, else None."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only a missing workers module is tolerated; a broken import inside it is a bug.
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        return None
    return getattr(mod, attr, None)


def _request_dispatch() -> None:
    request_dispatch = _optional("workers.dispatcher", "request_dispatch")
    if request_dispatch is None:
        logger.warning("workers.dispatcher is not available; the job waits in the queue")
        return
    try:
        request_dispatch()
    except Exception:
        # The job is committed as QUEUED; the next dispatch (release, reaper) will admit it.
        logger.exception("dispatch request failed; the job stays queued")


def _cancel_running(job_id: str) -> None:
    cancel_running = _optional("workers.control", "cancel_running")
    if cancel_running is None:
        logger.warning("workers.control is not available; job %s ends at its next check", job_id)
        return
    try:
        cancel_running(job_id)
    except Exception:
        # cancel_requested is committed; the runner sees it through the job row as well.
        logger.exception("cancel_running(%s) failed", job_id)


def largest_node_gpus() -> int | None:
    """GPUs on the largest node announced by workers, or None while unknown."""
    max_block_size = _optional("workers.inventory", "max_block_size")
    if max_block_size is None:
        return None
    size = max_block_size()
    # 0 means no worker has announced yet: jobs queue until one does.
    return int(size) if size else None


# --- usage ----------------------------------------------------------------------------------


def month_start(now: datetime | None = None) -> datetime:
    now = now or timezone.now()
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def gpus_in_use(team_id: int) -> int:
    """GPUs held by the team's starting and running jobs."""
    held = Job.objects.filter(team_id=team_id, state__in=ACTIVE_STATES).values_list(
        "gpus_held", flat=True
    )
    return sum(len(g or []) for g in held)


def gpu_seconds_this_month(team_id: int, now: datetime | None = None) -> float:
    """GPU time charged this calendar month (UTC): finished attempts plus running ones so far.

    An attempt is charged to the month in which it ends (or now, while it runs).
    """
    now = now or timezone.now()
    start = month_start(now)
    jobs = Job.objects.filter(team_id=team_id)
    done = (
        jobs.filter(
            Q(finished__gte=start) | Q(state__in=[JobState.QUEUED, *ACTIVE_STATES])
        ).aggregate(total=Sum("gpu_seconds"))["total"]
        or 0.0
    )
    running = 0.0
    for started, held in jobs.filter(state__in=ACTIVE_STATES, started__isnull=False).values_list(
        "started", "gpus_held"
    ):
        running += max(0.0, (now - started).total_seconds()) * len(held or [])
    return float(done) + running


def quota_usage(team: Team) -> dict[str, float | int]:
    return {
        "gpus_in_use": gpus_in_use(team.pk),
        "queued_jobs": Job.objects.filter(team=team, state=JobState.QUEUED).count(),
        "gpu_hours_this_month": round(gpu_seconds_this_month(team.pk) / 3600.0, 4),
    }


# --- events ---------------------------------------------------------------------------------


def add_event(
    job_id: JobId,
    kind: str,
    message: str,
    data: Mapping[str, Any] | None = None,
    *,
    from_state: str = "",
    to_state: str = "",
) -> JobEvent:
    return JobEvent.objects.create(
        job_id=job_id,
        kind=kind,
        message=message,
        data=dict(data or {}),
        from_state=from_state,
        to_state=to_state,
    )


def _transition_event(
    job_id: JobId, from_state: str, to_state: str, message: str, **data: Any
) -> None:
    add_event(
        job_id,
        JobEvent.Kind.STATE,
        message,
        data,
        from_state=from_state,
        to_state=to_state,
    )


def _attempt_gpu_seconds(job: Job, now: datetime) -> float:
    if job.started is None:
        return 0.0
    return max(0.0, (now - job.started).total_seconds()) * len(job.gpus_held or [])


# --- submit ---------------------------------------------------------------------------------


def _check_base_model(parsed: JobSpec) -> list[dict[str, str]]:
    # A smoke job loads no model: only a base_model the caller named explicitly is checked.
    if parsed.method == "smoke" and "base_model" not in parsed.model_fields_set:
        return []
    model = BaseModel.objects.filter(name=parsed.base_model).first()
    if model is not None and model.enabled:
        # Every submission path (API, web form, admin, scripts) meets the registry's limits.
        return check_base_model_limits(
            parsed, max_lora_rank=model.max_lora_rank, max_context=model.max_context
        )
    available = ", ".join(BaseModel.objects.enabled().values_list("name", flat=True)) or "none"
    reason = "is disabled" if model is not None else "is not a registered base model"
    return [
        {"field": "base_model", "reason": f"{parsed.base_model!r} {reason}; available: {available}"}
    ]


def _check_env_and_dataset(parsed: JobSpec, team: Team) -> tuple[str | None, list[dict[str, str]]]:
    """Apply the environment's 2x2 contract and find the dataset.

    Returns the canonical dataset reference to store (``dataset:<id>`` or ``builtin:<name>``)
    and the errors.
    """
    from environments.datasets import DatasetValidationError, resolve
    from environments.registry import ContractError, check_contract, get_env

    if parsed.env is None:
        return parsed.dataset, []  # the spec model already refused a dataset without env
    try:
        check_contract(parsed.env, parsed.dataset)
    except ContractError as exc:
        return parsed.dataset, [exc.as_dict()]
    if parsed.dataset is None:
        return None, []
    if parsed.dataset.startswith(BUILTIN_REF_PREFIX):
        try:
            resolve(parsed.dataset)
        except DatasetValidationError as exc:
            return parsed.dataset, [{"field": "dataset", "reason": exc.errors[0].reason}]
        return parsed.dataset, []
    dataset = find_team_dataset(team.pk, parsed.dataset)
    if dataset is None:
        reason = f"team {team.slug!r} has no dataset {parsed.dataset!r} (by name or id)"
        return parsed.dataset, [{"field": "dataset", "reason": reason}]
    if dataset.env != parsed.env:
        # Validated for another env: fine when both read the same columns.
        try:
            same = get_env(dataset.env).schema == get_env(parsed.env).schema
        except ContractError:
            same = False
        if not same:
            reason = (
                f"dataset {dataset.name!r} was validated for env {dataset.env!r}, whose columns "
                f"differ from env {parsed.env!r}'s; upload it for {parsed.env!r}"
            )
            return parsed.dataset, [{"field": "dataset", "reason": reason}]
    return dataset.ref, []


def _check_eval(parsed: JobSpec, team: Team, kind: str) -> list[dict[str, str]]:
    """An eval job names what it evaluates; a training job must not.

    ``eval.from_job`` must be a LoRA job of the same team on the same base model, with the
    named checkpoint, or (no checkpoint) a final adapter, already on disk.
    """
    from . import artifacts

    if kind != JobKind.EVAL:
        if parsed.eval is not None:
            return [{"field": "eval", "reason": "only valid for kind 'eval'"}]
        return []
    if parsed.eval is None:
        return [{"field": "eval", "reason": "required for kind 'eval' ({} = the base model)"}]
    if parsed.eval.from_job is None:
        return []
    source = Job.objects.filter(pk=parsed.eval.from_job, team=team).first()
    if source is None:
        reason = f"team {team.slug!r} has no job {parsed.eval.from_job}"
        return [{"field": "eval.from_job", "reason": reason}]
    try:
        source_spec = parse_spec(source.spec)
    except SpecError:
        source_spec = None
    if source_spec is None or source_spec.method not in ("rl", "sft") or source.kind != "train":
        return [{"field": "eval.from_job", "reason": "is not a training job (rl or sft)"}]
    if source_spec.full_finetune:
        reason = "trained every weight (full_finetune); eval jobs load LoRA adapters"
        return [{"field": "eval.from_job", "reason": reason}]
    if source_spec.base_model != parsed.base_model:
        reason = f"job {source.pk} trained base model {source_spec.base_model!r}"
        return [{"field": "base_model", "reason": reason}]
    if parsed.eval.checkpoint is not None:
        if artifacts.checkpoint_file(source.pk, parsed.eval.checkpoint) is None:
            listed = artifacts.checkpoints(source.pk)
            # Eval jobs load the native engine's state; verl checkpoints are not for it.
            names = ", ".join(c["name"] for c in listed if c["kind"] == "native") or "none"
            reason = f"job {source.pk} has no checkpoint {parsed.eval.checkpoint!r}; has: {names}"
            return [{"field": "eval.checkpoint", "reason": reason}]
        return []
    if artifacts.adapter_dir(source.pk) is None:
        reason = (
            f"job {source.pk} has no final adapter yet (state {source.state}); "
            "name one of its checkpoints in eval.checkpoint"
        )
        return [{"field": "eval.from_job", "reason": reason}]
    return []


def submit_job(
    *,
    team: Team,
    user: AbstractBaseUser | None,
    spec: dict[str, Any],
    name: str,
    kind: str = JobKind.TRAIN,
) -> Job:
    """Validate, check quotas under the team's quota row lock, write QUEUED, dispatch on commit.

    Beyond the spec's own rules, ``base_model`` must be a registered, enabled base model
    and ``env``/``dataset`` must obey the environment registry's contract, the dataset being
    one of the team's (stored as ``dataset:<id>``) or a built-in one.

    Raises ``SpecError``, ``QuotaExceeded`` or ``GpuRequestTooLarge``.
    """
    parsed = parse_spec(spec)
    if kind not in JobKind.values:
        raise SpecError(
            [{"field": "kind", "reason": f"must be one of {', '.join(JobKind.values)}"}]
        )
    name = (name or "").strip() or f"{parsed.method}-job"
    if len(name) > 200:
        raise SpecError([{"field": "name", "reason": "at most 200 characters"}])

    largest = largest_node_gpus()
    if largest is not None and parsed.gpus > largest:
        raise GpuRequestTooLarge(parsed.gpus, largest)

    with transaction.atomic():
        # The row lock serialises submissions of one team, so the counts below cannot be
        # raced: 50 concurrent submissions against max_queued_jobs=5 admit exactly 5.
        quota, _ = Quota.objects.select_for_update().get_or_create(team=team)
        # Under the lock: jobs.datasets.delete_dataset takes it too, so a dataset cannot be
        # deleted between being found here and the job row naming it.
        dataset_ref, errors = _check_env_and_dataset(parsed, team)
        errors = _check_base_model(parsed) + errors + _check_eval(parsed, team, kind)
        if errors:
            raise SpecError(errors)
        normalized = parsed.model_dump(mode="json")
        normalized["dataset"] = dataset_ref
        if parsed.gpus > quota.max_gpus:
            raise QuotaExceeded("max_gpus", quota.max_gpus, parsed.gpus)
        queued = Job.objects.filter(team=team, state=JobState.QUEUED).count()
        if queued >= quota.max_queued_jobs:
            raise QuotaExceeded("max_queued_jobs", quota.max_queued_jobs, queued)
        used_hours = gpu_seconds_this_month(team.pk) / 3600.0
        if used_hours >= quota.gpu_hours_per_month:
            raise QuotaExceeded("gpu_hours_per_month", quota.gpu_hours_per_month, used_hours)

        job = Job.objects.create(
            team=team,
            created_by=user,
            name=name,
            kind=kind,
            spec=normalized,
            spec_version=parsed.version,
            state=JobState.QUEUED,
            priority=parsed.priority,
            gpus_requested=parsed.gpus,
        )
        _transition_event(job.pk, "", JobState.QUEUED, "submitted", gpus=parsed.gpus)
        transaction.on_commit(_request_dispatch)
    return job


# --- transitions driven by workers ----------------------------------------------------------


def mark_starting(job_id: JobId, *, node: str, gpus: Iterable[str], task_id: str) -> bool:
    """QUEUED -> STARTING: the dispatcher holds a GPU block for the job and sent its task.

    False when the job is no longer queued, or when starting it would take the team over its
    ``max_gpus`` (GPUs in use at once): the job stays queued and the dispatcher releases the
    block, to try again after the team's next release.
    """
    gpus = [str(g) for g in gpus]
    now = timezone.now()
    with transaction.atomic():
        team_id = (
            Job.objects.filter(pk=job_id, state=JobState.QUEUED)
            .values_list("team_id", flat=True)
            .first()
        )
        if team_id is None:
            return False
        # Same lock as submit_job: two starts of one team cannot both pass the check.
        quota = Quota.objects.select_for_update().filter(team_id=team_id).first()
        if quota is not None and gpus_in_use(team_id) + len(gpus) > quota.max_gpus:
            logger.info("job %s waits: team %s is at its max_gpus quota", job_id, team_id)
            return False
        updated = Job.objects.filter(pk=job_id, state=JobState.QUEUED).update(
            state=JobState.STARTING,
            node=node,
            gpus_held=gpus,
            celery_task_id=task_id,
            started=now,
            heartbeat=now,
        )
        if updated:
            _transition_event(
                job_id, JobState.QUEUED, JobState.STARTING, f"placed on {node}", gpus=gpus
            )
    return bool(updated)


def mark_running(job_id: JobId, *, attempt: int) -> bool:
    """STARTING -> RUNNING: the runner of ``attempt`` has started."""
    with transaction.atomic():
        updated = Job.objects.filter(pk=job_id, state=JobState.STARTING, attempt=attempt).update(
            state=JobState.RUNNING, heartbeat=timezone.now()
        )
        if updated:
            _transition_event(
                job_id, JobState.STARTING, JobState.RUNNING, "running", attempt=attempt
            )
    return bool(updated)


def finish_job(
    job_id: JobId,
    state: str,
    *,
    attempt: int,
    error_code: str = "",
    error_message: str = "",
) -> bool:
    """Enter a final state. False if the job is not in a state that may enter it, or if
    ``attempt`` is stale (a requeued job's old runner must not finish the new attempt)."""
    if state not in _FINISH_FROM:
        raise ValueError(f"{state!r} is not a final state")
    allowed = _FINISH_FROM[state]
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id, attempt=attempt, state__in=allowed).first()
        if job is None:
            return False
        charged = _attempt_gpu_seconds(job, now)
        updated = Job.objects.filter(pk=job_id, attempt=attempt, state=job.state).update(
            state=state,
            finished=now,
            gpu_seconds=F("gpu_seconds") + charged,
            error_code=error_code[:64],
            error_message=error_message,
        )
        if updated:
            _transition_event(
                job_id,
                job.state,
                state,
                error_message or state.lower(),
                attempt=attempt,
                error_code=error_code,
                gpu_seconds=charged,
            )
            transaction.on_commit(_request_dispatch)
    return bool(updated)


def requeue_job(job_id: JobId, *, attempt: int, reason: str, max_attempts: int) -> bool:
    """A starting/running attempt died (lease expired): back to QUEUED with attempt + 1, or
    FAILED once ``max_attempts`` attempts have been used. A job whose cancel was requested is
    CANCELLED instead of being retried."""
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).first()
        if job is None:
            return False
        charged = _attempt_gpu_seconds(job, now)
        guard = Job.objects.filter(pk=job_id, attempt=attempt, state=job.state)
        if job.cancel_requested:
            to_state, message = JobState.CANCELLED, f"cancelled ({reason})"
            updated = guard.update(
                state=to_state,
                finished=now,
                gpu_seconds=F("gpu_seconds") + charged,
            )
        elif attempt >= max_attempts:
            to_state = JobState.FAILED
            message = f"{reason}; gave up after {attempt} attempt(s)"
            updated = guard.update(
                state=to_state,
                finished=now,
                gpu_seconds=F("gpu_seconds") + charged,
                error_code="max_attempts",
                error_message=message,
            )
        else:
            to_state, message = JobState.QUEUED, f"requeued: {reason}"
            updated = guard.update(
                state=to_state,
                attempt=attempt + 1,
                gpu_seconds=F("gpu_seconds") + charged,
                gpus_held=[],
                node="",
                celery_task_id="",
                started=None,
                heartbeat=None,
            )
        if updated:
            _transition_event(
                job_id,
                job.state,
                to_state,
                message,
                attempt=attempt,
                reason=reason,
                gpu_seconds=charged,
            )
            transaction.on_commit(_request_dispatch)
    return bool(updated)


def heartbeat(job_id: JobId, *, attempt: int, step: int | None = None) -> bool:
    """Record liveness of ``attempt``. False means the attempt is no longer the job's live
    one (cancelled, finished or requeued): the runner should stop."""
    fields: dict[str, Any] = {"heartbeat": timezone.now()}
    if step is not None:
        if step < 0:
            raise ValueError("step must be >= 0")
        fields["current_step"] = step
    updated = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).update(
        **fields
    )
    return bool(updated)


def check_metrics(step: int, metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics of ``step`` as finite floats; ValueError names what cannot be stored."""
    if step < 0:
        raise ValueError("step must be >= 0")
    checked: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > 100:
            raise ValueError(f"metric name must be a non-empty string of <= 100 chars: {name!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is not finite: {value}")
        checked[name] = value
    return checked


def record_metrics(job_id: JobId, step: int, metrics: Mapping[str, float], *, attempt: int) -> bool:
    """Upsert metric values of ``step``; a resumed run overwrites what it logged before.
    False (nothing written) when ``attempt`` is not the job's live attempt."""
    return record_metric_steps(job_id, [(step, metrics)], attempt=attempt)


def record_metric_steps(
    job_id: JobId, steps: Iterable[tuple[int, Mapping[str, float]]], *, attempt: int
) -> bool:
    """Upsert the metrics of several steps in one transaction (a runner buffers a few steps
    between writes: one commit per step is most of a managed job's overhead on SQLite).
    A step given twice keeps its last values. False (nothing written) when ``attempt`` is not
    the job's live attempt."""
    latest: dict[tuple[int, str], JobMetric] = {}
    for step, metrics in steps:
        for name, value in check_metrics(step, metrics).items():
            latest[(step, name)] = JobMetric(job_id=job_id, step=step, name=name, value=value)
    if not latest:
        return True
    with transaction.atomic():
        live = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).exists()
        if not live:
            return False
        JobMetric.objects.bulk_create(
            list(latest.values()),
            update_conflicts=True,
            unique_fields=["job", "step", "name"],
            update_fields=["value"],
        )
    return True


def discard_metrics_after(job_id: JobId, step: int, *, attempt: int) -> int | None:
    """Delete the metrics of steps after ``step``: a run resumed from the checkpoint of
    ``step`` redoes them, and rows an earlier attempt wrote past it must not linger (or
    outlive it, should the new run log fewer names). None when ``attempt`` is not live."""
    with transaction.atomic():
        live = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).exists()
        if not live:
            return None
        deleted, _ = JobMetric.objects.filter(job_id=job_id, step__gt=step).delete()
    return deleted


# --- cancel ---------------------------------------------------------------------------------


def cancel_job(job: Job, *, by: AbstractBaseUser | None = None) -> Job:
    """QUEUED -> CANCELLED at once; STARTING/RUNNING -> ``cancel_requested`` and, on commit,
    ``workers.control.cancel_running`` (flag, revoke, lease release); the runner then ends
    the job as CANCELLED. Cancelling twice is harmless; a finished job raises
    ``IllegalTransition``."""
    who = {"by": getattr(by, "username", None)} if by is not None else {}
    # A job may move (QUEUED -> STARTING, or back on requeue) between read and update.
    for _ in range(3):
        job.refresh_from_db()
        if job.state in FINAL_STATES:
            raise IllegalTransition(f"job is already {job.state}")
        with transaction.atomic():
            if job.state == JobState.QUEUED:
                updated = Job.objects.filter(pk=job.pk, state=JobState.QUEUED).update(
                    state=JobState.CANCELLED,
                    cancel_requested=True,
                    finished=timezone.now(),
                )
                if updated:
                    _transition_event(
                        job.pk, JobState.QUEUED, JobState.CANCELLED, "cancelled", **who
                    )
                    break
            else:
                updated = Job.objects.filter(
                    pk=job.pk, state__in=ACTIVE_STATES, cancel_requested=False
                ).update(cancel_requested=True)
                if updated:
                    add_event(job.pk, JobEvent.Kind.CANCEL_REQUESTED, "cancel requested", who)
                    transaction.on_commit(partial(_cancel_running, str(job.pk)))
                    break
                if Job.objects.filter(
                    pk=job.pk, state__in=ACTIVE_STATES, cancel_requested=True
                ).exists():
                    break  # already requested: idempotent
    job.refresh_from_db()
    return job
