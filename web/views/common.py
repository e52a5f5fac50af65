"""Lookups every page shares: the current team, a job of the user's teams, quota bars."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from accounts.models import Quota, Team
from jobs import services
from jobs.models import Job
from web.teams import set_current_team, user_teams

M = TypeVar("M", bound=Model)


def team_job(request: HttpRequest, job_id: Any) -> Job:
    # Any team of the user, not only the current one: a link shared inside a team works
    # whichever team is selected; a job of a foreign team answers 404 like a missing one.
    return get_object_or_404(
        Job.objects.select_related("team", "created_by"),
        pk=job_id,
        team__in=user_teams(request.user),
    )


def acted_on(request: HttpRequest, queryset: QuerySet[M], pk: Any) -> M:
    """The object a button of a page acts on, from any team of the user, that team made the
    current one. The page may be a tab opened before a switch to another team in a second
    tab: its buttons still act on what it shows (a foreign object answers 404 like a missing
    one), and the page the action returns to is that object's team's."""
    obj = get_object_or_404(
        queryset.select_related("team"), pk=pk, team__in=user_teams(request.user)
    )
    set_current_team(request, obj.team)  # type: ignore[attr-defined]
    return obj


def no_team(request: HttpRequest) -> HttpResponse:
    return render(request, "web/no_team.html")


def usage_bars(team: Team) -> list[dict[str, Any]]:
    """The team's quota usage as progress bars (jobs list and team page)."""
    used = services.quota_usage(team)
    quota = Quota.objects.for_team(team)
    served = used["serving_gpu_hours_this_month"]
    shared = f"{served} h of it on the shared model workers (Tinker, /v1, samples)"
    bars = [
        ("GPUs in use", used["gpus_in_use"], quota.max_gpus, "", ""),
        ("Queued jobs", used["queued_jobs"], quota.max_queued_jobs, "", ""),
        (
            "GPU-hours this month",
            used["gpu_hours_this_month"],
            quota.gpu_hours_per_month,
            " h",
            shared if served else "",
        ),
    ]
    out = []
    for label, value, limit, unit, note in bars:
        pct = 100.0 if limit <= 0 else min(100.0, 100.0 * float(value) / float(limit))
        out.append(
            {
                "label": label,
                "value": value,
                "limit": limit,
                "unit": unit,
                "note": note,
                "percent": round(pct, 1),
                "high": pct >= 90,
            }
        )
    return out


def home(request: HttpRequest) -> HttpResponse:
    if request.user.is_authenticated:
        return redirect("web:jobs")
    return redirect("account_login")
