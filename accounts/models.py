"""Teams, memberships, invitations, quotas and API keys.

Rules about one model live on that model or its manager; writes that touch several rows live
in ``accounts.teams`` (teams, memberships, invitations, quota rows) and ``accounts.keys``.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

KEY_PREFIX = "otk_"
# The tinker SDK insists that keys start with "tml-"; we accept and ignore it.
TINKER_PREFIX = "tml-"
# last_used is informational; writing it on every request would serialise hot keys.
LAST_USED_RESOLUTION = timedelta(seconds=60)


class Team(models.Model):
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=50, unique=True)
    created = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="teams"
    )

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def role_of(self, user: models.Model) -> str | None:
        membership = self.memberships.filter(user=user).first()
        return membership.role if membership else None


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "team"], name="membership_user_team_unique")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class Invitation(models.Model):
    """An invitation by email to an address that belongs to no verified user yet.

    The membership is made when someone verifies that address (``accounts.teams``):
    verification is what proves ownership of the address, not sign-up.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, default="member")
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(auto_now_add=True)
    accepted = models.DateTimeField(null=True, blank=True)

    class Meta:
        # The web app made this table; the row moved here with the rest of team state.
        db_table = "web_invitation"
        constraints = [
            models.UniqueConstraint(fields=["team", "email"], name="invitation_team_email_unique")
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.email} -> {self.team}"


class QuotaManager(models.Manager["Quota"]):
    def for_team(self, team: Team) -> Quota:
        """The team's quota row, or an unsaved one with the defaults: reads never write.

        Every team gets its row when it is made (``accounts.teams.ensure_quota``); the
        fallback covers a row an administrator deleted.
        """
        return self.filter(team=team).first() or self.model(team=team)


class Quota(models.Model):
    """Limits set by administrators; checked at submission under ``select_for_update``, and
    again when a queued job starts (``max_gpus``, ``gpu_hours_per_month``); the reaper stops
    the running jobs of a team whose ``gpu_hours_per_month`` is spent."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="quota")
    max_gpus = models.PositiveIntegerField(
        default=8, help_text="GPUs the team may hold at once; also the largest single job."
    )
    max_queued_jobs = models.PositiveIntegerField(
        default=20, help_text="Jobs the team may have waiting in the queue."
    )
    gpu_hours_per_month = models.FloatField(
        default=100.0, help_text="GPU-hours per calendar month (UTC)."
    )
    openai_requests_per_minute = models.PositiveIntegerField(
        default=0, help_text="Requests per minute to /v1 (chat and completions); 0: no limit."
    )
    openai_tokens_per_minute = models.PositiveIntegerField(
        default=0,
        help_text="Prompt + completion tokens per minute through /v1; 0: no limit.",
    )

    objects = QuotaManager()

    def __str__(self) -> str:
        return f"quota of {self.team}"

    def limits(self) -> dict[str, float | int]:
        return {
            "max_gpus": self.max_gpus,
            "max_queued_jobs": self.max_queued_jobs,
            "gpu_hours_per_month": self.gpu_hours_per_month,
            "openai_requests_per_minute": self.openai_requests_per_minute,
            "openai_tokens_per_minute": self.openai_tokens_per_minute,
        }


def hash_secret(secret: str) -> str:
    """HMAC-SHA256 of a key secret keyed by the server secret, hex encoded."""
    return hmac.new(
        settings.OPENTINKER_KEY_HMAC_SECRET.encode(), secret.encode(), hashlib.sha256
    ).hexdigest()


def split_key(plaintext: str) -> tuple[str, str] | None:
    """``[tml-]otk_<prefix>_<secret>`` -> (prefix, secret), or None when malformed."""
    if plaintext.startswith(TINKER_PREFIX):
        plaintext = plaintext[len(TINKER_PREFIX) :]
    if not plaintext.startswith(KEY_PREFIX):
        return None
    prefix, sep, secret = plaintext[len(KEY_PREFIX) :].partition("_")
    if not sep or not prefix or not secret or not prefix.isalnum():
        return None
    return prefix, secret


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def live(self) -> ApiKeyQuerySet:
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ApiKeyManager(models.Manager["ApiKey"]):
    def get_queryset(self) -> ApiKeyQuerySet:
        return ApiKeyQuerySet(self.model, using=self._db)

    def live(self) -> ApiKeyQuerySet:
        return self.get_queryset().live()

    def for_key(self, plaintext: str) -> ApiKey | None:
        """The live key matching ``plaintext``, or None.

        Live means: not revoked, not expired (a rotated key expires at the end of its grace
        period), its creator still active and still a member of the key's team.
        """
        parts = split_key(plaintext.strip())
        if parts is None:
            return None
        prefix, secret = parts
        # One query: the key, its team and creator, and the creator's membership of the team.
        key = (
            self.live()
            .select_related("team", "created_by")
            .filter(
                prefix=prefix,
                created_by__is_active=True,
                created_by__memberships__team_id=models.F("team_id"),
            )
            .first()
        )
        if key is None:
            return None
        if not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
            return None
        return key


class ApiKey(models.Model):
    """An API key. Only the lookup prefix and an HMAC of the secret are stored."""

    prefix = models.CharField(max_length=32, unique=True)
    secret_hash = models.CharField(max_length=64)
    name = models.CharField(max_length=100)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    last_used = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    rotated_to = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rotated_from"
    )

    objects = ApiKeyManager()

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({KEY_PREFIX}{self.prefix}_…)"

    @property
    def display_prefix(self) -> str:
        return f"{KEY_PREFIX}{self.prefix}"

    def is_live(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > now

    def touch(self) -> None:
        """Record use, at most once per ``LAST_USED_RESOLUTION``."""
        now = timezone.now()
        if self.last_used is not None and now - self.last_used < LAST_USED_RESOLUTION:
            return
        # A conditional update: concurrent requests with one key write it once, not N times.
        stale = models.Q(last_used__isnull=True) | models.Q(
            last_used__lt=now - LAST_USED_RESOLUTION
        )
        ApiKey.objects.filter(stale, pk=self.pk).update(last_used=now)
        self.last_used = now
