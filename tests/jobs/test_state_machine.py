"""Every transition through jobs.services: conditional, evented, refusing illegal moves."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import FINAL_STATES, Job, JobEvent, JobMetric, JobState

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(team, owner) -> Job:
    return services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="j")


def states(job: Job) -> list[tuple[str, str]]:
    return list(
        JobEvent.objects.filter(job=job, kind=JobEvent.Kind.STATE).values_list(
            "from_state", "to_state"
        )
    )


def start(job: Job, node: str = "n1") -> None:
    assert services.mark_starting(job.pk, node=node, gpus=[f"{node}:0", f"{node}:1"], task_id="t")
    assert services.mark_running(job.pk, attempt=job.attempt)


def test_it_submits_a_normalised_queued_job_with_an_event(job, team, owner):
    assert job.state == JobState.QUEUED and job.attempt == 1
    assert job.spec["smoke_steps"] == 5 and job.spec_version == 1
    assert job.gpus_requested == 2 and job.priority == 50
    assert states(job) == [("", JobState.QUEUED)]


def test_it_runs_the_happy_path(job):
    start(job)
    assert services.heartbeat(job.pk, attempt=1, step=3)
    assert services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and job.finished is not None
    assert job.current_step == 3 and job.node == "n1" and job.celery_task_id == "t"
    assert states(job) == [
        ("", "QUEUED"),
        ("QUEUED", "STARTING"),
        ("STARTING", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]


def test_it_refuses_illegal_transitions(job):
    assert not services.mark_running(job.pk, attempt=1)  # QUEUED -> RUNNING
    assert not services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)  # QUEUED -> SUCCEEDED
    assert services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t")
    assert not services.mark_starting(job.pk, node="m", gpus=["m:0"], task_id="u")  # twice
    assert not services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)  # STARTING -> SUCC.
    assert services.mark_running(job.pk, attempt=1)
    assert services.finish_job(job.pk, JobState.FAILED, attempt=1, error_code="oom")
    for final in FINAL_STATES:  # nothing leaves a final state
        assert not services.finish_job(job.pk, final, attempt=1)
    assert not services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t")
    assert not services.requeue_job(job.pk, attempt=1, reason="x", max_attempts=3)
    assert not services.heartbeat(job.pk, attempt=1)
    with pytest.raises(ValueError):
        services.finish_job(job.pk, JobState.RUNNING, attempt=1)
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.error_code == "oom"
    assert len(states(job)) == 4


def test_it_ignores_a_stale_attempt(job):
    start(job)
    assert services.requeue_job(job.pk, attempt=1, reason="lease expired", max_attempts=3)
    job.refresh_from_db()
    assert job.state == JobState.QUEUED and job.attempt == 2
    assert job.gpus_held == [] and job.node == "" and job.celery_task_id == ""
    # The old runner wakes up: none of its calls may touch attempt 2.
    assert services.mark_starting(job.pk, node="n2", gpus=["n2:0", "n2:1"], task_id="t2")
    assert not services.mark_running(job.pk, attempt=1)
    assert not services.heartbeat(job.pk, attempt=1)
    assert not services.record_metrics(job.pk, 1, {"loss": 1.0}, attempt=1)
    assert not services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)
    assert services.mark_running(job.pk, attempt=2)
    assert services.finish_job(job.pk, JobState.SUCCEEDED, attempt=2)


def test_it_fails_a_job_after_max_attempts(job):
    for attempt in (1, 2):
        start(Job.objects.get(pk=job.pk))
        assert services.requeue_job(job.pk, attempt=attempt, reason="worker died", max_attempts=3)
    start(Job.objects.get(pk=job.pk))
    assert services.requeue_job(job.pk, attempt=3, reason="worker died", max_attempts=3)
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.attempt == 3
    assert job.error_code == "max_attempts" and "worker died" in job.error_message


def test_it_cancels_a_queued_job_at_once(job, owner):
    job = services.cancel_job(job, by=owner)
    assert job.state == JobState.CANCELLED and job.finished is not None
    assert not services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t")
    with pytest.raises(services.IllegalTransition, match="already CANCELLED"):
        services.cancel_job(job)


def test_it_cancels_a_running_job_cooperatively(job, owner, django_capture_on_commit_callbacks):
    start(job)
    with django_capture_on_commit_callbacks() as callbacks:
        job = services.cancel_job(job, by=owner)
    assert job.state == JobState.RUNNING and job.cancel_requested
    assert len(callbacks) == 1  # workers.control.cancel_running after commit
    assert services.cancel_job(job).cancel_requested  # idempotent
    assert JobEvent.objects.filter(job=job, kind=JobEvent.Kind.CANCEL_REQUESTED).count() == 1
    assert services.finish_job(job.pk, JobState.CANCELLED, attempt=1)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED


def test_it_cancels_instead_of_requeueing_when_cancel_was_requested(job):
    start(job)
    services.cancel_job(job)
    assert services.requeue_job(job.pk, attempt=1, reason="lease expired", max_attempts=3)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and job.attempt == 1


def test_it_charges_gpu_seconds_per_attempt(job):
    t0 = timezone.now()
    with mock.patch("django.utils.timezone.now", return_value=t0):
        start(job)
    with mock.patch("django.utils.timezone.now", return_value=t0 + timedelta(seconds=100)):
        assert services.requeue_job(job.pk, attempt=1, reason="x", max_attempts=3)
    with mock.patch("django.utils.timezone.now", return_value=t0 + timedelta(seconds=200)):
        start(Job.objects.get(pk=job.pk))
    with mock.patch("django.utils.timezone.now", return_value=t0 + timedelta(seconds=250)):
        assert services.finish_job(job.pk, JobState.SUCCEEDED, attempt=2)
    job.refresh_from_db()
    assert job.gpu_seconds == pytest.approx(2 * 100 + 2 * 50)


def test_it_upserts_metrics_per_step(job):
    start(job)
    assert services.record_metrics(job.pk, 1, {"loss": 2.0, "reward/mean": 0.1}, attempt=1)
    assert services.record_metrics(job.pk, 2, {"loss": 1.5}, attempt=1)
    assert services.record_metrics(job.pk, 1, {"loss": 1.9}, attempt=1)  # resumed run
    rows = sorted(JobMetric.objects.filter(job=job).values_list("step", "name", "value"))
    assert rows == [(1, "loss", 1.9), (1, "reward/mean", 0.1), (2, "loss", 1.5)]
    with pytest.raises(ValueError, match="finite"):
        services.record_metrics(job.pk, 3, {"loss": float("nan")}, attempt=1)
    with pytest.raises(ValueError):
        services.record_metrics(job.pk, -1, {"loss": 1.0}, attempt=1)


def test_it_adds_free_form_events(job):
    event = services.add_event(job.pk, "log", "hello", {"k": 1})
    assert (event.kind, event.message, event.data) == ("log", "hello", {"k": 1})


def test_it_lets_exactly_one_of_two_racing_transitions_win(job):
    start(job)
    # The reaper and the runner race: whichever updates first wins, the other sees False.
    won_finish = services.finish_job(job.pk, JobState.SUCCEEDED, attempt=1)
    won_requeue = services.requeue_job(job.pk, attempt=1, reason="lease expired", max_attempts=3)
    assert (won_finish, won_requeue) == (True, False)
