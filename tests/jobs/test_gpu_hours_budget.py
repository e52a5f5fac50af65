"""The monthly GPU-hours budget beyond submission: a queued job of a team whose month is spent
does not start, an attempt across a month boundary is charged to each month its share, and a
job whose cancel was requested no longer holds the team's ``max_gpus`` back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import GpuCharge, Job, JobState

pytestmark = pytest.mark.django_db

SMOKE = {"method": "smoke"}


def start(job: Job, *, gpus: int = 1, minutes_ago: float = 0) -> None:
    """Place and run ``job`` as the dispatcher and its runner would, started that long ago."""
    held = [f"n:{i}" for i in range(gpus)]
    assert services.mark_starting(job.pk, node="n", gpus=held, task_id=f"t-{job.pk}")
    assert services.mark_running(job.pk, attempt=1)
    if minutes_ago:
        # Test setup only: the attempt has been running this long.
        started = timezone.now() - timedelta(minutes=minutes_ago)
        Job.objects.filter(pk=job.pk).update(started=started)


def test_it_keeps_a_queued_job_waiting_once_the_teams_month_is_spent(team, owner):
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    running = services.submit_job(team=team, user=owner, spec=SMOKE, name="long")
    queued = services.submit_job(team=team, user=owner, spec=SMOKE, name="next")
    # Accepted while the month had time left; the running attempt has spent it since.
    start(running, minutes_ago=61)

    assert not services.mark_starting(queued.pk, node="n", gpus=["n:1"], task_id="t")
    job = Job.objects.get(pk=queued.pk)
    assert job.state == JobState.QUEUED and job.gpus_held == []
    assert job.queue_note.startswith("the team has used 1.02 of its 1 GPU-hours this month")
    assert "(gpu_hours_per_month quota)" in job.queue_note

    team.quota.gpu_hours_per_month = 2.0
    team.quota.save()
    assert services.mark_starting(queued.pk, node="n", gpus=["n:1"], task_id="t")
    assert Job.objects.get(pk=queued.pk).queue_note == ""


def test_it_splits_an_attempt_across_a_month_boundary(team, owner):
    job = services.submit_job(team=team, user=owner, spec=SMOKE, name="long")
    month = services.month_start()
    into_month = (timezone.now() - month).total_seconds()
    # Started an hour before this month began, on 2 GPUs.
    start(job, gpus=2)
    Job.objects.filter(pk=job.pk).update(started=month - timedelta(hours=1))

    # While it runs, this month sees only its share since the 1st.
    assert services.gpu_seconds_this_month(team.pk) == pytest.approx(2 * into_month, abs=5)
    last_month = month - timedelta(minutes=1)
    assert services.gpu_seconds_this_month(team.pk, now=last_month) == pytest.approx(
        2 * 3540, abs=1
    )

    assert services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)
    charges = list(GpuCharge.objects.filter(job=job).order_by("month"))
    assert [c.month for c in charges] == [
        services.month_start(last_month).date(),
        month.date(),
    ]
    assert charges[0].gpu_seconds == pytest.approx(2 * 3600)
    assert charges[1].gpu_seconds == pytest.approx(2 * into_month, abs=5)
    job.refresh_from_db()
    assert job.gpu_seconds == pytest.approx(sum(c.gpu_seconds for c in charges))
    assert services.gpu_seconds_this_month(team.pk) == pytest.approx(charges[1].gpu_seconds)
    assert services.gpu_seconds_this_month(team.pk, now=last_month) == pytest.approx(2 * 3600)


def test_an_earlier_attempt_stays_charged_to_its_own_month(team, owner):
    job = services.submit_job(team=team, user=owner, spec=SMOKE, name="requeued")
    start(job)
    assert services.requeue_job(job.pk, attempt=1, reason="lease expired", max_attempts=3)
    # Test setup only: the first attempt ended last month.
    last_month = services.month_start() - timedelta(days=1)
    GpuCharge.objects.filter(job=job).update(
        month=services.month_start(last_month).date(), gpu_seconds=10 * 3600
    )
    Job.objects.filter(pk=job.pk).update(gpu_seconds=10 * 3600)
    assert services.gpu_seconds_this_month(team.pk) == 0
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    # The second attempt of the job starts: last month's hours do not count against this one.
    assert services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t2")


def test_a_job_whose_cancel_was_requested_no_longer_holds_max_gpus(team, owner):
    team.quota.max_gpus = 2
    team.quota.save()
    big = services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="a")
    small = services.submit_job(team=team, user=owner, spec=SMOKE, name="b")
    start(big, gpus=2)
    assert not services.mark_starting(small.pk, node="n", gpus=["n:2"], task_id="t2")

    services.cancel_job(big)
    big.refresh_from_db()
    # Still RUNNING (its runner stops at its next step) and still on its GPUs, which the lock
    # table keeps from anyone else; they are no longer billed, nor counted as the team's.
    assert big.state == JobState.RUNNING and big.cancel_requested and len(big.gpus_held) == 2
    assert services.gpus_in_use(team.pk) == 0
    assert services.mark_starting(small.pk, node="n", gpus=["n:2"], task_id="t2")
