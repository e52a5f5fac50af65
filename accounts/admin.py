"""Admin for teams, memberships, quotas and API keys. Key secrets are never shown or editable."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from . import keys
from .models import ApiKey, Membership, Quota, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [QuotaInline, MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role", "created"]
    list_filter = ["role"]
    list_select_related = ["user", "team"]
    raw_id_fields = ["user", "team"]
    search_fields = ["user__username", "team__slug"]


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = [
        "team",
        "max_gpus",
        "max_queued_jobs",
        "gpu_hours_per_month",
        "openai_requests_per_minute",
        "openai_tokens_per_minute",
    ]
    list_select_related = ["team"]
    raw_id_fields = ["team"]
    search_fields = ["team__slug"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "display_prefix",
        "team",
        "created_by",
        "created",
        "last_used",
        "expires_at",
        "revoked_at",
    ]
    list_filter = ["revoked_at"]
    list_select_related = ["team", "created_by"]
    search_fields = ["name", "prefix", "team__slug", "created_by__username"]
    # secret_hash is deliberately absent: the admin neither shows nor edits it.
    fields = [
        "name",
        "prefix",
        "team",
        "created_by",
        "created",
        "last_used",
        "expires_at",
        "revoked_at",
        "rotated_to",
    ]
    readonly_fields = [
        "prefix",
        "team",
        "created_by",
        "created",
        "last_used",
        "revoked_at",
        "rotated_to",
    ]
    actions = ["revoke_selected"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A key's plaintext must be shown once to its owner; issue keys via the API or CLI.
        return False

    @admin.action(description="Revoke selected API keys")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = sum(keys.revoke_key(key) for key in queryset)
        self.message_user(request, f"Revoked {revoked} key(s).", messages.SUCCESS)
