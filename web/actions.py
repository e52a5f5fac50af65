"""Steps a page takes that span several services, kept out of the views.

Nothing here writes the ORM itself: it calls ``jobs.services``, ``jobs.datasets`` and
``accounts.teams`` and turns their outcomes into what a page shows (errors as
``[{field, reason}]``, mails to the people concerned).
"""

from __future__ import annotations

from typing import Any

from django.core.mail import send_mail

from accounts import teams
from accounts.models import Team
from jobs import services
from jobs.models import Job
from jobs.spec import SpecError


def submit(
    team: Team, user: Any, spec: dict[str, Any], name: str
) -> tuple[Job | None, list[dict[str, str]]]:
    """Submit through the services; errors come back as ``[{field, reason}]``."""
    try:
        job = services.submit_job(team=team, user=user, spec=spec, name=name)
    except SpecError as exc:
        return None, exc.errors
    except services.GpuRequestTooLarge as exc:
        return None, [{"field": exc.field, "reason": str(exc)}]
    except services.QuotaExceeded as exc:
        return None, [{"field": "", "reason": str(exc)}]
    return job, []


def invite_and_notify(
    team: Team, *, email: str, role: str, invited_by: Any, jobs_url: str, signup_url: str
) -> teams.Invited:
    """Invite ``email`` (``accounts.teams.invite``) and mail the address what happened."""
    invited = teams.invite(team, email=email, role=role, invited_by=invited_by)
    if invited.user is not None:
        if invited.joined:
            send_mail(
                f"[OpenTinker] You were added to team {team.name}",
                f"{invited_by} added you to team {team.name}. Open {jobs_url} to start.",
                None,
                [email.lower()],
            )
        return invited
    send_mail(
        f"[OpenTinker] Invitation to team {team.name}",
        f"{invited_by} invited you to team {team.name} on OpenTinker.\n"
        f"Sign up (or add this address to your account) and verify it: {signup_url}",
        None,
        [email.lower()],
    )
    return invited
