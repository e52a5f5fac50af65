"""The reaper against the real lock table and database: expired leases end in a requeue, a
failure after the last attempt, or a cancel; leaseless active jobs are requeued too."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Job, JobState
from workers.control import reap
from workers.dispatcher import request_dispatch
from workers.locktable import GpuLockTable


@pytest.fixture
def table(transactional_db: None, clean_control_plane: Any) -> GpuLockTable:
    return GpuLockTable(clean_control_plane)


def place_on_ghost(table: GpuLockTable, team: Any, owner: Any) -> str:
    """Submit a job; it is placed on node 'ghost', whose worker never comes."""
    table.announce("ghost", [0, 1], ttl=60)
    job = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="ghosted")
    assert Job.objects.get(pk=job.pk).state == JobState.STARTING
    return str(job.pk)


def expire_now(table: GpuLockTable, job_id: str) -> None:
    lease = table.lease_of(job_id)
    assert lease is not None
    assert table.renew(lease, ttl=0.05) is not None
    time.sleep(0.1)


def test_it_requeues_then_fails_a_job_after_the_last_attempt(
    table: GpuLockTable, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_MAX_ATTEMPTS = 2
    job_id = place_on_ghost(table, team, owner)

    expire_now(table, job_id)
    result = reap()
    assert result["reclaimed"] == [job_id] and result["requeued"] == [job_id]
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.QUEUED and job.attempt == 2 and job.gpus_held == []
    # The node that let the lease lapse is out of placement until its worker speaks again.
    assert table.nodes()["ghost"]["alive"] is False

    table.refresh("ghost", ttl=60)
    assert request_dispatch() == [job_id]
    expire_now(table, job_id)
    reap()
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.FAILED and job.error_code == "max_attempts"
    assert "expired" in job.error_message
    assert table.snapshot()["nodes"]["ghost"]["held"] == {}


def test_it_ends_a_cancel_requested_job_whose_runner_vanished(
    table: GpuLockTable, team: Any, owner: Any
) -> None:
    job_id = place_on_ghost(table, team, owner)
    lease = table.lease_of(job_id)
    assert lease is not None and table.renew(lease, ttl=60, start=True)  # its runner started
    services.cancel_job(Job.objects.get(pk=job_id))
    job = Job.objects.get(pk=job_id)
    # A started runner must end the job itself, so the cancel left the lease alone.
    assert job.state == JobState.STARTING and job.cancel_requested
    assert table.lease_of(job_id) is not None

    expire_now(table, job_id)
    reap()
    assert Job.objects.get(pk=job_id).state == JobState.CANCELLED


def test_it_requeues_an_active_job_that_holds_no_lease(
    table: GpuLockTable, team: Any, owner: Any
) -> None:
    job_id = place_on_ghost(table, team, owner)
    table.release_job(job_id)  # as if Redis had lost its state
    reap()
    assert Job.objects.get(pk=job_id).state == JobState.STARTING  # not silent for long yet
    Job.objects.filter(pk=job_id).update(heartbeat=timezone.now() - timedelta(minutes=5))
    table.withdraw("ghost")
    reap()
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.QUEUED and job.attempt == 2


def test_it_reclaims_a_model_workers_lease_and_finishes_the_pass(
    table: GpuLockTable, team: Any, owner: Any, caplog: Any
) -> None:
    job_id = place_on_ghost(table, team, owner)
    # A Tinker model worker holds the ghost's other GPU under a holder that is not a job id.
    worker = table.allocate("tinker:tiny:e88948c5", 1, ttl=0.05)
    assert worker is not None and worker.node == "ghost" and not worker.is_job
    expire_now(table, job_id)
    table.announce("spare", [0], ttl=60)

    with caplog.at_level("WARNING", logger="workers.control"):
        result = reap()

    assert sorted(result["reclaimed"]) == sorted([job_id, "tinker:tiny:e88948c5"])
    assert result["requeued"] == [job_id]
    # The model worker's lease came first in the pass (it expired first); the job behind it
    # was still requeued and placed again on the live node.
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.STARTING and job.attempt == 2 and job.gpus_held == ["spare:0"]
    assert list(job.gpu_leases.values_list("attempt", "outcome").order_by("attempt")) == [
        (1, "reaped"),
        (2, "held"),
    ]
    assert table.lease_of("tinker:tiny:e88948c5") is None
    assert table.snapshot()["nodes"]["ghost"]["held"] == {}
    assert "tinker:tiny:e88948c5" in caplog.text and "stopped heartbeating" in caplog.text
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]
