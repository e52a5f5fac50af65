"""Which teams a request may see and act for."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

from .models import ApiKey, Membership, Team


def team_ids_for(request: Request) -> set[int]:
    """The key's team for key auth, the user's memberships for session auth, else nothing."""
    if isinstance(request.auth, ApiKey):
        return {request.auth.team_id}
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return set()
    return set(Membership.objects.filter(user=user).values_list("team_id", flat=True))


def resolve_team(request: Request, slug: str | None) -> Team:
    """The team a write acts for.

    A key acts for its own team. A session user names one with ``team`` (a slug) unless they
    belong to exactly one. Unknown and foreign teams get the same answer, so slugs of other
    teams cannot be probed.
    """
    if isinstance(request.auth, ApiKey):
        team = request.auth.team
        if slug and slug != team.slug:
            raise ValidationError({"team": [f"this API key belongs to team '{team.slug}'."]})
        return team
    teams = Team.objects.filter(pk__in=team_ids_for(request))
    if slug:
        team = teams.filter(slug=slug).first()
        if team is None:
            raise ValidationError({"team": [f"you are not a member of a team '{slug}'."]})
        return team
    found = list(teams[:2])
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValidationError({"team": ["you are not a member of any team."]})
    raise ValidationError({"team": ["you belong to several teams: name one (its slug)."]})
