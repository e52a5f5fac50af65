"""What a team has used against its quotas, and the refusals a submission over one meets.

Read-only: the checks that use these counts run in ``jobs.services`` under the team's quota
row lock, so that concurrent submissions cannot race past a limit.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

from django.db.models import Sum
from django.utils import timezone

from accounts.models import Quota, Team

from .models import ACTIVE_STATES, GpuCharge, Job, JobState

__all__ = [
    "GpuRequestTooLarge",
    "QuotaExceeded",
    "attempt_charges",
    "gpu_hours_spent",
    "gpu_seconds_this_month",
    "gpus_in_use",
    "month_budget_note",
    "month_start",
    "quota_usage",
    "spent_budget_notes",
]


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
    """The job asks for more GPUs than the largest node has (or, a gang, than enough nodes
    have): it could never be placed. ``field`` names the spec field to blame."""

    def __init__(
        self, requested: int, largest: int, *, reason: str = "", field: str = "gpus"
    ) -> None:
        self.requested = requested
        self.largest = largest
        self.field = field
        super().__init__(
            reason or f"the job asks for {requested} GPUs but the largest node has {largest}"
        )


def month_start(now: datetime | None = None) -> datetime:
    now = now or timezone.now()
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _next_month(start: datetime) -> datetime:
    return (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )


def attempt_charges(
    started: datetime | None,
    gpus: int,
    now: datetime,
    cancel_requested_at: datetime | None = None,
) -> list[tuple[date, float]]:
    """The GPU-seconds of an attempt so far, split at the month boundaries (UTC) it crossed:
    ``[(first day of the month, seconds), ...]``, oldest first, without empty months.

    A cancelled attempt is billed up to the request: the time the runner takes to stop (or
    the canceller to take its GPUs back) is the service's, not the team's.
    """
    if started is None or gpus <= 0:
        return []
    until = min(now, cancel_requested_at) if cancel_requested_at else now
    charges: list[tuple[date, float]] = []
    start = started
    while start < until:
        boundary = _next_month(month_start(start))
        end = min(until, boundary)
        charges.append((month_start(start).date(), (end - start).total_seconds() * gpus))
        start = end
    return charges


def gpus_in_use(team_id: int) -> int:
    """GPUs held by the team's starting and running jobs, less those of jobs whose cancel
    was requested: those GPUs are no longer billed, and they go back to the pool within the
    cancel grace period (the lock table keeps them from being placed twice meanwhile)."""
    held = Job.objects.filter(
        team_id=team_id, state__in=ACTIVE_STATES, cancel_requested=False
    ).values_list("gpus_held", flat=True)
    return sum(len(g or []) for g in held)


def gpu_seconds_this_month(team_id: int, now: datetime | None = None) -> float:
    """GPU time charged this calendar month (UTC): the charges of ended attempts, plus the
    running attempts' time so far. An attempt across a month boundary is split there."""
    now = now or timezone.now()
    month = month_start(now).date()
    charged = GpuCharge.objects.filter(team_id=team_id, month=month).aggregate(
        total=Sum("gpu_seconds")
    )["total"]
    running = 0.0
    for started, held, cancelled_at in Job.objects.filter(
        team_id=team_id, state__in=ACTIVE_STATES, started__isnull=False
    ).values_list("started", "gpus_held", "cancel_requested_at"):
        for when, seconds in attempt_charges(started, len(held or []), now, cancelled_at):
            if when == month:
                running += seconds
    return float(charged or 0.0) + running


def gpu_hours_spent(quota: Quota, now: datetime | None = None) -> float | None:
    """The team's GPU-hours this month once they have reached ``gpu_hours_per_month``; None
    while some are left."""
    used = gpu_seconds_this_month(quota.team_id, now) / 3600.0
    return used if used >= quota.gpu_hours_per_month else None


def month_budget_note(used_hours: float, limit_hours: float) -> str:
    """Why a queued job of a team whose month of GPU-hours is spent does not start."""
    return (
        f"the team has used {round(used_hours, 2):g} of its {limit_hours:g} GPU-hours this "
        "month (gpu_hours_per_month quota): its jobs start again when the quota is raised "
        "or the month ends"
    )


def spent_budget_notes(team_ids: set[int], now: datetime | None = None) -> dict[int, str]:
    """``month_budget_note`` of each of these teams whose GPU-hours this month are spent."""
    notes: dict[int, str] = {}
    for quota in Quota.objects.filter(team_id__in=team_ids):
        used = gpu_hours_spent(quota, now)
        if used is not None:
            notes[quota.team_id] = month_budget_note(used, quota.gpu_hours_per_month)
    return notes


def quota_usage(team: Team) -> dict[str, float | int]:
    return {
        "gpus_in_use": gpus_in_use(team.pk),
        "queued_jobs": Job.objects.filter(team=team, state=JobState.QUEUED).count(),
        "gpu_hours_this_month": round(gpu_seconds_this_month(team.pk) / 3600.0, 4),
    }
