"""The one door for team state: teams, memberships, invitations and quota rows.

Views, signals and the admin call these; nothing else writes those rows. The last-owner rule
lives here: a team never loses its last owner, whoever asks. Permission checks (who may
invite or remove) stay with the callers, which know who is asking and how to answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from allauth.account.models import EmailAddress
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from .models import Invitation, Membership, Quota, Team

# Personal-team slugs are the username, then username-1, ...; past this many taken slugs the
# user is left without one rather than looping.
PERSONAL_SLUG_TRIES = 50


class TeamRefused(Exception):
    """Base class for refused team changes; the message is safe to show to the caller."""


class LastOwner(TeamRefused):
    def __init__(self) -> None:
        super().__init__("A team needs an owner: make someone else owner first.")


class NotAMember(TeamRefused):
    pass


def ensure_quota(team: Team) -> Quota:
    """Give ``team`` its quota row (with the defaults) if it has none yet."""
    quota, _ = Quota.objects.get_or_create(team=team)
    return quota


def create_team(*, name: str, slug: str, owner: Any) -> Team:
    """A team, its quota row and ``owner``'s owner membership, all or nothing."""
    with transaction.atomic():
        team = Team.objects.create(name=name, slug=slug)
        ensure_quota(team)
        Membership.objects.create(user=owner, team=team, role=Membership.Role.OWNER)
    return team


def create_personal_team(user: Any) -> Team | None:
    """A team of their own for a user who belongs to none, so they can submit at once.

    None when the user already has a team (or every candidate slug is taken).
    """
    if Membership.objects.filter(user=user).exists():
        return None
    base = slugify(user.get_username())[:40] or "team"
    for n in range(PERSONAL_SLUG_TRIES):
        slug = base if n == 0 else f"{base}-{n}"
        try:
            return create_team(name=user.get_username(), slug=slug, owner=user)
        except IntegrityError:
            continue
    return None


def add_member(team: Team, user: Any, role: str) -> tuple[Membership, bool]:
    """``user`` joins ``team`` as ``role``; an existing membership is kept as it is."""
    return Membership.objects.get_or_create(user=user, team=team, defaults={"role": role})


@dataclass(frozen=True)
class Invited:
    """What an invitation did: a verified address joins at once, any other waits for one."""

    user: Any | None = None
    joined: bool = False
    invitation: Invitation | None = None


def invite(team: Team, *, email: str, role: str, invited_by: Any) -> Invited:
    """Invite ``email`` to ``team``.

    An address that a user has verified makes the membership now; any other address gets
    (or renews) an invitation that ``accept_invitations`` turns into a membership once
    someone verifies it. Only verification proves the address is theirs.
    """
    email = email.lower()
    verified = (
        EmailAddress.objects.filter(email__iexact=email, verified=True)
        .select_related("user")
        .first()
    )
    if verified is not None:
        _, joined = add_member(team, verified.user, role)
        return Invited(user=verified.user, joined=joined)
    with transaction.atomic():
        invitation, _ = Invitation.objects.update_or_create(
            team=team,
            email=email,
            defaults={"role": role, "invited_by": invited_by, "accepted": None},
        )
    return Invited(invitation=invitation)


def accept_invitations(user: Any, email: str) -> int:
    """``user`` verified ``email``: join every team it is invited to. Returns teams joined."""
    joined = 0
    for invitation in Invitation.objects.filter(email__iexact=email, accepted__isnull=True):
        with transaction.atomic():
            _, created = add_member(invitation.team, user, invitation.role)
            invitation.accepted = timezone.now()
            invitation.save(update_fields=["accepted"])
        joined += int(created)
    return joined


def withdraw_invitation(invitation: Invitation) -> None:
    invitation.delete()


def _owners_locked(team_id: int) -> int:
    # The row locks make two owners demoting each other at once leave one of them owner.
    return len(
        Membership.objects.select_for_update()
        .filter(team_id=team_id, role=Membership.Role.OWNER)
        .values_list("pk", flat=True)
    )


def _would_orphan(membership: Membership) -> bool:
    return membership.role == Membership.Role.OWNER and _owners_locked(membership.team_id) <= 1


def change_role(membership: Membership, role: str) -> Membership:
    """Set ``membership``'s role; demoting the team's last owner raises ``LastOwner``."""
    with transaction.atomic():
        current = Membership.objects.select_for_update().get(pk=membership.pk)
        if role != Membership.Role.OWNER and _would_orphan(current):
            raise LastOwner
        Membership.objects.filter(pk=current.pk).update(role=role)
    membership.role = role
    return membership


def remove_member(membership: Membership) -> None:
    """Remove ``membership``; removing the team's last owner raises ``LastOwner``."""
    with transaction.atomic():
        current = Membership.objects.select_for_update().get(pk=membership.pk)
        if _would_orphan(current):
            raise LastOwner
        current.delete()


def leave_team(team: Team, user: Any) -> None:
    """``user`` leaves ``team``; the last owner cannot (``LastOwner``)."""
    membership = Membership.objects.filter(team=team, user=user).first()
    if membership is None:
        raise NotAMember(f"{user} is not a member of team {team.slug}")
    remove_member(membership)
