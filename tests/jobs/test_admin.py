"""Job admin: read-only pages and a cancel action that goes through services.cancel_job."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from jobs import services
from jobs.models import Job, JobEvent, JobState

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.org", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_it_cancels_jobs_from_the_admin(admin_client_, team, owner):
    queued = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="q")
    done = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="d")
    services.cancel_job(done)
    assert admin_client_.get("/admin/jobs/job/").status_code == 200
    assert admin_client_.get(f"/admin/jobs/job/{queued.pk}/change/").status_code == 200
    assert admin_client_.get("/admin/jobs/jobmetric/").status_code == 200
    response = admin_client_.post(
        "/admin/jobs/job/",
        {"action": "cancel_selected", "_selected_action": [str(queued.pk), str(done.pk)]},
        follow=True,
    )
    assert response.status_code == 200
    assert "1 job(s); 1 already finished" in response.content.decode()
    assert Job.objects.get(pk=queued.pk).state == JobState.CANCELLED
    # The service wrote the transition event: the admin did not bypass it.
    assert JobEvent.objects.filter(job=queued, to_state=JobState.CANCELLED).exists()


def test_it_deletes_datasets_from_the_admin_only_through_the_service(
    admin_client_, make_dataset, team, owner, data_dir, django_capture_on_commit_callbacks
):
    from jobs.models import Dataset
    from tests.fixtures.accounts import leftovers

    free, busy = make_dataset(name="free"), make_dataset(name="busy")
    services.submit_job(
        team=team, user=owner, spec={"method": "rl", "env": "math", "dataset": "busy"}, name="r"
    )
    assert admin_client_.get("/admin/jobs/dataset/").status_code == 200
    page = admin_client_.get(f"/admin/jobs/dataset/{free.pk}/change/")
    assert page.status_code == 200 and b"deletelink" not in page.content
    # The stock delete (rows without their files) is not offered.
    assert admin_client_.get(f"/admin/jobs/dataset/{free.pk}/delete/").status_code == 403
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client_.post(
            "/admin/jobs/dataset/",
            {"action": "delete_through_service", "_selected_action": [str(free.pk), str(busy.pk)]},
            follow=True,
        )
    text = response.content.decode()
    assert "Deleted 1 dataset(s)." in text and "used by 1 unfinished job(s)" in text
    assert list(Dataset.objects.values_list("name", flat=True)) == ["busy"]
    assert leftovers(data_dir) == [busy.path]


def test_it_manages_base_models_in_the_admin(admin_client_):
    from jobs.models import BaseModel

    assert admin_client_.get("/admin/jobs/basemodel/").status_code == 200
    response = admin_client_.post(
        "/admin/jobs/basemodel/add/",
        {
            "name": "qwen-0-5b",
            "path": "/srv/models/qwen2.5-0.5b-instruct",
            "max_lora_rank": 128,
            "max_context": 4096,
            "enabled": "on",
            "description": "GPU nodes only",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    model = BaseModel.objects.get(name="qwen-0-5b")
    page = admin_client_.get(f"/admin/jobs/basemodel/{model.pk}/change/")
    assert page.status_code == 200 and b"/srv/models/qwen2.5-0.5b-instruct" in page.content
    # Names are what specs use: a duplicate is refused by the form.
    response = admin_client_.post(
        "/admin/jobs/basemodel/add/",
        {"name": "tiny", "path": "x", "max_lora_rank": 8, "max_context": 8},
    )
    assert response.status_code == 200 and BaseModel.objects.filter(name="tiny").count() == 1
