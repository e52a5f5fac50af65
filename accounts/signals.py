"""Every team gets a quota row, so submissions always have a row to lock."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_save
from django.dispatch import receiver

from .models import Quota, Team


@receiver(post_save, sender=Team)
def create_quota(sender: type[Team], instance: Team, created: bool, **kwargs: Any) -> None:
    if created:
        Quota.objects.get_or_create(team=instance)
