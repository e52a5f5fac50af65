"""What a team has used against its quotas, and the refusals a submission over one meets.

Read-only: the checks that use these counts run in ``jobs.services`` under the team's quota
row lock, so that concurrent submissions cannot race past a limit.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db.models import Q, Sum
from django.utils import timezone

from accounts.models import Team

from .models import ACTIVE_STATES, Job, JobState

__all__ = [
    "GpuRequestTooLarge",
    "QuotaExceeded",
    "gpu_seconds_this_month",
    "gpus_in_use",
    "month_start",
    "quota_usage",
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
    for started, held, cancelled_at in jobs.filter(
        state__in=ACTIVE_STATES, started__isnull=False
    ).values_list("started", "gpus_held", "cancel_requested_at"):
        until = min(now, cancelled_at) if cancelled_at else now
        running += max(0.0, (until - started).total_seconds()) * len(held or [])
    return float(done) + running


def quota_usage(team: Team) -> dict[str, float | int]:
    return {
        "gpus_in_use": gpus_in_use(team.pk),
        "queued_jobs": Job.objects.filter(team=team, state=JobState.QUEUED).count(),
        "gpu_hours_this_month": round(gpu_seconds_this_month(team.pk) / 3600.0, 4),
    }
