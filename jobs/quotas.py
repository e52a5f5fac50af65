"""What a team has used against its quotas, and the refusals a submission over one meets.

Read-only: the checks that use these counts run in ``jobs.services`` under the team's quota
row lock, so that concurrent submissions cannot race past a limit.
"""

from __future__ import annotations

import time
from datetime import UTC, date, datetime

from django.db.models import Sum
from django.utils import timezone

from accounts.models import Quota, Team

from .models import ACTIVE_STATES, GpuCharge, Job, JobState, ServingCharge

__all__ = [
    "BudgetSpent",
    "GpuRequestTooLarge",
    "QuotaExceeded",
    "attempt_charges",
    "check_month_budget",
    "forget_recent_usage",
    "gpu_hours_spent",
    "gpu_seconds_this_month",
    "gpus_in_use",
    "month_budget_note",
    "month_start",
    "quota_usage",
    "serving_seconds",
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


class BudgetSpent(Exception):
    """The team's GPU-hours this month are spent: requests that would run on the model
    workers (sampling, forward/backward, optimizer steps) are refused."""

    quota = "gpu_hours_per_month"

    def __init__(self, used_hours: float, limit_hours: float, seconds_left: float) -> None:
        self.used_hours = used_hours
        self.limit_hours = limit_hours
        # Until the month turns (UTC), when the budget starts again.
        self.seconds_left = seconds_left
        super().__init__(
            f"the team has used {round(used_hours, 2):g} of its {limit_hours:g} GPU-hours this "
            "month (gpu_hours_per_month quota): requests that run on the model workers are "
            "refused until the quota is raised or the month ends"
        )


# Every request to the model workers checks its team's month. The usage behind the check (three
# aggregate queries, several times the rest of a request's) is reused this long in a process;
# the limit is read each time, so a raised quota lets the team on at once. The model workers
# add their time every OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS, so the usage is that late anyway.
USAGE_REUSE_SECONDS = 2.0
# (team, month) -> (reusable until, GPU-seconds). Expired entries go once it holds this many,
# so that a long-lived process does not keep every team's every month.
USAGE_REUSE_ENTRIES = 1024
_recent_usage: dict[tuple[int, date], tuple[float, float]] = {}


def check_month_budget(team_id: int, now: datetime | None = None) -> None:
    """Raise ``BudgetSpent`` once the team's GPU-hours this month are spent (at ``now``:
    then the usage is counted afresh)."""
    at = now or timezone.now()
    quota = Quota.objects.filter(team_id=team_id).first() or Quota(team_id=team_id)
    key = (team_id, month_start(at).date())
    recent = _recent_usage.get(key)
    if now is not None or recent is None or recent[0] < time.monotonic():
        seconds = gpu_seconds_this_month(team_id, at)
        if len(_recent_usage) >= USAGE_REUSE_ENTRIES:
            _forget_expired_usage()
        _recent_usage[key] = (time.monotonic() + USAGE_REUSE_SECONDS, seconds)
    else:
        seconds = recent[1]
    used = seconds / 3600.0
    if used >= quota.gpu_hours_per_month:
        left = (_next_month(month_start(at)) - at).total_seconds()
        raise BudgetSpent(used, quota.gpu_hours_per_month, left)


def _forget_expired_usage() -> None:
    clock = time.monotonic()
    # A copy first: another thread of the process may add to it meanwhile.
    for key, (until, _seconds) in list(_recent_usage.items()):
        if until < clock:
            _recent_usage.pop(key, None)
    if len(_recent_usage) >= USAGE_REUSE_ENTRIES:
        # That many teams checked within the reuse period: count them all afresh.
        _recent_usage.clear()


def forget_recent_usage() -> None:
    """Count every team's usage afresh at its next check."""
    _recent_usage.clear()


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
    running attempts' time so far, plus the model workers' time on the team's requests
    (``ServingCharge``). An attempt across a month boundary is split there."""
    now = now or timezone.now()
    month = month_start(now).date()
    charged = GpuCharge.objects.filter(team_id=team_id, month=month).aggregate(
        total=Sum("gpu_seconds")
    )["total"]
    served = serving_seconds(team_id, month)
    running = 0.0
    for started, held, cancelled_at in Job.objects.filter(
        team_id=team_id, state__in=ACTIVE_STATES, started__isnull=False
    ).values_list("started", "gpus_held", "cancel_requested_at"):
        for when, seconds in attempt_charges(started, len(held or []), now, cancelled_at):
            if when == month:
                running += seconds
    return float(charged or 0.0) + served + running


def serving_seconds(team_id: int, month: date) -> float:
    total = ServingCharge.objects.filter(team_id=team_id, month=month).aggregate(
        total=Sum("gpu_seconds")
    )["total"]
    return float(total or 0.0)


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
        "serving_gpu_hours_this_month": round(
            serving_seconds(team.pk, month_start().date()) / 3600.0, 4
        ),
    }
