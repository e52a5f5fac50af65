"""Every endpoint, three callers: the owner and a teammate see the team's objects, an
outsider (member of another team only) gets 404 for each of them and never sees them in
a list."""

from __future__ import annotations

import pytest

from jobs import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def objects(team, owner, owner_key, make_dataset):
    job = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="secret-job")
    services.mark_starting(job.pk, node="n", gpus=["n:0"], task_id="t")
    services.mark_running(job.pk, attempt=1)
    services.record_metrics(job.pk, 1, {"loss": 1.0}, attempt=1)
    dataset = make_dataset(name="secret-data")
    return {"job": str(job.pk), "key": owner_key[0].pk, "team": team.slug, "dataset": dataset.pk}


# (method, path template, body) for every detail endpoint of another team's object.
DETAIL_ENDPOINTS = [
    ("get", "/api/v1/jobs/{job}", None),
    ("get", "/api/v1/jobs/{job}/events", None),
    ("get", "/api/v1/jobs/{job}/metrics", None),
    ("post", "/api/v1/jobs/{job}/cancel", None),
    ("get", "/api/v1/keys/{key}", None),
    ("post", "/api/v1/keys/{key}/rotate", {}),
    ("post", "/api/v1/keys/{key}/revoke", None),
    ("get", "/api/v1/teams/{team}", None),
    ("get", "/api/v1/quota?team={team}", None),
    ("get", "/api/v1/datasets/{dataset}", None),
    ("delete", "/api/v1/datasets/{dataset}", None),
]

LIST_ENDPOINTS = ["/api/v1/jobs", "/api/v1/keys", "/api/v1/teams", "/api/v1/datasets"]


@pytest.mark.parametrize("method, template, body", DETAIL_ENDPOINTS)
def test_it_answers_404_to_an_outsider(outsider_client, objects, method, template, body):
    response = getattr(outsider_client, method)(template.format(**objects), body, format="json")
    assert response.status_code == 404, response.content
    assert "detail" in response.json()


@pytest.mark.parametrize("method, template, body", DETAIL_ENDPOINTS)
def test_it_serves_a_teammate(teammate_client, objects, method, template, body):
    if template.endswith(("rotate", "revoke")):
        expected = 403  # visible to the teammate, but only its creator or an owner may act
    else:
        expected = 204 if method == "delete" else 200
    response = getattr(teammate_client, method)(template.format(**objects), body, format="json")
    assert response.status_code == expected, response.content


@pytest.mark.parametrize("method, template, body", DETAIL_ENDPOINTS)
def test_it_serves_the_owner(owner_client, objects, method, template, body):
    expected = 201 if template.endswith("rotate") else 204 if method == "delete" else 200
    response = getattr(owner_client, method)(template.format(**objects), body, format="json")
    assert response.status_code == expected, response.content


@pytest.mark.parametrize("path", LIST_ENDPOINTS)
def test_it_hides_other_teams_from_lists(outsider_client, teammate_client, objects, path):
    outsider_view = outsider_client.get(path).json()["results"]
    assert all(item.get("team", item.get("slug")) != "acme" for item in outsider_view)
    teammate_view = teammate_client.get(path).json()["results"]
    assert any(item.get("team", item.get("slug")) == "acme" for item in teammate_view)


def test_it_hides_other_teams_quota(outsider_client, objects):
    assert outsider_client.get("/api/v1/quota").json()["team"] == "globex"


def test_it_does_not_submit_into_another_team(outsider_client, objects):
    response = outsider_client.post(
        "/api/v1/jobs", {"spec": {"method": "smoke"}, "team": "acme"}, format="json"
    )
    assert response.status_code == 400 and "team" in response.json()
    response = outsider_client.post("/api/v1/keys", {"name": "x", "team": "acme"}, format="json")
    assert response.status_code == 400 and "team" in response.json()
