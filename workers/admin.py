from __future__ import annotations

from django.contrib import admin

from .models import GpuLeaseRecord


@admin.register(GpuLeaseRecord)
class GpuLeaseRecordAdmin(admin.ModelAdmin):
    """Read-only: leases are decided in Redis; these rows are their audit trail."""

    list_display = ("job", "attempt", "node", "gpus", "outcome", "acquired", "released")
    list_filter = ("outcome", "node")
    list_select_related = ("job",)
    raw_id_fields = ("job",)
    search_fields = ("job__id", "job__name", "node")
    date_hierarchy = "acquired"

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False
