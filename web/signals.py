"""A verified address joins the teams it was invited to; a user without a team gets one.

A personal team lets a newly signed-up user submit at once (with the default quota that the
``accounts`` signals attach to every team); administrators lower that quota if they want.
"""

from __future__ import annotations

from typing import Any

from allauth.account.signals import email_confirmed
from django.db import IntegrityError, transaction
from django.dispatch import receiver
from django.utils import timezone
from django.utils.text import slugify

from accounts.models import Membership, Team

from .models import Invitation


def accept_invitations(user: Any, email: str) -> int:
    joined = 0
    for invite in Invitation.objects.filter(email__iexact=email, accepted__isnull=True):
        with transaction.atomic():
            _, created = Membership.objects.get_or_create(
                user=user, team=invite.team, defaults={"role": invite.role}
            )
            invite.accepted = timezone.now()
            invite.save(update_fields=["accepted"])
        joined += int(created)
    return joined


def ensure_personal_team(user: Any) -> Team | None:
    if Membership.objects.filter(user=user).exists():
        return None
    base = slugify(user.get_username())[:40] or "team"
    for n in range(50):
        slug = base if n == 0 else f"{base}-{n}"
        try:
            with transaction.atomic():
                team = Team.objects.create(name=user.get_username(), slug=slug)
                Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
            return team
        except IntegrityError:
            continue
    return None


@receiver(email_confirmed)
def on_email_confirmed(sender: Any, request: Any, email_address: Any, **kwargs: Any) -> None:
    user = email_address.user
    accept_invitations(user, email_address.email)
    ensure_personal_team(user)
