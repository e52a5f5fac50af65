"""A job's metric rows: written by its live attempt only, one transaction per batch of steps."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from uuid import UUID

from django.db import transaction

from .models import ACTIVE_STATES, Job, JobMetric

__all__ = ["check_metrics", "discard_metrics_after", "record_metric_steps", "record_metrics"]

JobId = UUID | str


def check_metrics(step: int, metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics of ``step`` as finite floats; ValueError names what cannot be stored."""
    if step < 0:
        raise ValueError("step must be >= 0")
    checked: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > 100:
            raise ValueError(f"metric name must be a non-empty string of <= 100 chars: {name!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is not finite: {value}")
        checked[name] = value
    return checked


def record_metrics(job_id: JobId, step: int, metrics: Mapping[str, float], *, attempt: int) -> bool:
    """Upsert metric values of ``step``; a resumed run overwrites what it logged before.
    False (nothing written) when ``attempt`` is not the job's live attempt."""
    return record_metric_steps(job_id, [(step, metrics)], attempt=attempt)


def record_metric_steps(
    job_id: JobId, steps: Iterable[tuple[int, Mapping[str, float]]], *, attempt: int
) -> bool:
    """Upsert the metrics of several steps in one transaction (a runner buffers a few steps
    between writes: one commit per step is most of a managed job's overhead on SQLite).
    A step given twice keeps its last values. False (nothing written) when ``attempt`` is not
    the job's live attempt."""
    latest: dict[tuple[int, str], JobMetric] = {}
    for step, metrics in steps:
        for name, value in check_metrics(step, metrics).items():
            latest[(step, name)] = JobMetric(job_id=job_id, step=step, name=name, value=value)
    if not latest:
        return True
    with transaction.atomic():
        live = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).exists()
        if not live:
            return False
        JobMetric.objects.bulk_create(
            list(latest.values()),
            update_conflicts=True,
            unique_fields=["job", "step", "name"],
            update_fields=["value"],
        )
    return True


def discard_metrics_after(job_id: JobId, step: int, *, attempt: int) -> int | None:
    """Delete the metrics of steps after ``step``: a run resumed from the checkpoint of
    ``step`` redoes them, and rows an earlier attempt wrote past it must not linger (or
    outlive it, should the new run log fewer names). None when ``attempt`` is not live."""
    with transaction.atomic():
        live = Job.objects.filter(pk=job_id, attempt=attempt, state__in=ACTIVE_STATES).exists()
        if not live:
            return None
        deleted, _ = JobMetric.objects.filter(job_id=job_id, step__gt=step).delete()
    return deleted
