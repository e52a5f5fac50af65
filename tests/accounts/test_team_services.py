"""accounts.teams, the one door for team state: the last-owner rule and invitations."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from allauth.account.models import EmailAddress
from django.apps import apps as django_apps

from accounts import teams
from accounts.models import Invitation, Membership, Quota, Team

pytestmark = pytest.mark.django_db


def _row(team: Team, user: Any) -> Membership:
    return Membership.objects.get(team=team, user=user)


def test_it_creates_a_team_with_its_owner_and_quota(owner: Any) -> None:
    team = teams.create_team(name="Initech", slug="initech", owner=owner)
    assert _row(team, owner).role == Membership.Role.OWNER
    assert Quota.objects.filter(team=team).count() == 1


def test_it_refuses_to_demote_the_last_owner(team: Team, owner: Any) -> None:
    with pytest.raises(teams.LastOwner, match="needs an owner"):
        teams.change_role(_row(team, owner), Membership.Role.MEMBER)
    assert _row(team, owner).role == Membership.Role.OWNER


def test_it_refuses_to_remove_the_last_owner(team: Team, owner: Any) -> None:
    with pytest.raises(teams.LastOwner):
        teams.remove_member(_row(team, owner))
    with pytest.raises(teams.LastOwner):
        teams.leave_team(team, owner)
    assert _row(team, owner).role == Membership.Role.OWNER


def test_it_lets_an_owner_go_once_another_owner_exists(
    team: Team, owner: Any, teammate: Any
) -> None:
    teams.change_role(_row(team, teammate), Membership.Role.OWNER)
    teams.change_role(_row(team, owner), Membership.Role.MEMBER)
    assert _row(team, owner).role == Membership.Role.MEMBER
    teams.leave_team(team, owner)
    assert not Membership.objects.filter(team=team, user=owner).exists()
    with pytest.raises(teams.LastOwner):
        teams.leave_team(team, teammate)


def test_it_removes_a_member(team: Team, teammate: Any) -> None:
    teams.remove_member(_row(team, teammate))
    assert not Membership.objects.filter(team=team, user=teammate).exists()


def test_it_refuses_to_let_a_non_member_leave(team: Team, outsider: Any) -> None:
    with pytest.raises(teams.NotAMember):
        teams.leave_team(team, outsider)


def test_it_adds_a_verified_address_at_once(team: Team, owner: Any, outsider: Any) -> None:
    EmailAddress.objects.create(user=outsider, email="u@example.com", verified=True, primary=True)
    invited = teams.invite(team, email="U@Example.com", role="member", invited_by=owner)
    assert invited.user == outsider and invited.joined and invited.invitation is None
    assert _row(team, outsider).role == Membership.Role.MEMBER
    again = teams.invite(team, email="u@example.com", role="owner", invited_by=owner)
    assert not again.joined and _row(team, outsider).role == Membership.Role.MEMBER


def test_it_holds_an_unverified_address_until_it_is_verified(
    team: Team, owner: Any, outsider: Any
) -> None:
    EmailAddress.objects.create(user=outsider, email="u@example.com", verified=False, primary=True)
    invited = teams.invite(team, email="u@example.com", role="owner", invited_by=owner)
    assert invited.user is None and invited.invitation is not None
    assert not Membership.objects.filter(team=team, user=outsider).exists()

    assert teams.accept_invitations(outsider, "U@example.com") == 1
    assert _row(team, outsider).role == Membership.Role.OWNER
    assert Invitation.objects.get(pk=invited.invitation.pk).accepted is not None
    # An accepted invitation is spent: verifying again joins nothing.
    assert teams.accept_invitations(outsider, "u@example.com") == 0


def test_it_renews_an_invitation_instead_of_duplicating_it(team: Team, owner: Any) -> None:
    first = teams.invite(team, email="new@example.com", role="member", invited_by=owner)
    second = teams.invite(team, email="NEW@example.com", role="owner", invited_by=owner)
    assert first.invitation is not None and second.invitation is not None
    assert first.invitation.pk == second.invitation.pk
    assert Invitation.objects.get(team=team, email="new@example.com").role == "owner"


def test_it_withdraws_an_invitation(team: Team, owner: Any) -> None:
    invited = teams.invite(team, email="new@example.com", role="member", invited_by=owner)
    assert invited.invitation is not None
    teams.withdraw_invitation(invited.invitation)
    assert teams.accept_invitations(owner, "new@example.com") == 0


def test_it_makes_a_personal_team_only_for_users_without_one(
    make_user: Callable[..., Any], team: Team, owner: Any
) -> None:
    assert teams.create_personal_team(owner) is None
    Team.objects.create(name="taken", slug="newbie")
    newbie = make_user("newbie")
    personal = teams.create_personal_team(newbie)
    assert personal is not None and personal.slug == "newbie-1"
    assert _row(personal, newbie).role == Membership.Role.OWNER


def test_it_reads_a_missing_quota_as_the_defaults_without_writing(team: Team) -> None:
    Quota.objects.filter(team=team).delete()
    quota = Quota.objects.for_team(team)
    assert quota.pk is None and quota.max_gpus == Quota._meta.get_field("max_gpus").default
    assert not Quota.objects.filter(team=team).exists()


def test_it_gives_teams_without_a_quota_row_one_when_migrating(
    team: Team, other_team: Team
) -> None:
    migration = importlib.import_module("accounts.migrations.0003_quota_for_every_team")
    Quota.objects.filter(team=team).delete()
    migration.add_missing_quotas(django_apps, None)
    assert Quota.objects.filter(team=team).count() == 1
    assert Quota.objects.filter(team=other_team).count() == 1
