"""Every team gets a quota row, so submissions always have a row to lock.

``accounts.teams.create_team`` makes the row itself; this covers teams made elsewhere (the
admin's add form, fixtures).
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_save
from django.dispatch import receiver

from .models import Team
from .teams import ensure_quota


@receiver(post_save, sender=Team)
def create_quota(sender: type[Team], instance: Team, created: bool, **kwargs: Any) -> None:
    if created:
        ensure_quota(instance)
