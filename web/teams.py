"""The team a signed-in user is looking at, kept in the session.

Every page reads its team through ``current_team`` (a form's post through ``page_team``, the
team the form was shown for); objects are looked up through querysets filtered by the user's
teams, so an id of a team the user is not in answers 404 like an unknown one.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import slug_re
from django.db.models import QuerySet
from django.http import Http404, HttpRequest

from accounts.models import Membership, Team

SESSION_KEY = "opentinker_team_id"


def user_teams(user: Any) -> QuerySet[Team]:
    if not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(memberships__user=user).order_by("name", "slug")


def member_team(user: Any, slug: str) -> Team | None:
    """The user's team of this slug. A posted value that is no slug names no team; one with
    a NUL would fail the query on PostgreSQL, whose text cannot hold it."""
    if not slug_re.match(slug):
        return None
    return user_teams(user).filter(slug=slug).first()


def current_team(request: HttpRequest) -> Team | None:
    """The session's team if the user still belongs to it, else their first team."""
    cached = getattr(request, "_opentinker_team", False)
    if cached is not False:
        return cached  # type: ignore[return-value]
    teams = user_teams(request.user)
    team = None
    team_id = request.session.get(SESSION_KEY)
    if team_id is not None:
        team = teams.filter(pk=team_id).first()
    if team is None:
        team = teams.first()
        if team is not None:
            request.session[SESSION_KEY] = team.pk
    request._opentinker_team = team  # type: ignore[attr-defined]
    return team


def set_current_team(request: HttpRequest, team: Team) -> None:
    request.session[SESSION_KEY] = team.pk
    request._opentinker_team = team  # type: ignore[attr-defined]


def role_in(team: Team, user: Any) -> str | None:
    return Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()


def is_owner(team: Team, user: Any) -> bool:
    return role_in(team, user) == Membership.Role.OWNER


def page_team(request: HttpRequest) -> Team | None:
    """The team a form was filled in for: the one its page named (a hidden ``team`` field),
    which becomes the current team, else the current one. A switch in another tab changes
    the session's team under an open page; without the field its form would then create a
    job, key, dataset or invitation in a team the page never showed."""
    slug = request.POST.get("team") if request.method == "POST" else None
    if not slug:
        return current_team(request)
    team = member_team(request.user, slug)
    if team is None:
        raise Http404("you are not a member of that team")
    set_current_team(request, team)
    return team
