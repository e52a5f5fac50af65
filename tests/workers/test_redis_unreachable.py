"""With Redis unreachable, the API still takes jobs: stored QUEUED, dispatched once it is back."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db


def test_it_accepts_a_job_as_queued_while_redis_is_unreachable(
    owner_client: Any, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    # A port nothing listens on: the real control plane (node sizes, dispatch) fails to connect.
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    with django_capture_on_commit_callbacks(execute=True):
        response = owner_client.post(
            "/api/v1/jobs", {"spec": {"method": "smoke", "gpus": 1}}, format="json"
        )
    assert response.status_code == 201, response.content
    assert response.json()["state"] == JobState.QUEUED
    assert Job.objects.get(pk=response.json()["id"]).state == JobState.QUEUED
