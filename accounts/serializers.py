"""Serializers validate and shape; key rules live in ``accounts.keys``."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .models import ApiKey, Membership, Team
from .validators import RefuseUnknownFields, validate_display_name


class TeamSerializer(serializers.ModelSerializer):
    role = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = ["id", "name", "slug", "role", "created"]
        read_only_fields = fields

    @extend_schema_field(serializers.ChoiceField(choices=Membership.Role.choices, allow_null=True))
    def get_role(self, team: Team) -> str | None:
        request = self.context.get("request")
        if request is None or not request.user.is_authenticated:
            return None
        roles: dict[int, str] = self.context.setdefault(
            "_roles",
            dict(Membership.objects.filter(user=request.user).values_list("team_id", "role")),
        )
        return roles.get(team.pk)


class ApiKeySerializer(serializers.ModelSerializer):
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    active = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "team",
            "created_by",
            "created",
            "last_used",
            "expires_at",
            "revoked_at",
            "rotated_to",
            "active",
        ]
        read_only_fields = fields

    def get_active(self, key: ApiKey) -> bool:
        return key.is_live()


class IssuedApiKeySerializer(ApiKeySerializer):
    key = serializers.SerializerMethodField(
        help_text="The full key. Shown only in this response; store it now."
    )

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields

    def get_key(self, key: ApiKey) -> str:
        return self.context["plaintext"]


class ApiKeyCreateSerializer(RefuseUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=100, validators=[validate_display_name])
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    team = serializers.SlugField(
        required=False, help_text="Team slug; needed only when you belong to several teams."
    )

    def validate_name(self, value: str) -> str:
        value = value.strip()
        if not value:
            raise serializers.ValidationError("may not be blank.")
        return value

    def validate_expires_at(self, value: datetime | None) -> datetime | None:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future.")
        return value


class ApiKeyRotateSerializer(RefuseUnknownFields, serializers.Serializer):
    grace_hours = serializers.FloatField(
        required=False,
        min_value=0,
        help_text="How long the old key keeps working (default: the server's grace period).",
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True)

    def validate_grace_hours(self, value: float) -> float:
        limit = settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS
        if value > limit:
            raise serializers.ValidationError(f"at most {limit} hours.")
        return value

    def validate_expires_at(self, value: datetime | None) -> datetime | None:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future.")
        return value


class MeSerializer(serializers.Serializer):
    """The shape of ``GET /api/v1/me`` (documentation only)."""

    username = serializers.CharField()
    teams = TeamSerializer(many=True)
    key = ApiKeySerializer(allow_null=True, help_text="The API key in use; null for a session.")
