"""Teams and quota endpoints."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts.models import Quota
from jobs import services
from jobs.charge_services import charge_serving

pytestmark = pytest.mark.django_db


def test_it_lists_the_callers_teams_with_roles(owner_client, teammate_client):
    [team] = owner_client.get("/api/v1/teams").json()["results"]
    assert (team["slug"], team["role"]) == ("acme", "owner")
    [team] = teammate_client.get("/api/v1/teams").json()["results"]
    assert team["role"] == "member"
    assert owner_client.get("/api/v1/teams/acme").json()["name"] == "Acme"


def test_it_reports_quota_limits_and_usage(owner_client, team, owner):
    team.quota.max_queued_jobs = 7
    team.quota.save()
    services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="a")
    job = services.submit_job(team=team, user=owner, spec={"method": "smoke", "gpus": 2}, name="b")
    services.mark_starting(job.pk, node="n", gpus=["n:0", "n:1"], task_id="t")
    response = owner_client.get("/api/v1/quota")
    assert response.status_code == 200
    body = response.json()
    assert body["team"] == "acme"
    assert body["limits"]["max_queued_jobs"] == 7
    assert body["usage"]["queued_jobs"] == 1
    assert body["usage"]["gpus_in_use"] == 2
    assert body["usage"]["gpu_hours_this_month"] >= 0
    assert body["usage"]["serving_gpu_hours_this_month"] == 0

    charge_serving("tiny", {team.pk: 720.0}, {team.pk: 4})
    usage = owner_client.get("/api/v1/quota").json()["usage"]
    assert usage["serving_gpu_hours_this_month"] == 0.2
    assert usage["gpu_hours_this_month"] >= 0.2


def test_it_needs_a_team_for_session_users_with_several(make_team, owner, team):
    make_team("second", (owner, "member"))
    client = APIClient()
    client.force_login(owner)
    assert client.get("/api/v1/quota").status_code == 400
    assert client.get("/api/v1/quota", {"team": "second"}).json()["team"] == "second"


def test_it_reads_a_missing_quota_row_as_the_defaults_without_writing_it(owner_client, team):
    Quota.objects.filter(team=team).delete()
    response = owner_client.get("/api/v1/quota")
    assert response.status_code == 200
    assert response.json()["limits"] == Quota(team=team).limits()
    assert not Quota.objects.filter(team=team).exists()
