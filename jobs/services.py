"""Every job transition, in one place.

Each state change is a conditional UPDATE (``filter(pk=..., state__in=..., attempt=...)``)
plus a ``JobEvent`` in the same transaction. Zero rows updated means someone else got there
first (a cancel, the reaper, a newer attempt): the caller stops, it does not retry blindly.
Functions called by workers return ``bool``; ``cancel_job`` and ``submit_job``, called for
API users, raise exceptions that carry a clear message. Usage and quota counts live in
``jobs.quotas``, the submission checks in ``jobs.submission_checks``, metric rows in
``jobs.metric_services``; the names callers use from them are re-exported here.

The state machine::

    QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    QUEUED -> CANCELLED | FAILED       STARTING -> FAILED | CANCELLED
    STARTING | RUNNING -> QUEUED (requeue, attempt += 1) or FAILED (out of attempts)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import partial
from typing import Any
from uuid import UUID

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from accounts.models import Quota, Team

from . import hooks, placement
from .metric_services import (
    check_metrics,
    discard_metrics_after,
    record_metric_steps,
    record_metrics,
)
from .models import ACTIVE_STATES, FINAL_STATES, GpuCharge, Job, JobEvent, JobKind, JobState
from .quotas import (
    GpuRequestTooLarge,
    QuotaExceeded,
    attempt_charges,
    gpu_hours_spent,
    gpu_seconds_this_month,
    gpus_in_use,
    month_budget_note,
    month_start,
    quota_usage,
    spent_budget_notes,
)
from .spec import SpecError, parse_spec
from .submission_checks import (
    check_base_model,
    check_env_and_dataset,
    check_eval,
    check_init,
    check_opponent,
)

__all__ = [
    "GpuRequestTooLarge",
    "IllegalTransition",
    "QuotaExceeded",
    "add_event",
    "cancel_job",
    "check_metrics",
    "discard_metrics_after",
    "finish_job",
    "gpu_hours_spent",
    "gpu_seconds_this_month",
    "gpus_in_use",
    "heartbeat",
    "largest_node_gpus",
    "mark_running",
    "mark_starting",
    "month_budget_note",
    "month_start",
    "quota_usage",
    "record_metric_steps",
    "record_metrics",
    "requeue_job",
    "spent_budget_notes",
    "stop_jobs_over_budget",
    "submit_job",
]

logger = logging.getLogger(__name__)

JobId = UUID | str

# Which states each final state may be entered from.
_FINISH_FROM: dict[str, tuple[str, ...]] = {
    JobState.SUCCEEDED: (JobState.RUNNING,),
    JobState.FAILED: (JobState.QUEUED, JobState.STARTING, JobState.RUNNING),
    JobState.CANCELLED: (JobState.QUEUED, JobState.STARTING, JobState.RUNNING),
}


class IllegalTransition(Exception):
    """A transition the job's current state does not allow (e.g. cancelling a finished job)."""


# --- the control plane (registered by the workers app: jobs never imports workers) ----------


def _request_dispatch() -> None:
    plane = hooks.control_plane()
    if plane is None:
        logger.warning("no control plane is registered; the job waits in the queue")
        return
    try:
        plane.dispatch()
    except Exception:
        # The job is committed as QUEUED; the next dispatch (release, reaper) will admit it.
        logger.exception("dispatch request failed; the job stays queued")


def _cancel_running(job_id: str) -> None:
    plane = hooks.control_plane()
    if plane is None:
        logger.warning("no control plane is registered; job %s ends at its next check", job_id)
        return
    try:
        plane.cancel_running(job_id)
    except Exception:
        # cancel_requested is committed; the runner sees it through the job row as well.
        logger.exception("cancel_running(%s) failed", job_id)


