"""The new-job form follows the JobSpec; errors land beside their fields; live fragments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from accounts.models import Team
from jobs import services
from jobs.models import Dataset, Job, JobMetric, JobState
from jobs.spec import JobSpec
from tests.fixtures.accounts import MATH_ROWS, jsonl_bytes
from web.spec_form import SEP, SpecFields

pytestmark = pytest.mark.django_db


def _form_defaults(client: Client) -> dict[str, Any]:
    """The values a browser would post for the untouched form (initial values)."""
    from web.forms import JobForm

    form = JobForm(team=None)
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form[name].value()
        if name == "dataset_file" or value is None:
            continue
        if isinstance(value, bool):
            if value:
                data[name] = "on"
            continue
        data[name] = value
    return data


def test_it_builds_a_field_for_every_spec_setting() -> None:
    fields = SpecFields()
    schema = JobSpec.model_json_schema()
    for name in ("gpus", "smoke_steps", "steps", "full_finetune"):
        assert name in fields.fields
        assert fields.fields[name].help_text.startswith(schema["properties"][name]["description"])
    assert f"lora{SEP}rank" in fields.fields
    assert fields.fields[f"lora{SEP}rank"].initial == 16
    assert fields.fields[f"optimizer{SEP}betas"].initial == "[0.9, 0.95]"
    assert {s.key for s in fields.sections} >= {"general", "lora", "optimizer", "rollout"}


def test_it_submits_a_smoke_job_from_the_form_with_only_changed_settings(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
) -> None:
    client = login(owner)
    data = _form_defaults(client) | {"name": "from-form", "smoke_steps": "3"}
    response = client.post(reverse("web:job_new"), data)
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(name="from-form")
    assert response["Location"] == reverse("web:job_detail", args=[job.pk])
    assert job.team == team and job.created_by == owner and job.state == JobState.QUEUED
    assert job.spec["method"] == "smoke" and job.spec["smoke_steps"] == 3


def test_it_puts_spec_errors_beside_their_fields(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
    tiny_base_model: Any,
) -> None:
    client = login(owner)
    data = _form_defaults(client) | {
        "name": "bad",
        "method": "rl",
        "env": "math",
        "dataset": "builtin:arith_train",
        "lora__rank": "999",
    }
    response = client.post(reverse("web:job_new"), data)
    assert response.status_code == 200
    form = response.context["form"]
    assert "lora__rank" in form.errors and "max_lora_rank" in form.errors["lora__rank"][0]
    assert not Job.objects.filter(name="bad").exists()
    page = response.content.decode()
    assert 'id="id_lora__rank_errors"' in page

    response = client.post(reverse("web:job_new"), data | {"lora__rank": "16", "smoke_steps": "9"})
    assert "smoke_steps" in response.context["form"].errors

    response = client.post(reverse("web:job_new"), data | {"lora__rank": "16", "env": ""})
    assert "env" in response.context["form"].errors


def test_it_refuses_bad_json_in_a_structured_field(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
) -> None:
    client = login(owner)
    data = _form_defaults(client) | {"optimizer__betas": "[0.9,"}
    response = client.post(reverse("web:job_new"), data)
    assert response.status_code == 200
    assert "optimizer__betas" in response.context["form"].errors


def test_it_uploads_a_dataset_from_the_job_form_and_uses_it(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    data_dir: Any,
    team: Team,
    owner: Any,
    tiny_base_model: Any,
) -> None:
    client = login(owner)
    upload = SimpleUploadedFile("rows.jsonl", jsonl_bytes(MATH_ROWS))
    data = _form_defaults(client) | {
        "name": "with-upload",
        "method": "rl",
        "env": "math",
        "dataset": "__upload__",
        "dataset_name": "my-arith",
        "dataset_file": upload,
        "steps": "2",
    }
    response = client.post(reverse("web:job_new"), data)
    assert response.status_code == 302, response.context["form"].errors
    dataset = Dataset.objects.get(team=team, name="my-arith")
    assert dataset.rows == len(MATH_ROWS)
    assert Job.objects.get(name="with-upload").spec["dataset"] == dataset.ref
    # The name taken: said beside the name, which is what to change.
    data["dataset_file"] = SimpleUploadedFile("rows.jsonl", jsonl_bytes(MATH_ROWS))
    again = client.post(reverse("web:job_new"), data)
    assert again.status_code == 200
    assert "already has a dataset named" in again.context["form"].errors["dataset_name"][0]
    assert "dataset_file" not in again.context["form"].errors


def test_it_submits_from_yaml_and_reports_yaml_errors(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
) -> None:
    client = login(owner)
    url = reverse("web:job_new_yaml")
    response = client.post(
        url, {"name": "yaml-job", "spec_yaml": "method: smoke\nsmoke_steps: 2\n"}
    )
    assert response.status_code == 302
    assert Job.objects.get(name="yaml-job").spec["smoke_steps"] == 2

    response = client.post(url, {"spec_yaml": "method: [smoke"})
    assert "not valid YAML" in response.context["yaml_form"].errors["spec_yaml"][0]
    response = client.post(url, {"spec_yaml": "method: smoke\nwarp: 9\n"})
    assert "warp" in response.context["yaml_form"].errors["spec_yaml"][0]


def test_it_shows_quota_refusals(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    make_team: Callable[..., Team],
    owner: Any,
) -> None:
    small = make_team("small", (owner, "owner"), max_queued_jobs=1)
    submit(small, owner, "first")
    client = login(owner)
    response = client.post(reverse("web:job_new_yaml"), {"spec_yaml": "method: smoke"})
    assert response.status_code == 200
    assert "max_queued_jobs" in response.content.decode()


def test_it_serves_live_fragments_and_metrics(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    job = submit(team, owner, "live")
    JobMetric.objects.create(job=job, step=1, name="loss", value=2.0)
    JobMetric.objects.create(job=job, step=2, name="loss", value=1.5)
    JobMetric.objects.create(job=job, step=1, name="reward/mean", value=0.25)
    client = login(owner)
    rows = client.get(reverse("web:jobs"), HTTP_HX_REQUEST="true")
    assert rows.content.decode().lstrip().startswith("<tbody")
    assert 'hx-trigger="every' in rows.content.decode()
    assert "HX-Request" in rows["Vary"]
    status = client.get(reverse("web:job_detail", args=[job.pk]), HTTP_HX_REQUEST="true")
    assert 'id="job-status"' in status.content.decode() and "<html" not in status.content.decode()
    # A queued job says why it waits (the dispatcher's note), in the page and the API.
    services.note_waiting({job.pk: "waiting for 1 GPU (0 of 2 free)"})
    status = client.get(reverse("web:job_detail", args=[job.pk]), HTTP_HX_REQUEST="true")
    assert "Waiting for 1 GPU (0 of 2 free)" in status.content.decode()
    assert client.get(f"/api/v1/jobs/{job.pk}").json()["queue_note"].startswith("waiting for")
    metrics = client.get(reverse("web:job_metrics", args=[job.pk])).json()
    assert metrics["series"]["loss"] == [[1, 2.0], [2, 1.5]]
    assert metrics["order"][0] == "reward/mean" and metrics["final"] is False


def test_it_stops_polling_once_jobs_are_final(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    job = submit(team, owner, "done-soon")
    client = login(owner)
    client.post(reverse("web:job_cancel", args=[job.pk]))
    assert "hx-trigger" not in client.get(reverse("web:jobs")).content.decode()
    page = client.get(reverse("web:job_detail", args=[job.pk])).content.decode()
    assert "hx-trigger" not in page and "Cancel job" not in page
    response = client.post(reverse("web:job_cancel", args=[job.pk]), follow=True)
    assert "Cannot cancel" in response.content.decode()


def test_it_filters_and_searches_jobs(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    submit(team, owner, "alpha-run")
    beta = submit(team, owner, "beta-run")
    login(owner).post(reverse("web:job_cancel", args=[beta.pk]))
    client = login(owner)
    page = client.get(reverse("web:jobs"), {"q": "alpha"}).content.decode()
    assert "alpha-run" in page and "beta-run" not in page
    page = client.get(reverse("web:jobs"), {"state": "CANCELLED"}).content.decode()
    assert "beta-run" in page and "alpha-run" not in page
    page = client.get(reverse("web:jobs"), {"state": "active"}).content.decode()
    assert "alpha-run" in page and "beta-run" not in page
