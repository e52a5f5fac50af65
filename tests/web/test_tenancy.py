"""A user sees only their teams' jobs, keys and datasets, through every page."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import Team
from jobs.models import Dataset, Job, JobState

pytestmark = pytest.mark.django_db


def test_it_lists_only_the_current_teams_jobs(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    other_team: Team,
    owner: Any,
    outsider: Any,
) -> None:
    submit(team, owner, "ours-alpha")
    submit(other_team, outsider, "theirs-beta")
    page = login(owner).get(reverse("web:jobs")).content.decode()
    assert "ours-alpha" in page
    assert "theirs-beta" not in page
    page = login(outsider).get(reverse("web:jobs")).content.decode()
    assert "theirs-beta" in page and "ours-alpha" not in page


@pytest.mark.parametrize("name", ["web:job_detail", "web:job_metrics", "web:job_cancel"])
def test_it_answers_404_for_another_teams_job(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    other_team: Team,
    owner: Any,
    outsider: Any,
    name: str,
) -> None:
    job = submit(team, owner, "secret-job")
    url = reverse(name, args=[job.pk])
    assert login(outsider).get(url).status_code == 404
    assert login(outsider).post(url).status_code == 404
    job.refresh_from_db()
    assert job.state == JobState.QUEUED
    assert login(owner).get(url).status_code == 200


def test_it_lets_a_teammate_open_and_cancel_a_job(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
    teammate: Any,
) -> None:
    job = submit(team, owner, "shared")
    client = login(teammate)
    assert "shared" in client.get(reverse("web:job_detail", args=[job.pk])).content.decode()
    response = client.post(reverse("web:job_cancel", args=[job.pk]))
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED


def test_it_hides_and_protects_another_teams_keys(
    login: Callable[[Any], Client],
    team: Team,
    other_team: Team,
    owner_key: Any,
    outsider_key: Any,
    outsider: Any,
) -> None:
    key, _ = owner_key
    client = login(outsider)
    page = client.get(reverse("web:keys")).content.decode()
    assert key.display_prefix not in page
    assert outsider_key[0].display_prefix in page
    for name in ("web:key_revoke", "web:key_rotate"):
        assert client.post(reverse(name, args=[key.pk])).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None and key.rotated_to_id is None


def test_it_hides_and_protects_another_teams_datasets(
    login: Callable[[Any], Client],
    make_dataset: Callable[..., Dataset],
    other_team: Team,
    outsider: Any,
    owner: Any,
) -> None:
    ours = make_dataset("our-arith")
    client = login(outsider)
    assert "our-arith" not in client.get(reverse("web:datasets")).content.decode()
    assert "our-arith" not in client.get(reverse("web:job_new")).content.decode()
    assert client.post(reverse("web:dataset_delete", args=[ours.pk])).status_code == 404
    assert Dataset.objects.filter(pk=ours.pk).exists()
    assert "our-arith" in login(owner).get(reverse("web:job_new")).content.decode()


def test_it_refuses_a_switch_to_a_foreign_team(
    login: Callable[[Any], Client],
    team: Team,
    other_team: Team,
    owner: Any,
) -> None:
    client = login(owner)
    response = client.post(reverse("web:switch_team"), {"team": other_team.slug})
    assert response.status_code == 404
    assert f"Jobs of {team.name}" in client.get(reverse("web:jobs")).content.decode()


def test_it_shows_the_chosen_teams_jobs_after_a_switch(
    login: Callable[[Any], Client],
    make_team: Callable[..., Team],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    second = make_team("second", (owner, "member"))
    submit(team, owner, "first-team-job")
    submit(second, owner, "second-team-job")
    client = login(owner)
    response = client.post(reverse("web:switch_team"), {"team": "second", "next": "/jobs/"})
    assert response.status_code == 302 and response["Location"] == "/jobs/"
    page = client.get(reverse("web:jobs")).content.decode()
    assert "second-team-job" in page and "first-team-job" not in page


@pytest.mark.parametrize("target", ["/\\evil.example/", "https://evil.example/"])
def test_it_redirects_after_a_switch_only_to_a_page_of_this_site(
    login: Callable[[Any], Client],
    make_team: Callable[..., Team],
    team: Team,
    owner: Any,
    target: str,
) -> None:
    # Browsers read "/\\evil.example" as "//evil.example".
    make_team("second", (owner, "member"))
    response = login(owner).post(reverse("web:switch_team"), {"team": "second", "next": target})
    assert response.status_code == 302 and response["Location"] == reverse("web:jobs")


def test_it_answers_404_for_a_posted_team_that_is_no_slug(
    login: Callable[[Any], Client], team: Team, owner: Any
) -> None:
    # A NUL in the query failed it on PostgreSQL: a 500.
    client = login(owner)
    for slug in (team.slug + "\x00", team.slug + " "):
        assert client.post(reverse("web:switch_team"), {"team": slug}).status_code == 404
        form = {"team": slug, "name": "rows", "env": "math"}
        assert client.post(reverse("web:datasets"), form).status_code == 404


def test_it_redirects_anonymous_visitors_to_sign_in(client: Client, team: Team) -> None:
    for name in ("web:jobs", "web:job_new", "web:keys", "web:team", "web:datasets"):
        response = client.get(reverse(name))
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("account_login"))
