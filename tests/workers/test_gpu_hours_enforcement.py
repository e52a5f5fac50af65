"""The monthly GPU-hours budget held by the dispatcher and the reaper, against the real lock
table, database and (last test) a real Celery worker: a queued job of a team whose month is
spent waits with a note saying so and starts once the quota is raised or the month turns; the
reaper stops such a team's running jobs the way a cancel does, with the reason on the job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import services
from jobs.models import GpuCharge, Job, JobEvent, JobState
from tests.fixtures.workers import wait_for
from workers import control
from workers.control import reap
from workers.dispatcher import dispatch_once
from workers.locktable import GpuLockTable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def table(transactional_db: None, clean_control_plane: Any) -> GpuLockTable:
    table = GpuLockTable(clean_control_plane)
    # A node without a worker: placed jobs stay STARTING until a test marks them running.
    table.announce("n", [0, 1, 2, 3], ttl=60)
    return table


def run_for(job_id: Any, minutes: float) -> None:
    """Mark a placed job RUNNING, as its runner would, started ``minutes`` ago."""
    assert services.mark_running(job_id, attempt=1)
    # Test setup only: the attempt has been running this long.
    Job.objects.filter(pk=job_id).update(started=timezone.now() - timedelta(minutes=minutes))


def submit(team: Any, user: Any, name: str, **spec: Any) -> Job:
    return services.submit_job(team=team, user=user, spec={"method": "smoke", **spec}, name=name)


def test_a_spent_month_holds_the_teams_queued_jobs_until_the_quota_allows(
    table: GpuLockTable, team: Any, owner: Any, other_team: Any, outsider: Any
) -> None:
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    first = submit(team, owner, "first")
    assert Job.objects.get(pk=first.pk).state == JobState.STARTING
    table.withdraw("n")
    waiting = submit(team, owner, "waiting")
    # The running attempt spends the month after the second job was accepted.
    run_for(first.pk, 61)
    others = submit(other_team, outsider, "others")
    table.refresh("n", ttl=60)

    assert dispatch_once(table) == [str(others.pk)]
    job = Job.objects.get(pk=waiting.pk)
    assert job.state == JobState.QUEUED and table.lease_of(str(waiting.pk)) is None
    note = (
        "the team has used 1.02 of its 1 GPU-hours this month (gpu_hours_per_month quota): "
        "its jobs start again when the quota is raised or the month ends"
    )
    assert job.queue_note == note
    # The same words in the API (which the CLI prints) and on the job's page.
    api = APIClient()
    api.force_authenticate(owner)
    assert api.get(f"/api/v1/jobs/{waiting.pk}").json()["queue_note"] == note
    page = Client()
    page.force_login(owner)
    status = page.get(reverse("web:job_detail", args=[waiting.pk]), HTTP_HX_REQUEST="true")
    assert "(gpu_hours_per_month quota)" in status.content.decode()

    # A raised quota: the reaper's next pass admits it.
    team.quota.gpu_hours_per_month = 5.0
    team.quota.save()
    assert str(waiting.pk) in reap()["admitted"]
    assert Job.objects.get(pk=waiting.pk).state == JobState.STARTING


def test_a_new_month_lets_the_teams_queued_jobs_start(
    table: GpuLockTable, team: Any, owner: Any
) -> None:
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    done = submit(team, owner, "done")
    table.withdraw("n")
    waiting = submit(team, owner, "waiting")
    run_for(done.pk, 61)
    assert services.finish_job(done.pk, JobState.SUCCEEDED, attempt=1)
    table.refresh("n", ttl=60)
    assert dispatch_once(table) == []
    assert "gpu_hours_per_month" in Job.objects.get(pk=waiting.pk).queue_note

    # The month turns: what was charged belongs to the month before.
    last_month = services.month_start() - timedelta(days=1)
    GpuCharge.objects.filter(team=team).update(month=services.month_start(last_month).date())
    assert dispatch_once(table) == [str(waiting.pk)]


def test_the_reaper_stops_the_running_jobs_of_a_team_past_its_month(
    table: GpuLockTable, team: Any, owner: Any, other_team: Any, outsider: Any
) -> None:
    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    over = submit(team, owner, "over", gpus=2)
    fine = submit(other_team, outsider, "fine")
    run_for(over.pk, 31)
    run_for(fine.pk, 31)

    outcome = reap()
    assert outcome["stopped_over_budget"] == [str(over.pk)]
    job = Job.objects.get(pk=over.pk)
    # Asked to stop as a cancel is: the runner's flag is set, it ends at its next step.
    assert job.state == JobState.RUNNING and job.cancel_requested
    assert control.is_cancel_requested(str(over.pk))
    why = (
        "stopped: the team has used 1.03 of its 1 GPU-hours this month (gpu_hours_per_month quota)"
    )
    assert (job.error_code, job.error_message) == ("gpu_hours_per_month", why)
    event = JobEvent.objects.get(job=over, kind=JobEvent.Kind.CANCEL_REQUESTED)
    assert event.message == why and event.data["quota"] == "gpu_hours_per_month"
    assert event.data["limit"] == 1.0 and event.data["used"] == pytest.approx(1.033, abs=1e-3)
    assert Job.objects.get(pk=fine.pk).cancel_requested is False
    # Asked once: the next pass leaves it to the cancel machinery.
    assert reap()["stopped_over_budget"] == []

    # Its runner does not stop within the grace period: the block is taken back all the same.
    assert control.enforce_cancel(str(over.pk))
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and table.lease_of(str(over.pk)) is None
    assert (job.error_code, job.error_message) == ("gpu_hours_per_month", why)
    assert JobEvent.objects.filter(job=over, to_state=JobState.CANCELLED, message=why).exists()
    billed = (job.cancel_requested_at - job.started).total_seconds() * 2
    assert job.gpu_seconds == pytest.approx(billed, abs=1e-3)

    # A user's cancel stays distinguishable: no error code.
    services.cancel_job(Job.objects.get(pk=fine.pk))
    assert control.enforce_cancel(str(fine.pk))
    assert Job.objects.values_list("state", "error_code").get(pk=fine.pk) == ("CANCELLED", "")


def test_a_running_job_stops_at_a_step_boundary_when_its_team_runs_out(
    celery_worker: Any, owner_client: APIClient, team: Any, clean_control_plane: Any
) -> None:
    # 3.6 GPU-seconds: a few steps of the smoke job.
    team.quota.gpu_hours_per_month = 0.001
    team.quota.save()
    response = owner_client.post(
        "/api/v1/jobs",
        {
            "name": "long",
            "spec": {"method": "smoke", "smoke_steps": 500, "smoke_step_seconds": 0.2},
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    job_id = str(response.json()["id"])
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=1).exists(), 45, "step 1")
    wait_for(lambda: job_id in reap()["stopped_over_budget"], 30, "the reaper to stop it")
    wait_for(lambda: Job.objects.get(pk=job_id).is_final, 15, "the job to end")

    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.CANCELLED, (job.error_message, celery_worker.log())
    assert job.error_code == "gpu_hours_per_month" and job.current_step < 500
    assert job.error_message.startswith("stopped: the team has used")
    table = GpuLockTable(clean_control_plane)
    wait_for(lambda: table.lease_of(job_id) is None, 10, "the GPUs to be released")
    body = owner_client.get(f"/api/v1/jobs/{job_id}").json()
    assert (body["state"], body["error_code"]) == ("CANCELLED", "gpu_hours_per_month")
    # And nothing more is accepted this month.
    again = owner_client.post(
        "/api/v1/jobs", {"name": "more", "spec": {"method": "smoke"}}, format="json"
    )
    assert again.status_code == 403 and again.json()["quota"] == "gpu_hours_per_month"
