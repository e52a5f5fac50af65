"""Teams get a quota row; membership is unique per team."""

from __future__ import annotations

import pytest
from django.db import IntegrityError

from accounts.models import Membership, Quota, Team

pytestmark = pytest.mark.django_db


def test_it_gives_every_new_team_a_quota_with_defaults(db):
    team = Team.objects.create(name="New", slug="new")
    quota = Quota.objects.get(team=team)
    assert quota.max_gpus >= 1 and quota.max_queued_jobs >= 1 and quota.gpu_hours_per_month > 0


def test_it_refuses_duplicate_memberships(team, owner):
    with pytest.raises(IntegrityError):
        Membership.objects.create(user=owner, team=team, role=Membership.Role.MEMBER)


def test_it_reports_roles(team, owner, teammate, outsider):
    assert team.role_of(owner) == "owner"
    assert team.role_of(teammate) == "member"
    assert team.role_of(outsider) is None
