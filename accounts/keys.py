"""Issuing, rotating and revoking API keys.

A key reads ``otk_<prefix>_<secret>``: the prefix (12 hex characters) finds the row, the
secret (32 random bytes, URL-safe base64) is checked against its HMAC. The plaintext exists
only in the return value of ``issue_key`` / ``rotate_key``; it is never stored or logged.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import KEY_PREFIX, ApiKey, Membership, Team, hash_secret

SECRET_BYTES = 32
PREFIX_BYTES = 6


class KeyRefused(Exception):
    """Base class for refused key operations; the message is safe to show to the caller."""


class KeyNotLive(KeyRefused):
    pass


class NotAMember(KeyRefused):
    pass


def _new_prefix_and_secret() -> tuple[str, str]:
    return secrets.token_hex(PREFIX_BYTES), secrets.token_urlsafe(SECRET_BYTES)


def issue_key(
    team: Team,
    user: AbstractBaseUser,
    name: str,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``team`` owned by ``user``; return it and its plaintext (shown once)."""
    name = name.strip()
    if not name:
        raise ValueError("a key needs a name")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("expires_at must be in the future")
    if not Membership.objects.filter(user=user, team=team).exists():
        raise NotAMember(f"{user} is not a member of team {team.slug}")
    # 48 random bits of prefix collide essentially never; retry rather than assume.
    for _ in range(5):
        prefix, secret = _new_prefix_and_secret()
        try:
            with transaction.atomic():
                key = ApiKey.objects.create(
                    prefix=prefix,
                    secret_hash=hash_secret(secret),
                    name=name,
                    team=team,
                    created_by=user,
                    expires_at=expires_at,
                )
        except IntegrityError:
            continue
        return key, f"{KEY_PREFIX}{prefix}_{secret}"
    raise RuntimeError("could not allocate a unique API key prefix")


def rotate_key(
    key: ApiKey,
    *,
    user: AbstractBaseUser,
    grace: timedelta | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Issue a successor of ``key``; the old key keeps working for ``grace``, then stops.

    The new key belongs to ``user`` (who rotated it) and keeps the old key's name and team.
    A revoked, expired or already rotated key cannot be rotated.
    """
    if grace is None:
        grace = timedelta(hours=settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS)
    with transaction.atomic():
        # The row lock makes two concurrent rotations of one key produce one successor.
        old = ApiKey.objects.select_for_update().get(pk=key.pk)
        if not old.is_live() or old.rotated_to_id is not None:
            raise KeyNotLive("only a live key that has not been rotated can be rotated")
        new, plaintext = issue_key(old.team, user, old.name, expires_at=expires_at)
        end_of_grace = timezone.now() + grace
        if old.expires_at is None or old.expires_at > end_of_grace:
            old.expires_at = end_of_grace
        old.rotated_to = new
        old.save(update_fields=["expires_at", "rotated_to"])
    key.refresh_from_db()
    return new, plaintext


def revoke_key(key: ApiKey) -> bool:
    """Revoke ``key``; the next request with it is refused. False if it was already revoked."""
    updated = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    key.refresh_from_db()
    return updated == 1
