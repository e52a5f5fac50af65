"""Quota enforcement at submission: queued jobs, GPUs, GPU-hours; and under concurrency."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from jobs import services
from jobs.models import Job, JobState
from jobs.spec import SpecError

pytestmark = pytest.mark.django_db

SMOKE = {"method": "smoke"}


def test_it_admits_up_to_max_queued_jobs(team, owner):
    team.quota.max_queued_jobs = 3
    team.quota.save()
    for _ in range(3):
        services.submit_job(team=team, user=owner, spec=SMOKE, name="q")
    with pytest.raises(services.QuotaExceeded) as exc:
        services.submit_job(team=team, user=owner, spec=SMOKE, name="q")
    assert (exc.value.quota, exc.value.limit, exc.value.current) == ("max_queued_jobs", 3, 3)
    assert exc.value.retryable
    # A job leaving the queue frees a slot.
    first = Job.objects.filter(team=team).first()
    services.cancel_job(first)
    services.submit_job(team=team, user=owner, spec=SMOKE, name="q")


def test_it_refuses_more_gpus_than_the_team_may_hold(team, owner):
    team.quota.max_gpus = 2
    team.quota.save()
    with pytest.raises(services.QuotaExceeded) as exc:
        services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 3}, name="g")
    assert exc.value.quota == "max_gpus" and not exc.value.retryable
    assert services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="g")


def test_it_refuses_when_this_months_gpu_hours_are_spent(team, owner):
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    job = services.submit_job(team=team, user=owner, spec=SMOKE, name="h")
    assert services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t")
    # Started 61 minutes ago on one GPU: the running attempt alone uses the hour up.
    Job.objects.filter(pk=job.pk).update(started=timezone.now() - timedelta(minutes=61))
    with pytest.raises(services.QuotaExceeded) as exc:
        services.submit_job(team=team, user=owner, spec=SMOKE, name="h")
    assert exc.value.quota == "gpu_hours_per_month" and exc.value.current > 1.0


def test_it_does_not_charge_last_months_jobs(team, owner):
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    job = services.submit_job(team=team, user=owner, spec=SMOKE, name="old")
    last_month = services.month_start() - timedelta(days=1)
    Job.objects.filter(pk=job.pk).update(
        state=JobState.SUCCEEDED, finished=last_month, gpu_seconds=10 * 3600
    )
    assert services.gpu_seconds_this_month(team.pk) == 0
    services.submit_job(team=team, user=owner, spec=SMOKE, name="new")


def test_it_validates_before_checking_quota(team, owner):
    with pytest.raises(SpecError):
        services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 0}, name="x")
    with pytest.raises(SpecError):
        services.submit_job(team=team, user=owner, spec=SMOKE, name="x", kind="deploy")
    assert not Job.objects.exists()


def test_it_refuses_jobs_larger_than_the_largest_node(team, owner, monkeypatch):
    # Stand-in for the GPU inventory kept by workers/ (not the thing under test here).
    monkeypatch.setattr(services, "largest_node_gpus", lambda: 4)
    with pytest.raises(services.GpuRequestTooLarge, match="largest node has 4"):
        services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 5}, name="x")
    services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 4}, name="x")


def test_it_dispatches_after_commit_only(team, owner, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        services.submit_job(team=team, user=owner, spec=SMOKE, name="x")
    assert len(callbacks) == 1
    team.quota.max_queued_jobs = 1
    team.quota.save()
    with (
        django_capture_on_commit_callbacks() as callbacks,
        pytest.raises(services.QuotaExceeded),
    ):
        services.submit_job(team=team, user=owner, spec=SMOKE, name="x")
    assert callbacks == []


def _race(team, owner, n: int = 50, limit: int = 5) -> list[str]:
    """``n`` threads, each with its own DB connection, submit at once against ``limit``."""
    team.quota.max_queued_jobs = limit
    team.quota.save()
    barrier = threading.Barrier(n)
    results: list[str] = []
    lock = threading.Lock()

    def submit() -> None:
        try:
            barrier.wait(timeout=30)
            try:
                services.submit_job(team=team, user=owner, spec=SMOKE, name="race")
                outcome = "admitted"
            except services.QuotaExceeded as exc:
                outcome = exc.quota
            except Exception as exc:  # surfaced in the caller's assertion
                outcome = f"error: {exc!r}"
            with lock:
                results.append(outcome)
        finally:
            # Each thread has its own connection; close it so the test DB can be dropped.
            connections.close_all()

    threads = [threading.Thread(target=submit) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_it_admits_exactly_the_quota_under_50_concurrent_submissions(team, owner):
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL for SELECT ... FOR UPDATE (set DATABASE_URL=postgres://...)")
    results = _race(team, owner)
    assert len(results) == 50
    assert results.count("admitted") == 5, results
    assert results.count("max_queued_jobs") == 45, results
    assert Job.objects.filter(team=team, state=JobState.QUEUED).count() == 5


@pytest.mark.django_db(transaction=True)
def test_it_admits_exactly_the_quota_under_concurrency_on_sqlite(team, owner):
    # SQLite ignores FOR UPDATE; correctness there comes from BEGIN IMMEDIATE (settings).
    if connection.vendor != "sqlite":
        pytest.skip("the SQLite variant of the PostgreSQL test above")
    results = _race(team, owner, n=20, limit=5)
    assert results.count("admitted") == 5, results
    assert results.count("max_queued_jobs") == 15, results
    assert Job.objects.filter(team=team, state=JobState.QUEUED).count() == 5


def test_it_keeps_a_job_queued_while_the_team_holds_max_gpus(team, owner):
    team.quota.max_gpus = 2
    team.quota.save()
    big = services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="a")
    small = services.submit_job(team=team, user=owner, spec=SMOKE, name="b")
    assert services.mark_starting(big.pk, node="n", gpus=["n:0", "n:1"], task_id="t1")
    assert services.gpus_in_use(team.pk) == 2
    assert not services.mark_starting(small.pk, node="n", gpus=["n:2"], task_id="t2")
    assert Job.objects.get(pk=small.pk).state == JobState.QUEUED
    assert Job.objects.get(pk=small.pk).queue_note == (
        "the team's jobs hold 2 of its 2 GPUs (max_gpus quota); this one needs 1"
    )
    assert services.mark_running(big.pk, attempt=1)
    assert services.finish_job(big.pk, JobState.SUCCEEDED, attempt=1)
    assert services.gpus_in_use(team.pk) == 0
    assert services.mark_starting(small.pk, node="n", gpus=["n:2"], task_id="t2")
