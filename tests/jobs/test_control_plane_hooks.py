"""jobs reaches the control plane only through what the workers app registered in jobs.hooks."""

from __future__ import annotations

from typing import Any

import pytest

from jobs import hooks, services
from jobs.models import Job, JobState

SMOKE = {"method": "smoke"}


def test_it_leaves_the_job_queued_when_no_control_plane_is_registered(
    monkeypatch: pytest.MonkeyPatch,
    team: Any,
    owner: Any,
    django_capture_on_commit_callbacks: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(hooks, "_control_plane", None)
    with django_capture_on_commit_callbacks(execute=True):
        job = services.submit_job(team=team, user=owner, spec=SMOKE, name="x")
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    assert "no control plane is registered" in caplog.text


def test_it_asks_the_registered_control_plane_to_dispatch_and_cancel(
    monkeypatch: pytest.MonkeyPatch, team: Any, owner: Any, django_capture_on_commit_callbacks: Any
) -> None:
    calls: list[str] = []
    plane = hooks.ControlPlane(
        dispatch=lambda: calls.append("dispatch"),
        cancel_running=lambda job_id: calls.append(f"cancel {job_id}"),
        max_block_size=lambda: 0,
    )
    monkeypatch.setattr(hooks, "_control_plane", plane)
    with django_capture_on_commit_callbacks(execute=True):
        job = services.submit_job(team=team, user=owner, spec=SMOKE, name="x")
    assert calls == ["dispatch"]
    assert services.mark_starting(job.pk, node="n", gpus=["0"], task_id="t")
    with django_capture_on_commit_callbacks(execute=True):
        services.cancel_job(job)
    assert calls == ["dispatch", f"cancel {job.pk}"]


def test_it_survives_a_failing_control_plane(
    monkeypatch: pytest.MonkeyPatch, team: Any, owner: Any, django_capture_on_commit_callbacks: Any
) -> None:
    def broken(*args: Any) -> None:
        raise ConnectionError("redis is down")

    plane = hooks.ControlPlane(dispatch=broken, cancel_running=broken, max_block_size=lambda: 0)
    monkeypatch.setattr(hooks, "_control_plane", plane)
    with django_capture_on_commit_callbacks(execute=True):
        job = services.submit_job(team=team, user=owner, spec=SMOKE, name="x")
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
