"""What the pages answer when an action cannot be done: the reason, in the site's layout,
beside what was asked; never a bare page, a silent no-op or a question that no longer applies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import ApiKey, Invitation, Membership, Team
from jobs.models import Dataset, Job

pytestmark = pytest.mark.django_db


def _messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_it_explains_an_owner_only_refusal_inside_the_site(
    login: Callable[[Any], Client],
    issue: Callable[..., tuple[ApiKey, str]],
    team: Team,
    owner: Any,
    teammate: Any,
) -> None:
    member = login(teammate)
    owner_row = Membership.objects.get(team=team, user=owner)
    key, _ = issue(team, owner, "owners-key")
    refused = {
        reverse("web:team_remove", args=[owner_row.pk]): "Only team owners may remove members.",
        reverse(
            "web:key_revoke", args=[key.pk]
        ): "Only the key&#x27;s creator or a team owner may revoke it.",
    }
    for url, reason in refused.items():
        response = member.post(url)
        assert response.status_code == 403
        page = response.content.decode()
        assert 'id="error-reason"' in page and reason in page
        assert reverse("web:jobs") in page  # the navigation: a page of the site, not bare text
    assert Membership.objects.filter(pk=owner_row.pk).exists()
    key.refresh_from_db()
    assert key.revoked_at is None


def test_it_answers_a_foreign_job_with_the_sites_not_found_page(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    other_team: Team,
    owner: Any,
    outsider: Any,
    team: Team,
) -> None:
    theirs = submit(other_team, outsider, "theirs")
    response = login(owner).get(reverse("web:job_detail", args=[theirs.pk]))
    assert response.status_code == 404
    page = response.content.decode()
    assert 'id="error-reason"' in page and "theirs" not in page


def test_it_says_why_a_role_was_not_changed(
    login: Callable[[Any], Client], team: Team, owner: Any, teammate: Any
) -> None:
    row = Membership.objects.get(team=team, user=teammate)
    response = login(owner).post(
        reverse("web:team_role", args=[row.pk]), {"role": "superuser"}, follow=True
    )
    [message] = _messages(response)
    assert message.startswith(f"Role of {teammate}:") and "superuser" in message
    assert Membership.objects.get(pk=row.pk).role == Membership.Role.MEMBER


def test_it_refuses_an_invitation_address_longer_than_the_column(
    login: Callable[[Any], Client], team: Team, owner: Any
) -> None:
    email = "a" * 64 + "@" + ("b" * 60 + ".") * 4 + "com"  # 312 characters, valid otherwise
    response = login(owner).post(
        reverse("web:team_invite"), {"email": email, "role": "member"}, follow=True
    )
    [message] = _messages(response)
    assert message.startswith("email:") and "at most 254 characters" in message
    assert not Invitation.objects.exists()


def test_it_tells_an_owner_whom_they_removed(
    login: Callable[[Any], Client], team: Team, owner: Any, teammate: Any
) -> None:
    row = Membership.objects.get(team=team, user=teammate)
    response = login(owner).post(reverse("web:team_remove", args=[row.pk]), follow=True)
    assert _messages(response) == [f"{teammate} was removed from {team.name}."]


def test_it_does_not_offer_to_cancel_a_job_that_has_ended_or_is_stopping(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    job = submit(team, owner, "done-already")
    client = login(owner)
    client.post(reverse("web:job_cancel", args=[job.pk]))
    client.get(reverse("web:job_detail", args=[job.pk]))
    response = client.get(reverse("web:job_cancel", args=[job.pk]), follow=True)
    assert response.redirect_chain == [(reverse("web:job_detail", args=[job.pk]), 302)]
    assert _messages(response) == [
        "Job done-already has already ended (Cancelled): there is nothing to cancel."
    ]
    assert "Yes, cancel the job" not in response.content.decode()

    running = submit(team, owner, "stopping")
    Job.objects.filter(pk=running.pk).update(state="RUNNING", cancel_requested=True)
    response = client.get(reverse("web:job_cancel", args=[running.pk]), follow=True)
    assert _messages(response) == ["Cancel of stopping was already requested."]
    assert "Yes, cancel the job" not in response.content.decode()


def test_it_acts_on_what_a_page_showed_after_a_switch_in_another_tab(
    login: Callable[[Any], Client],
    issue: Callable[..., tuple[ApiKey, str]],
    make_team: Callable[..., Team],
    make_dataset: Callable[..., Any],
    team: Team,
    owner: Any,
    teammate: Any,
) -> None:
    side = make_team("side-project", (owner, Membership.Role.OWNER))
    key, _ = issue(team, owner, "acme-key")
    dataset = make_dataset("acme-rows")
    mate_row = Membership.objects.get(team=team, user=teammate)
    client = login(owner)
    client.get(reverse("web:keys"))  # a tab on acme's pages
    client.post(reverse("web:switch_team"), {"team": side.slug})  # another tab switches

    response = client.post(reverse("web:key_revoke", args=[key.pk]), follow=True)
    assert response.status_code == 200
    assert response.context["current_team"] == team  # back on the page of the key's team
    key.refresh_from_db()
    assert key.revoked_at is not None

    client.post(reverse("web:switch_team"), {"team": side.slug})
    assert client.post(reverse("web:dataset_delete", args=[dataset.pk])).status_code == 302
    assert not Dataset.objects.filter(pk=dataset.pk).exists()

    client.post(reverse("web:switch_team"), {"team": side.slug})
    client.post(reverse("web:team_role", args=[mate_row.pk]), {"role": "owner"})
    assert Membership.objects.get(pk=mate_row.pk).role == Membership.Role.OWNER


def test_it_still_hides_other_teams_objects_from_page_buttons(
    login: Callable[[Any], Client],
    issue: Callable[..., tuple[ApiKey, str]],
    make_dataset: Callable[..., Any],
    team: Team,
    other_team: Team,
    owner: Any,
    outsider: Any,
) -> None:
    key, _ = issue(other_team, outsider, "globex-key")
    dataset = make_dataset("globex-rows", team=other_team, user=outsider)
    their_row = Membership.objects.get(team=other_team, user=outsider)
    client = login(owner)
    for url in (
        reverse("web:key_revoke", args=[key.pk]),
        reverse("web:key_rotate", args=[key.pk]),
        reverse("web:dataset_delete", args=[dataset.pk]),
        reverse("web:team_remove", args=[their_row.pk]),
        reverse("web:team_role", args=[their_row.pk]),
    ):
        assert client.post(url, {"role": "member"}).status_code == 404, url
    key.refresh_from_db()
    assert key.revoked_at is None and key.rotated_to_id is None
    assert Dataset.objects.filter(pk=dataset.pk).exists()
    assert Membership.objects.get(pk=their_row.pk).role == Membership.Role.OWNER


def test_it_creates_in_the_team_a_form_was_shown_for_after_a_switch_elsewhere(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    make_team: Callable[..., Team],
    team: Team,
    owner: Any,
) -> None:
    side = make_team("side-project", (owner, Membership.Role.OWNER))
    client = login(owner)
    page = client.get(reverse("web:job_new_yaml")).content.decode()  # a tab on acme's form
    assert f'name="team" value="{team.slug}"' in page
    client.post(reverse("web:switch_team"), {"team": side.slug})  # another tab switches

    response = client.post(
        reverse("web:job_new_yaml"),
        {"team": team.slug, "name": "meant-for-acme", "spec_yaml": "method: smoke\n"},
    )
    assert response.status_code == 302
    assert Job.objects.get(name="meant-for-acme").team == team
    client.post(reverse("web:keys"), {"team": team.slug, "name": "acme-laptop"})
    assert ApiKey.objects.get(name="acme-laptop").team == team

    foreign = client.post(
        reverse("web:job_new_yaml"),
        {"team": "globex", "name": "smuggled", "spec_yaml": "method: smoke\n"},
    )
    assert foreign.status_code == 404 and not Job.objects.filter(name="smuggled").exists()
