"""The shared model workers' GPU time, written to the teams' monthly charges.

Jobs are charged as their attempts end (``services``); a model worker serves many teams at
once and adds what it timed for each (``tinker_api.worker.meter``) every few seconds.
"""

from __future__ import annotations

from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import F

from .models import ServingCharge
from .quotas import month_start

__all__ = ["charge_serving"]


def charge_serving(
    base_model: str,
    seconds: dict[int, float],
    requests: dict[int, int],
    now: datetime | None = None,
) -> None:
    """Add a model worker's GPU-seconds and the requests it ran per team to this month's
    rows. Increments, not writes: workers of other base models, or a second worker of this
    one, add to the same team's month at the same time."""
    month = month_start(now).date()
    for team_id in set(seconds) | set(requests):
        add = {
            "gpu_seconds": F("gpu_seconds") + float(seconds.get(team_id, 0.0)),
            "requests": F("requests") + int(requests.get(team_id, 0)),
        }
        rows = ServingCharge.objects.filter(team_id=team_id, month=month, base_model=base_model)
        if rows.update(**add):
            continue
        try:
            with transaction.atomic():
                ServingCharge.objects.create(
                    team_id=team_id,
                    month=month,
                    base_model=base_model,
                    gpu_seconds=float(seconds.get(team_id, 0.0)),
                    requests=int(requests.get(team_id, 0)),
                )
        except IntegrityError:
            # Another worker made the row first (or the team is gone: then nothing to charge).
            rows.update(**add)
