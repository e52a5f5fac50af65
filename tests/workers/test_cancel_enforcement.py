"""A cancelled job whose runner does not stop within the grace period loses its GPUs anyway:
the canceller ends it CANCELLED and frees the block, and billing stops at the request."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Job, JobState
from workers import conf, control
from workers.locktable import GpuLockTable


@pytest.fixture
def running_job(transactional_db: None, clean_control_plane: Any, team: Any, owner: Any):
    """A job placed on a node without a worker, marked RUNNING as its runner would: a runner
    stuck inside a long step."""
    table = GpuLockTable(clean_control_plane)
    table.announce("stuck", [0, 1], ttl=60)
    job = services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="s")
    lease = table.lease_of(str(job.pk))
    assert lease is not None
    assert table.renew(lease, conf.lease_seconds(), start=True) is not None
    assert services.mark_running(job.pk, attempt=1)
    return Job.objects.get(pk=job.pk), table


def test_it_takes_the_gpus_back_from_a_runner_that_does_not_stop(running_job: Any) -> None:
    job, table = running_job
    services.cancel_job(job)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.cancel_requested_at is not None
    assert control.enforce_cancel(str(job.pk))
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert table.lease_of(str(job.pk)) is None
    # Billed from the start to the request (2 GPUs), not to the enforcement.
    billed = (job.cancel_requested_at - job.started).total_seconds() * 2
    assert job.gpu_seconds == pytest.approx(billed, abs=1e-3)
    # Nothing left to do a second time.
    assert not control.enforce_cancel(str(job.pk))


def test_it_leaves_a_job_alone_that_nobody_cancelled(running_job: Any) -> None:
    job, table = running_job
    assert not control.enforce_cancel(str(job.pk))
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    assert table.lease_of(str(job.pk)) is not None


def test_the_reaper_enforces_a_cancel_whose_deadline_passed(running_job: Any) -> None:
    job, table = running_job
    services.cancel_job(job)
    long_ago = timezone.now() - timedelta(seconds=4 * control.CANCEL_GRACE_SECONDS)
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=long_ago)
    outcome = control.reap()
    assert str(job.pk) in outcome["requeued"]
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    assert table.lease_of(str(job.pk)) is None
