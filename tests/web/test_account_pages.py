"""Keys, team membership, sign-up with email verification, CSRF and the staff pool page."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from django.urls import reverse

from accounts.models import ApiKey, Invitation, Membership, Team
from jobs.charge_services import charge_serving

pytestmark = pytest.mark.django_db


def _secret(page: str) -> str:
    found = re.search(r'id="secret-value" value="(otk_[^"]+)"', page)
    assert found, "no secret on the page"
    return found.group(1)


def test_it_shows_a_new_key_once_and_the_key_works(
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
) -> None:
    client = login(owner)
    response = client.post(reverse("web:keys"), {"name": "laptop"})
    assert response.status_code == 200
    assert (
        response["Cache-Control"].startswith("no-store") or "no-store" in response["Cache-Control"]
    )
    secret = _secret(response.content.decode())
    key = ApiKey.objects.for_key(secret)
    assert key is not None and key.team == team and key.name == "laptop"
    again = client.get(reverse("web:keys")).content.decode()
    assert secret not in again and key.display_prefix in again


def test_it_rotates_and_revokes_keys(
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
    owner_key: Any,
) -> None:
    key, old_secret = owner_key
    client = login(owner)
    response = client.post(reverse("web:key_rotate", args=[key.pk]))
    new_secret = _secret(response.content.decode())
    assert new_secret != old_secret
    new = ApiKey.objects.for_key(new_secret)
    assert new is not None
    key.refresh_from_db()
    assert key.rotated_to_id == new.pk and key.expires_at is not None

    response = client.post(reverse("web:key_revoke", args=[new.pk]), follow=True)
    assert "revoked" in response.content.decode()
    assert ApiKey.objects.for_key(new_secret) is None


def test_it_lets_only_the_creator_or_an_owner_manage_a_key(
    login: Callable[[Any], Client],
    team: Team,
    owner_key: Any,
    teammate: Any,
) -> None:
    key, secret = owner_key
    response = login(teammate).post(reverse("web:key_revoke", args=[key.pk]))
    assert response.status_code == 403
    assert ApiKey.objects.for_key(secret) is not None


def test_it_adds_a_verified_user_invited_by_email(
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
    outsider: Any,
) -> None:
    from allauth.account.models import EmailAddress

    outsider.email = "ursula@example.com"
    outsider.save()
    EmailAddress.objects.create(user=outsider, email=outsider.email, verified=True, primary=True)
    login(owner).post(reverse("web:team_invite"), {"email": "Ursula@example.com", "role": "member"})
    assert Membership.objects.filter(team=team, user=outsider, role="member").exists()
    assert mail.outbox and "ursula@example.com" in mail.outbox[-1].to


def test_it_invites_an_unknown_address_and_joins_it_on_verification(
    client: Client,
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
) -> None:
    login(owner).post(reverse("web:team_invite"), {"email": "new@example.com", "role": "member"})
    assert Invitation.objects.filter(team=team, email="new@example.com").exists()
    assert "Invitation" in mail.outbox[-1].subject

    user = _sign_up_and_verify(client, "newbie", "new@example.com")
    assert Membership.objects.filter(team=team, user=user, role="member").exists()
    assert Invitation.objects.get(team=team, email="new@example.com").accepted is not None
    # An invited user joined a team, so no personal team is made for them.
    assert Membership.objects.filter(user=user).count() == 1


def test_it_only_lets_owners_change_the_team(
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
    teammate: Any,
) -> None:
    member = login(teammate)
    owner_row = Membership.objects.get(team=team, user=owner)
    assert member.post(reverse("web:team_remove", args=[owner_row.pk])).status_code == 403
    assert member.post(reverse("web:team_invite"), {"email": "x@example.com"}).status_code == 403
    assert (
        member.post(reverse("web:team_role", args=[owner_row.pk]), {"role": "member"}).status_code
        == 403
    )

    mate_row = Membership.objects.get(team=team, user=teammate)
    boss = login(owner)
    boss.post(reverse("web:team_role", args=[mate_row.pk]), {"role": "owner"})
    assert Membership.objects.get(pk=mate_row.pk).role == "owner"
    boss.post(reverse("web:team_remove", args=[mate_row.pk]))
    assert not Membership.objects.filter(pk=mate_row.pk).exists()


def test_it_keeps_the_last_owner(login: Callable[[Any], Client], team: Team, owner: Any) -> None:
    row = Membership.objects.get(team=team, user=owner)
    client = login(owner)
    response = client.post(reverse("web:team_remove", args=[row.pk]), follow=True)
    assert "needs an owner" in response.content.decode()
    client.post(reverse("web:team_role", args=[row.pk]), {"role": "member"})
    assert Membership.objects.get(pk=row.pk).role == "owner"


def test_it_shows_quota_usage_bars(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    team: Team,
    owner: Any,
) -> None:
    team.quota.max_queued_jobs = 4
    team.quota.save()
    submit(team, owner, "one")
    page = login(owner).get(reverse("web:team")).content.decode()
    assert 'aria-valuenow="1"' in page and 'aria-valuemax="4"' in page
    assert "1 of 4 (25.0%)" in page
    assert "model workers" not in page

    charge_serving("tiny", {team.pk: 360.0}, {team.pk: 2})
    page = login(owner).get(reverse("web:team")).content.decode()
    assert "0.1 h of 100.0 h (0.1%); 0.1 h of it on the shared model workers" in page


def _sign_up_and_verify(client: Client, username: str, email: str) -> Any:
    response = client.post(
        reverse("account_signup"),
        {
            "username": username,
            "email": email,
            "password1": "a-Long-pass-99",
            "password2": "a-Long-pass-99",
        },
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    body = mail.outbox[-1].body
    link = re.search(r"https?://[^/\s]+(/accounts/confirm-email/[^\s]+)", body)
    assert link, body
    client.post(link.group(1))
    return get_user_model().objects.get(username=username)


def test_it_signs_up_verifies_and_gives_a_personal_team(client: Client, db: None) -> None:
    user = _sign_up_and_verify(client, "sam", "sam@example.com")
    from allauth.account.models import EmailAddress

    assert EmailAddress.objects.get(user=user).verified
    team = Team.objects.get(memberships__user=user)
    assert team.memberships.get(user=user).role == "owner"
    assert client.get(reverse("web:jobs")).status_code == 200


def test_it_refuses_sign_in_before_verification(client: Client, db: None) -> None:
    client.post(
        reverse("account_signup"),
        {
            "username": "pat",
            "email": "pat@example.com",
            "password1": "a-Long-pass-99",
            "password2": "a-Long-pass-99",
        },
    )
    client.logout()
    response = client.post(reverse("account_login"), {"login": "pat", "password": "a-Long-pass-99"})
    assert response.status_code == 302
    assert "confirm-email" in response["Location"] or "verification" in response["Location"]
    assert client.get(reverse("web:jobs")).status_code == 302


def test_it_closes_sign_up_when_administrators_switch_it_off(
    client: Client,
    settings: Any,
    db: None,
) -> None:
    settings.OPENTINKER_ALLOW_SIGNUP = False
    response = client.get(reverse("account_signup"))
    assert "closed" in response.content.decode().lower()
    client.post(
        reverse("account_signup"),
        {
            "username": "eve",
            "email": "eve@example.com",
            "password1": "a-Long-pass-99",
            "password2": "a-Long-pass-99",
        },
    )
    assert not get_user_model().objects.filter(username="eve").exists()


def test_it_requires_csrf_tokens_on_posts(team: Team, owner: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    assert client.post(reverse("web:keys"), {"name": "x"}).status_code == 403
    page = client.get(reverse("web:keys")).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    response = client.post(reverse("web:keys"), {"name": "x", "csrfmiddlewaretoken": token})
    assert response.status_code == 200 and ApiKey.objects.filter(name="x").exists()


def test_it_shows_the_gpu_pool_to_staff_only(
    login: Callable[[Any], Client],
    team: Team,
    owner: Any,
    make_user: Callable[..., Any],
    clean_control_plane: Any,
) -> None:
    from workers.locktable import GpuLockTable

    table = GpuLockTable(clean_control_plane)
    table.announce("pagenode", [0, 1], [[0, 1]], ttl=30)
    assert login(owner).get(reverse("web:pool")).status_code == 302
    staff = make_user("stella", is_staff=True)
    page = login(staff).get(reverse("web:pool")).content.decode()
    assert 'data-node="pagenode"' in page and "2 free" in page
    # A gang's lease shows each member's GPUs; a lease that is no job's (a Tinker model
    # worker's) is listed without a job.
    table.announce("othernode", [0, 1], ttl=30)
    assert table.allocate("tinker:tiny:ab12", 4, ttl=30, per_node=2) is not None
    page = login(staff).get(reverse("web:pool")).content.decode()
    assert "leads a gang of 2 nodes" in page
    assert "othernode: 0, 1; pagenode: 0, 1" in page or "pagenode: 0, 1; othernode: 0, 1" in page
    # The queue says why each job waits: the model workers hold every GPU.
    from jobs import services
    from workers.dispatcher import dispatch_once

    services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="queued-one")
    assert dispatch_once(table) == []
    page = login(staff).get(reverse("web:pool")).content.decode()
    assert "queued-one" in page
    assert "4 held by model workers, which give them back when idle" in page


def _totp_code(secret: str) -> str:
    import time

    from allauth.mfa.totp.internal.auth import format_hotp_value, hotp_value

    return format_hotp_value(hotp_value(secret, int(time.time()) // 30))


def test_it_turns_on_totp_and_asks_for_a_code_at_sign_in(
    client: Client,
    team: Team,
    owner: Any,
) -> None:
    from allauth.account.models import EmailAddress
    from allauth.mfa.models import Authenticator

    owner.email = "olivia@example.com"
    owner.save()
    EmailAddress.objects.create(user=owner, email=owner.email, verified=True, primary=True)
    password = "pw-" + owner.username
    client.post(reverse("account_login"), {"login": owner.username, "password": password})
    # Turning on two-factor is a sensitive change: allauth asks for the password again.
    assert client.get(reverse("mfa_activate_totp")).status_code == 302
    client.post(reverse("account_reauthenticate"), {"password": password})
    assert client.get(reverse("mfa_activate_totp")).status_code == 200
    secret = client.session["mfa.totp.secret"]
    response = client.post(reverse("mfa_activate_totp"), {"code": _totp_code(secret)})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Authenticator.objects.filter(user=owner, type="totp").exists()

    client.post(reverse("account_logout"))
    response = client.post(
        reverse("account_login"), {"login": owner.username, "password": password}
    )
    assert response["Location"] == reverse("mfa_authenticate")
    assert client.get(reverse("web:jobs")).status_code == 302
    wrong = "000000" if _totp_code(secret) != "000000" else "111111"
    client.post(reverse("mfa_authenticate"), {"code": wrong})
    assert client.get(reverse("web:jobs")).status_code == 302
    client.post(reverse("mfa_authenticate"), {"code": _totp_code(secret)})
    assert client.get(reverse("web:jobs")).status_code == 200


def test_it_resets_a_forgotten_password_by_email(client: Client, team: Team, owner: Any) -> None:
    from allauth.account.models import EmailAddress

    owner.email = "olivia@example.com"
    owner.save()
    EmailAddress.objects.create(user=owner, email=owner.email, verified=True, primary=True)
    client.post(reverse("account_reset_password"), {"email": owner.email})
    link = re.search(r"https?://[^/\s]+(/accounts/password/reset/key/[^\s]+)", mail.outbox[-1].body)
    assert link, mail.outbox[-1].body
    form_url = client.get(link.group(1))["Location"]
    response = client.post(
        form_url, {"password1": "n3w-Secret-pass", "password2": "n3w-Secret-pass"}
    )
    assert response.status_code == 302
    response = client.post(
        reverse("account_login"), {"login": owner.username, "password": "n3w-Secret-pass"}
    )
    assert response["Location"] == reverse("web:jobs")