def announced_node_sizes() -> list[int] | None:
    """GPUs of each node announced by workers, or None while unknown (as for
    ``largest_node_gpus``)."""
    plane = hooks.control_plane()
    if plane is None or plane.node_sizes is None:
        return None
    try:
        sizes = plane.node_sizes()
    except Exception:
        logger.warning("the nodes are unknown (control plane unreachable)", exc_info=True)
        return None
    return list(sizes) or None


def largest_node_gpus() -> int | None:
    """GPUs on the largest node announced by workers, or None while unknown."""
    plane = hooks.control_plane()
    if plane is None:
        return None
    try:
        size = plane.max_block_size()
    except Exception:
        # Redis is away: the size is unknown, as before any worker announced. The job is
        # accepted as QUEUED and the dispatcher, once Redis is back, holds it to the pool.
        logger.warning("the largest node is unknown (control plane unreachable)", exc_info=True)
        return None
    # 0 means no worker has announced yet: jobs queue until one does.
    return int(size) if size else None


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


class _Charges:
    """The GPU time of the attempt that ends now, each month its share. ``total`` goes into
    the job's conditional UPDATE; ``record()`` writes the month rows once that UPDATE won."""

    def __init__(self, job: Job, now: datetime) -> None:
        self.job = job
        self.months = attempt_charges(
            job.started, len(job.gpus_held or []), now, job.cancel_requested_at
        )
        self.total = sum(seconds for _, seconds in self.months)

    def record(self) -> None:
        GpuCharge.objects.bulk_create(
            GpuCharge(
                team_id=self.job.team_id,
                job=self.job,
                month=month,
                attempt=self.job.attempt,
                gpu_seconds=seconds,
            )
            for month, seconds in self.months
        )


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

    if parsed.gpus_per_node is None or parsed.gpus_per_node >= parsed.gpus:
        largest = largest_node_gpus()
        if largest is not None and parsed.gpus > largest:
            raise GpuRequestTooLarge(parsed.gpus, largest)
    else:
        sizes = announced_node_sizes()
        if sizes is not None and not placement.fits(sizes, parsed.gpus, parsed.gpus_per_node):
            raise GpuRequestTooLarge(
                parsed.gpus,
                max(sizes),
                reason=placement.too_large_reason(sizes, parsed.gpus, parsed.gpus_per_node),
                field="gpus_per_node",
            )

    with transaction.atomic():
        # The row lock serialises submissions of one team, so the counts below cannot be
        # raced: 50 concurrent submissions against max_queued_jobs=5 admit exactly 5.
        quota, _ = Quota.objects.select_for_update().get_or_create(team=team)
        # Under the lock: jobs.datasets.delete_dataset takes it too, so a dataset cannot be
        # deleted between being found here and the job row naming it.
        dataset_ref, errors = check_env_and_dataset(parsed, team)
        errors = check_base_model(parsed) + errors + check_eval(parsed, team, kind)
        errors += check_opponent(parsed, team) + check_init(parsed, team)
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
    ``max_gpus`` (GPUs in use at once) or its month of GPU-hours is spent: the job stays
    queued, with a note saying why, and the dispatcher releases the block, to try again after
    the team's next release (``max_gpus``) or at a later pass (the reaper's, every few
    seconds), once the quota is raised or the month has turned (``gpu_hours_per_month``).
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
        in_use = gpus_in_use(team_id) if quota is not None else 0
        if quota is not None and in_use + len(gpus) > quota.max_gpus:
            logger.info("job %s waits: team %s is at its max_gpus quota", job_id, team_id)
            note_waiting(
                {
                    job_id: f"the team's jobs hold {in_use} of its {quota.max_gpus} GPUs "
                    f"(max_gpus quota); this one needs {len(gpus)}"
                }
            )
            return False
        spent = gpu_hours_spent(quota, now) if quota is not None else None
        if quota is not None and spent is not None:
            logger.info("job %s waits: team %s has spent its GPU-hours", job_id, team_id)
            note_waiting({job_id: month_budget_note(spent, quota.gpu_hours_per_month)})
            return False
        updated = Job.objects.filter(pk=job_id, state=JobState.QUEUED).update(
            queue_note="",
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


def note_waiting(notes: Mapping[JobId, str]) -> None:
    """Say on each queued job why it still waits (shown on its page and in the API); a row
    whose note is unchanged is not written."""
    by_note: dict[str, list[JobId]] = {}
    for job_id, note in notes.items():
        by_note.setdefault(note[:300], []).append(job_id)
    for note, ids in by_note.items():
        Job.objects.filter(pk__in=ids, state=JobState.QUEUED).exclude(queue_note=note).update(
            queue_note=note
        )


def note_all_waiting(note: str) -> None:
    """The same note on every queued job (nothing can be placed at all)."""
    Job.objects.filter(state=JobState.QUEUED).exclude(queue_note=note).update(queue_note=note)


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
        charges = _Charges(job, now)
        if state == JobState.CANCELLED and not (error_code or error_message):
            # A stop the service asked for (a spent budget) keeps the reason it wrote then.
            error_code, error_message = job.error_code, job.error_message
        updated = Job.objects.filter(pk=job_id, attempt=attempt, state=job.state).update(
            state=state,
            finished=now,
            gpu_seconds=F("gpu_seconds") + charges.total,
            error_code=error_code[:64],
            error_message=error_message,
        )
        if updated:
            charges.record()
            _transition_event(
                job_id,
                job.state,
                state,
                error_message or state.lower(),
                attempt=attempt,
                error_code=error_code,
                gpu_seconds=charges.total,
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
        charges = _Charges(job, now)
        charged = charges.total
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
            charges.record()
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


def stop_jobs_over_budget(now: datetime | None = None) -> list[str]:
    """Stop the starting and running jobs of every team whose GPU-hours this month have reached
    ``gpu_hours_per_month`` (the reaper calls this every pass). Each stops as a cancel does: at
    its next step boundary, keeping its checkpoints, its GPUs taken back after the cancel
    grace period, billed up to now; it ends CANCELLED with ``error_code``
    ``gpu_hours_per_month`` and a message saying why (a user's cancel leaves both blank).
    Returns the ids of the jobs asked to stop."""
    now = now or timezone.now()
    live = Job.objects.filter(state__in=ACTIVE_STATES, cancel_requested=False)
    stopped: list[str] = []
    for quota in Quota.objects.filter(team_id__in=live.values("team_id")):
        spent = gpu_hours_spent(quota, now)
        if spent is None:
            continue
        limit = quota.gpu_hours_per_month
        message = (
            f"stopped: the team has used {round(spent, 2):g} of its {limit:g} GPU-hours this "
            "month (gpu_hours_per_month quota)"
        )
        for job_id in live.filter(team_id=quota.team_id).values_list("pk", flat=True):
            with transaction.atomic():
                updated = live.filter(pk=job_id).update(
                    cancel_requested=True,
                    cancel_requested_at=now,
                    error_code="gpu_hours_per_month",
                    error_message=message,
                )
                if updated:
                    data = {"quota": "gpu_hours_per_month", "used": spent, "limit": limit}
                    add_event(job_id, JobEvent.Kind.CANCEL_REQUESTED, message, data)
                    transaction.on_commit(partial(_cancel_running, str(job_id)))
                    stopped.append(str(job_id))
    return stopped


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
                now = timezone.now()
                updated = Job.objects.filter(pk=job.pk, state=JobState.QUEUED).update(
                    state=JobState.CANCELLED,
                    cancel_requested=True,
                    cancel_requested_at=now,
                    finished=now,
                )
                if updated:
                    _transition_event(
                        job.pk, JobState.QUEUED, JobState.CANCELLED, "cancelled", **who
                    )
                    break
            else:
                updated = Job.objects.filter(
                    pk=job.pk, state__in=ACTIVE_STATES, cancel_requested=False
                ).update(cancel_requested=True, cancel_requested_at=timezone.now())
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
