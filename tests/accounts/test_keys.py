"""API keys: format, storage, lookup, revoke, rotate with grace, expiry, last_used."""

from __future__ import annotations

import io
import re
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from accounts.keys import KeyNotLive, NotAMember, issue_key, revoke_key, rotate_key
from accounts.models import ApiKey, Membership, hash_secret, split_key

pytestmark = pytest.mark.django_db

KEY_RE = re.compile(r"^otk_([0-9a-f]{12})_([A-Za-z0-9_-]{43,})$")


def at(moment: Any) -> Any:
    """Run with the clock at ``moment`` (only the clock is replaced)."""
    return mock.patch("django.utils.timezone.now", return_value=moment)


def test_it_issues_keys_with_prefix_and_32_byte_secret(team, owner):
    key, plaintext = issue_key(team, owner, "ci")
    match = KEY_RE.match(plaintext)
    assert match, plaintext
    prefix, secret = match.groups()
    assert key.prefix == prefix
    # token_urlsafe(32) -> 43 base64 characters -> 32 random bytes.
    assert len(secret) >= 43
    assert key.secret_hash == hash_secret(secret)
    assert secret not in key.secret_hash and len(key.secret_hash) == 64


def test_it_stores_only_prefix_and_hmac(team, owner):
    key, plaintext = issue_key(team, owner, "ci")
    _, secret = split_key(plaintext)
    stored = ApiKey.objects.filter(pk=key.pk).values().get()
    for value in stored.values():
        assert secret not in str(value)
    # The hash is keyed: a plain SHA-256 of the secret would not match.
    import hashlib

    assert stored["secret_hash"] != hashlib.sha256(secret.encode()).hexdigest()


def test_it_finds_live_key_and_rejects_wrong_secret(team, owner):
    key, plaintext = issue_key(team, owner, "ci")
    assert ApiKey.objects.for_key(plaintext) == key
    assert ApiKey.objects.for_key("tml-" + plaintext) == key
    tampered = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert ApiKey.objects.for_key(tampered) is None
    assert ApiKey.objects.for_key(plaintext.replace("otk_", "xyz_")) is None
    assert ApiKey.objects.for_key("otk_") is None
    assert ApiKey.objects.for_key("") is None


def test_it_changes_the_hash_when_the_server_secret_changes(team, owner, settings):
    _, plaintext = issue_key(team, owner, "ci")
    settings.OPENTINKER_KEY_HMAC_SECRET = "x" * 40
    assert ApiKey.objects.for_key(plaintext) is None


def test_it_refuses_keys_for_non_members(team, outsider):
    with pytest.raises(NotAMember):
        issue_key(team, outsider, "sneaky")


def test_it_revokes_immediately(team, owner):
    key, plaintext = issue_key(team, owner, "ci")
    assert revoke_key(key) is True
    assert key.revoked_at is not None
    assert ApiKey.objects.for_key(plaintext) is None
    assert revoke_key(key) is False


def test_it_expires_keys(team, owner):
    now = timezone.now()
    key, plaintext = issue_key(team, owner, "ci", expires_at=now + timedelta(hours=1))
    assert ApiKey.objects.for_key(plaintext) == key
    with at(now + timedelta(hours=1, seconds=1)):
        assert ApiKey.objects.for_key(plaintext) is None
    with pytest.raises(ValueError):
        issue_key(team, owner, "past", expires_at=now - timedelta(seconds=1))


def test_it_rotates_with_a_grace_period_then_stops_the_old_key(team, owner):
    assert settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS == 24
    old, old_plain = issue_key(team, owner, "ci")
    now = timezone.now()
    with at(now):
        new, new_plain = rotate_key(old, user=owner)
    assert new.name == old.name and new.team == old.team and new_plain != old_plain
    old.refresh_from_db()
    assert old.rotated_to == new
    assert old.expires_at == now + timedelta(hours=24)
    with at(now + timedelta(hours=23, minutes=59)):
        assert ApiKey.objects.for_key(old_plain) == old
        assert ApiKey.objects.for_key(new_plain) == new
    with at(now + timedelta(hours=24, seconds=1)):
        assert ApiKey.objects.for_key(old_plain) is None
        assert ApiKey.objects.for_key(new_plain) == new


def test_it_honours_a_configured_grace_period(team, owner, settings):
    settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS = 2
    old, old_plain = issue_key(team, owner, "ci")
    now = timezone.now()
    with at(now):
        rotate_key(old, user=owner)
    with at(now + timedelta(hours=2, seconds=1)):
        assert ApiKey.objects.for_key(old_plain) is None


def test_it_keeps_an_earlier_expiry_when_rotating(team, owner):
    now = timezone.now()
    old, _ = issue_key(team, owner, "ci", expires_at=now + timedelta(hours=1))
    rotate_key(old, user=owner)
    old.refresh_from_db()
    assert old.expires_at == now + timedelta(hours=1)


def test_it_refuses_to_rotate_twice_or_a_revoked_key(team, owner):
    old, _ = issue_key(team, owner, "ci")
    rotate_key(old, user=owner)
    with pytest.raises(KeyNotLive):
        rotate_key(old, user=owner)
    other, _ = issue_key(team, owner, "other")
    revoke_key(other)
    with pytest.raises(KeyNotLive):
        rotate_key(other, user=owner)
    assert ApiKey.objects.filter(team=team).count() == 3


def test_it_stops_keys_of_removed_members_and_inactive_users(team, owner, teammate):
    _, owner_plain = issue_key(team, owner, "a")
    _, mate_plain = issue_key(team, teammate, "b")
    Membership.objects.filter(user=teammate, team=team).delete()
    assert ApiKey.objects.for_key(mate_plain) is None
    owner.is_active = False
    owner.save()
    assert ApiKey.objects.for_key(owner_plain) is None


def test_it_throttles_last_used_writes(team, owner):
    key, _ = issue_key(team, owner, "ci")
    assert key.last_used is None
    now = timezone.now()
    with at(now):
        key.touch()
    key.refresh_from_db()
    assert key.last_used == now
    with at(now + timedelta(seconds=10)):
        key.touch()
    key.refresh_from_db()
    assert key.last_used == now
    with at(now + timedelta(seconds=61)):
        key.touch()
    key.refresh_from_db()
    assert key.last_used == now + timedelta(seconds=61)


def test_it_leaves_no_secret_in_a_full_database_dump(team, owner, teammate):
    plaintexts = [issue_key(team, owner, f"k{i}")[1] for i in range(3)]
    key, plain = issue_key(team, teammate, "to-rotate")
    plaintexts.append(plain)
    plaintexts.append(rotate_key(key, user=teammate)[1])
    out = io.StringIO()
    call_command("dumpdata", format="json", stdout=out)
    dump = out.getvalue()
    assert '"model": "accounts.apikey"' in dump
    for plaintext in plaintexts:
        _, secret = split_key(plaintext)
        assert plaintext not in dump
        assert secret not in dump
        # Not even a fragment long enough to matter.
        assert secret[:16] not in dump
    assert settings.OPENTINKER_KEY_HMAC_SECRET not in dump


def test_it_issues_a_key_from_the_command_line(db):
    out = io.StringIO()
    call_command("issue_api_key", "--user", "demo", "--team", "demo", "--create", stdout=out)
    plaintext = out.getvalue().strip()
    key = ApiKey.objects.for_key(plaintext)
    assert key is not None and key.team.slug == "demo" and key.created_by.username == "demo"
    assert key.team.memberships.get().role == Membership.Role.OWNER
