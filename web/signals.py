"""A verified address joins the teams it was invited to; a user without a team gets one.

A personal team lets a newly signed-up user submit at once (with the default quota every
team gets); administrators lower that quota if they want. The writes are
``accounts.teams``'.
"""

from __future__ import annotations

from typing import Any

from allauth.account.signals import email_confirmed
from django.dispatch import receiver

from accounts import teams


@receiver(email_confirmed)
def on_email_confirmed(sender: Any, request: Any, email_address: Any, **kwargs: Any) -> None:
    user = email_address.user
    teams.accept_invitations(user, email_address.email)
    teams.create_personal_team(user)
