from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest

from .teams import current_team, user_teams


def web_context(request: HttpRequest) -> dict[str, Any]:
    """Team switcher data for the navigation bar (nothing for anonymous visitors)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"allow_signup": settings.OPENTINKER_ALLOW_SIGNUP}
    return {
        "current_team": current_team(request),
        "my_teams": list(user_teams(user)),
        "allow_signup": settings.OPENTINKER_ALLOW_SIGNUP,
    }
