"""The jobs API: submit, list with filters and cursor pagination, retrieve, cancel, events,
metrics, and the error shapes (spec errors, quotas)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from jobs import services
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs"


def submit(client: APIClient, **body):
    body.setdefault("spec", {"method": "smoke"})
    return client.post(JOBS, body, format="json")


def test_it_submits_a_job(owner_client, team, owner):
    response = submit(owner_client, name="first", spec={"method": "smoke", "smoke_steps": 2})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "QUEUED" and body["team"] == "acme" and body["created_by"] == "olivia"
    assert body["spec"]["smoke_steps"] == 2 and body["spec"]["base_model"] == "tiny"
    job = Job.objects.get(pk=body["id"])
    assert job.team == team and job.created_by == owner and job.name == "first"


def test_it_names_invalid_spec_fields(owner_client):
    response = submit(owner_client, spec={"method": "smoke", "gpus": 0, "color": "red"})
    assert response.status_code == 400
    body = response.json()
    assert body["detail"] == "invalid job spec"
    assert {e["field"] for e in body["errors"]} == {"gpus", "color"}
    response = owner_client.post(JOBS, {"name": "x"}, format="json")
    assert response.status_code == 400 and "spec" in response.json()
    response = submit(owner_client, spec=["method"])
    assert response.status_code == 400 and "spec" in response.json()
    response = submit(owner_client, kind="deploy")
    assert response.status_code == 400 and "kind" in response.json()
    assert not Job.objects.exists()


MATH = {"method": "rl", "env": "math", "dataset": "builtin:arith_train", "steps": 1}


@pytest.mark.parametrize(
    "spec, field, reason",
    [
        (
            {**MATH, "env_config": {"max_tokens": "x", "system_prompt": 5}},
            "env_config.max_tokens",
            "valid integer",
        ),
        ({**MATH, "env_config": {"format_reward": "lots"}}, "env_config.format_reward", "number"),
        (
            {**MATH, "env": "math_code", "env_config": {"format_reward": [1]}},
            "env_config.format_reward",
            "number",
        ),
        (
            {"method": "rl", "env": "bandit", "env_config": {"n_arms": "x"}},
            "env_config.n_arms",
            "valid integer",
        ),
        (
            {"method": "rl", "env": "gomoku", "env_config": {"win_length": 9}},
            "env_config.win_length",
            "at most size",
        ),
        (
            {"method": "rl", "env": "geometry", "dataset": "builtin:geometry_train"}
            | {"base_model": "tiny-vl", "env_config": {"max_tokens": -1}},
            "env_config.max_tokens",
            "greater than or equal to 1",
        ),
        (
            {**MATH, "lora": {"target_modules": ["q_proj", "nope_proj"]}},
            "lora.target_modules",
            "no module named 'nope_proj'",
        ),
    ],
)
def test_it_refuses_bad_env_settings_and_lora_targets_at_submission(
    owner_client, tiny_base_model, spec, field, reason
):
    response = submit(owner_client, spec=spec)
    assert response.status_code == 400, response.json()
    body = response.json()
    assert body["detail"] == "invalid job spec"
    named = {e["field"]: e["reason"] for e in body["errors"]}
    assert field in named and reason in named[field], body
    assert not Job.objects.exists()


def test_it_accepts_lora_targets_the_base_model_has(owner_client, tiny_base_model):
    for targets in (["q_proj", "v_proj"], ["self_attn.o_proj", "lm_head"]):
        response = submit(owner_client, spec={**MATH, "lora": {"target_modules": targets}})
        assert response.status_code == 201, response.json()
        assert response.json()["spec"]["lora"]["target_modules"] == targets


def test_it_answers_429_naming_the_queue_quota(owner_client, team):
    team.quota.max_queued_jobs = 1
    team.quota.save()
    assert submit(owner_client).status_code == 201
    response = submit(owner_client)
    assert response.status_code == 429
    body = response.json()
    assert body["quota"] == "max_queued_jobs" and body["limit"] == 1
    assert "max_queued_jobs" in body["detail"]


def test_it_answers_403_naming_the_gpu_quota(owner_client, team):
    team.quota.max_gpus = 1
    team.quota.save()
    response = submit(owner_client, spec={"method": "smoke", "gpus": 2})
    assert response.status_code == 403
    assert response.json()["quota"] == "max_gpus"


def test_it_refuses_a_job_larger_than_any_node(owner_client, monkeypatch):
    monkeypatch.setattr(services, "largest_node_gpus", lambda: 2)
    response = submit(owner_client, spec={"method": "smoke", "gpus": 4})
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "gpus"
    assert "largest node has 2" in response.json()["errors"][0]["reason"]


def test_it_lets_a_session_user_pick_the_team(make_team, owner, team):
    make_team("second", (owner, "member"))
    client = APIClient()
    client.force_login(owner)
    response = submit(client)
    assert response.status_code == 400 and "team" in response.json()
    response = submit(client, team="second")
    assert response.status_code == 201 and response.json()["team"] == "second"
    response = submit(client, team="globex")
    assert response.status_code == 400 and "team" in response.json()


def test_it_uses_the_keys_team(owner_client, make_team, owner):
    make_team("second", (owner, "member"))
    assert submit(owner_client).json()["team"] == "acme"
    response = submit(owner_client, team="second")
    assert response.status_code == 400 and "team" in response.json()


def test_it_lists_newest_first_with_cursor_pages_and_filters(owner_client, teammate_client):
    ids = [submit(owner_client, name=f"run-{i}").json()["id"] for i in range(5)]
    mate = submit(teammate_client, name="mate-run").json()["id"]
    response = owner_client.get(JOBS, {"limit": 4})
    page = response.json()
    assert [j["id"] for j in page["results"]] == [mate, *ids[::-1][:3]]
    assert page["next"] and "cursor=" in page["next"]
    rest = owner_client.get(page["next"]).json()
    assert [j["id"] for j in rest["results"]] == ids[::-1][3:]
    assert rest["next"] is None
    by_creator = owner_client.get(JOBS, {"creator": "tariq"}).json()["results"]
    assert [j["id"] for j in by_creator] == [mate]
    by_name = owner_client.get(JOBS, {"name": "RUN-3"}).json()["results"]
    assert [j["id"] for j in by_name] == [ids[3]]
    services.cancel_job(Job.objects.get(pk=ids[0]))
    cancelled = owner_client.get(JOBS, {"state": "CANCELLED"}).json()["results"]
    assert [j["id"] for j in cancelled] == [ids[0]]
    assert owner_client.get(JOBS, {"state": "BOGUS"}).status_code == 400


def test_it_refuses_query_parameters_a_list_does_not_take(owner_client):
    # Ignored, a typo listed every job: a script cancelling "the RUNNING ones" cancels all.
    submit(owner_client)
    for params, names in [
        ({"status": "RUNNING"}, {"status"}),
        ({"ordering": "-name"}, {"ordering"}),
        ({"page": 2, "offset": 10, "state": "QUEUED"}, {"page", "offset"}),
    ]:
        response = owner_client.get(JOBS, params)
        assert response.status_code == 400, params
        body = response.json()
        assert set(body) == names
        assert all("unknown query parameter" in body[n][0] and "state" in body[n][0] for n in names)
    first = owner_client.get(JOBS, {"limit": 1, "state": "QUEUED", "format": "json"})
    assert first.status_code == 200


def test_its_events_and_metrics_refuse_query_parameters_they_do_not_take(owner_client):
    job_id = submit(owner_client).json()["id"]
    for path, params, name, takes in [
        ("events", {"limt": 5}, "limt", "limit"),
        ("metrics", {"names": "loss"}, "names", "since_step"),
        ("metrics", {"since": 3}, "since", "name"),
    ]:
        response = owner_client.get(f"{JOBS}/{job_id}/{path}", params)
        assert response.status_code == 400, (path, params)
        assert "unknown query parameter" in response.json()[name][0]
        assert takes in response.json()[name][0]
    assert owner_client.get(f"{JOBS}/{job_id}/events", {"limit": 5}).status_code == 200
    metrics = owner_client.get(f"{JOBS}/{job_id}/metrics", {"name": "loss", "since_step": 1})
    assert metrics.status_code == 200


def test_it_finds_one_job_by_its_id_whatever_the_query(owner_client):
    # The list's filters used to apply to one job too: a mismatch answered 404.
    job_id = submit(owner_client).json()["id"]
    assert owner_client.get(f"{JOBS}/{job_id}", {"state": "RUNNING"}).status_code == 200
    response = owner_client.post(f"{JOBS}/{job_id}/cancel?state=RUNNING")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"


def test_it_filters_jobs_by_team(make_team, owner, team, other_team):
    other = make_team("initech", (owner, "owner"))
    client = APIClient()
    client.force_authenticate(owner)
    mine = submit(client, team="acme").json()["id"]
    theirs = submit(client, team="initech").json()["id"]
    assert [j["id"] for j in client.get(JOBS, {"team": "acme"}).json()["results"]] == [mine]
    assert [j["id"] for j in client.get(JOBS, {"team": other.slug}).json()["results"]] == [theirs]
    assert client.get(JOBS, {"team": "globex"}).json()["results"] == []


def test_it_cancels_and_refuses_to_cancel_twice(owner_client):
    job_id = submit(owner_client).json()["id"]
    response = owner_client.post(f"{JOBS}/{job_id}/cancel")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"
    response = owner_client.post(f"{JOBS}/{job_id}/cancel")
    assert response.status_code == 409
    assert "already CANCELLED" in response.json()["detail"]


def test_it_requests_cancel_of_a_running_job(owner_client):
    job_id = submit(owner_client).json()["id"]
    services.mark_starting(job_id, node="n", gpus=["n:0"], task_id="t")
    services.mark_running(job_id, attempt=1)
    response = owner_client.post(f"{JOBS}/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json()["state"] == "RUNNING" and response.json()["cancel_requested"]


def test_it_returns_events_oldest_first(owner_client):
    job_id = submit(owner_client).json()["id"]
    services.mark_starting(job_id, node="n", gpus=["n:0"], task_id="t")
    services.add_event(job_id, "log", "hello")
    response = owner_client.get(f"{JOBS}/{job_id}/events")
    assert response.status_code == 200
    events = response.json()["results"]
    assert [(e["kind"], e["to_state"]) for e in events] == [
        ("state", "QUEUED"),
        ("state", "STARTING"),
        ("log", ""),
    ]


def test_it_returns_metrics_as_series_by_name(owner_client):
    job_id = submit(owner_client).json()["id"]
    services.mark_starting(job_id, node="n", gpus=["n:0"], task_id="t")
    services.mark_running(job_id, attempt=1)
    for step in (2, 1, 3):
        services.record_metrics(
            job_id, step, {"reward/mean": step / 10, "loss": 1.0 / step}, attempt=1
        )
    response = owner_client.get(f"{JOBS}/{job_id}/metrics")
    assert response.status_code == 200
    series = response.json()["series"]
    assert series["reward/mean"] == [[1, 0.1], [2, 0.2], [3, 0.3]]
    assert [s for s, _ in series["loss"]] == [1, 2, 3]
    only = owner_client.get(f"{JOBS}/{job_id}/metrics", {"name": "loss", "since_step": 2})
    assert only.json()["series"] == {"loss": [[2, 0.5], [3, 1.0 / 3]]}
    bad = owner_client.get(f"{JOBS}/{job_id}/metrics", {"since_step": "x"})
    assert bad.status_code == 400 and "since_step" in bad.json()


def test_it_refuses_a_metric_name_with_a_nul(owner_client):
    # PostgreSQL cannot hold a NUL in text: the filter on it was a 500 there.
    job_id = submit(owner_client).json()["id"]
    response = owner_client.get(f"{JOBS}/{job_id}/metrics", {"name": ["loss", "a\x00b"]})
    assert response.status_code == 400
    assert response.json() == {"name": ["Null characters are not allowed."]}


def test_it_answers_404_for_unknown_and_malformed_ids(owner_client):
    assert owner_client.get(f"{JOBS}/00000000-0000-0000-0000-000000000000").status_code == 404
    response = owner_client.get(f"{JOBS}/not-a-uuid")
    assert response.status_code == 404 and "detail" in response.json()


def test_it_requires_authentication(anon_client):
    assert anon_client.get(JOBS).status_code == 401
    assert anon_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").status_code == 401


def test_it_counts_the_job_state_machine_only_through_services(owner_client):
    # The API exposes no way to write state: PATCH/PUT/DELETE are not routed.
    job_id = submit(owner_client).json()["id"]
    for method in ("patch", "put", "delete"):
        response = getattr(owner_client, method)(
            f"{JOBS}/{job_id}", {"state": "SUCCEEDED"}, format="json"
        )
        assert response.status_code == 405
    assert Job.objects.get(pk=job_id).state == JobState.QUEUED
