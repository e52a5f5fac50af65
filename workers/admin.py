from __future__ import annotations

from django.contrib import admin
from redis.exceptions import RedisError

from .inventory import lock_table
from .models import GpuLeaseRecord


@admin.register(GpuLeaseRecord)
class GpuLeaseRecordAdmin(admin.ModelAdmin):
    """Read-only: leases are decided in Redis; these rows are their audit trail."""

    list_display = (
        "job",
        "attempt",
        "node",
        "gpus",
        "outcome",
        "in_lock_table",
        "acquired",
        "released",
    )
    list_filter = ("outcome", "node")
    list_select_related = ("job",)
    raw_id_fields = ("job",)
    search_fields = ("job__id", "job__name", "node")
    date_hierarchy = "acquired"

    @admin.display(boolean=True, description="in lock table")
    def in_lock_table(self, obj: GpuLeaseRecord) -> bool | None:
        """Whether Redis, the authority, holds a lease for the job right now."""
        try:
            return lock_table().lease_of(str(obj.job_id)) is not None
        except RedisError:
            return None

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False
