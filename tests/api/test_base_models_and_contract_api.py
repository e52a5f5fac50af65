"""GET /api/v1/base-models, and job submission errors from the base-model registry and the
environment contract, as an API client sees them."""

from __future__ import annotations

import pytest

from jobs.models import BaseModel, Job

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs"


def test_it_lists_enabled_base_models_to_any_member(outsider_client, owner_client):
    BaseModel.objects.create(
        name="qwen-0-5b", path="/srv/qwen", max_lora_rank=128, max_context=4096
    )
    BaseModel.objects.create(name="retired", path="/srv/old", enabled=False)
    for client in (outsider_client, owner_client):
        response = client.get("/api/v1/base-models")
        assert response.status_code == 200
        body = response.json()
        assert [m["name"] for m in body] == ["qwen-0-5b", "tiny", "tiny-vl"]
        assert body[0] == {
            "name": "qwen-0-5b",
            "max_lora_rank": 128,
            "max_context": 4096,
            "description": "",
        }


def test_it_hides_base_models_from_anonymous_callers(anon_client):
    assert anon_client.get("/api/v1/base-models").status_code in (401, 403)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "rl", "env": "math"}, "dataset"),
        ({"method": "rl", "env": "bandit", "dataset": "builtin:arith_train"}, "dataset"),
        ({"method": "rl", "env": "math", "dataset": "missing"}, "dataset"),
        ({"method": "rl", "env": "nope"}, "env"),
        ({"method": "sft"}, "env"),
        ({"method": "rl", "env": "bandit", "base_model": "nope"}, "base_model"),
    ],
)
def test_it_answers_400_naming_the_field(owner_client, spec, field):
    response = owner_client.post(JOBS, {"spec": spec}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["detail"] == "invalid job spec"
    assert [e["field"] for e in body["errors"]] == [field]
    assert body["errors"][0]["reason"]
    assert not Job.objects.exists()


def test_it_refuses_a_disabled_base_model(owner_client):
    BaseModel.objects.filter(name="tiny").update(enabled=False)
    response = owner_client.post(JOBS, {"spec": {"method": "rl", "env": "bandit"}}, format="json")
    assert response.status_code == 400
    assert "disabled" in response.json()["errors"][0]["reason"]
    # A smoke job loads no model and still runs.
    assert owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").status_code == 201


def test_it_accepts_generator_and_built_in_dataset_jobs(owner_client):
    for spec in (
        {"method": "rl", "env": "gomoku"},
        {"method": "rl", "env": "math_code", "dataset": "builtin:word_train"},
    ):
        response = owner_client.post(JOBS, {"spec": spec}, format="json")
        assert response.status_code == 201, response.json()
