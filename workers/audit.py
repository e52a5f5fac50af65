"""Writes the ``GpuLeaseRecord`` audit rows. Failures are logged, never raised: Redis has
already decided, and a missing audit row must not stop a job or a release. Leases of services
(Tinker model workers) have no job row: their audit is the log line."""

from __future__ import annotations

import logging

from django.db import DatabaseError
from django.utils import timezone

from workers.locktable import Lease, is_job_id
from workers.models import GpuLeaseRecord

log = logging.getLogger(__name__)


def lease_acquired(lease: Lease, attempt: int) -> None:
    try:
        GpuLeaseRecord.objects.update_or_create(
            job_id=lease.job_id,
            attempt=attempt,
            defaults={
                "node": lease.node,
                "gpus": lease.gpu_ids,
                "outcome": GpuLeaseRecord.Outcome.HELD,
                "released": None,
            },
        )
    except DatabaseError:
        log.exception("could not record the lease of job %s", lease.job_id)


def lease_ended(job_id: str, attempt: int | None, outcome: str) -> None:
    """Close the open record of ``job_id`` (of ``attempt`` if given)."""
    if not is_job_id(job_id):
        log.info("the lease of %s ended: %s", job_id, outcome)
        return
    try:
        rows = GpuLeaseRecord.objects.filter(job_id=job_id, outcome=GpuLeaseRecord.Outcome.HELD)
        if attempt is not None:
            rows = rows.filter(attempt=attempt)
        rows.update(outcome=outcome, released=timezone.now())
    except DatabaseError:
        log.exception("could not close the lease record of job %s", job_id)
