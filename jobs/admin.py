"""Admin for jobs (read-mostly; cancelling goes through ``services.cancel_job``), datasets
(read-only; deleting goes through ``jobs.datasets.delete_dataset``, which removes the file)
and the base-model registry (edited here)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from . import datasets, services
from .models import BaseModel, Dataset, Job, JobEvent, JobMetric, ServingCharge


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = ["created", "kind", "from_state", "to_state", "message", "data"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "id",
        "team",
        "created_by",
        "state",
        "priority",
        "gpus_requested",
        "node",
        "attempt",
        "created",
        "finished",
    ]
    list_filter = ["state", "kind", "cancel_requested"]
    list_select_related = ["team", "created_by"]
    search_fields = ["id", "name", "team__slug", "created_by__username", "celery_task_id"]
    raw_id_fields = ["team", "created_by"]
    date_hierarchy = "created"
    # State is owned by the services; the admin may only look, and cancel via the action.
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobEventInline]
    actions = ["cancel_selected"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected jobs")
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        cancelled, skipped = 0, 0
        for job in queryset:
            try:
                services.cancel_job(job, by=request.user)
                cancelled += 1
            except services.IllegalTransition:
                skipped += 1
        self.message_user(
            request,
            f"Cancelled or asked to cancel {cancelled} job(s); {skipped} already finished.",
            messages.SUCCESS,
        )


@admin.register(JobMetric)
class JobMetricAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "name", "value"]
    list_select_related = ["job"]
    raw_id_fields = ["job"]
    search_fields = ["job__id", "name"]


@admin.register(ServingCharge)
class ServingChargeAdmin(admin.ModelAdmin):
    """The model workers' GPU time per team, month and base model (written by the workers)."""

    list_display = ["team", "month", "base_model", "gpu_seconds", "requests", "updated"]
    list_filter = ["month", "base_model"]
    search_fields = ["team__slug", "base_model"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "env", "format", "rows", "size_bytes", "created_by", "created"]
    list_filter = ["env", "format"]
    list_select_related = ["team", "created_by"]
    search_fields = ["id", "name", "team__slug", "created_by__username", "sha256"]
    raw_id_fields = ["team", "created_by"]
    date_hierarchy = "created"
    # Rows and files change together: uploads go through the API, which validates them.
    readonly_fields = [f.name for f in Dataset._meta.fields]
    actions = ["delete_through_service"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Dataset | None = None) -> bool:
        # The stock delete would drop rows and leave their files behind (and skip the check
        # for jobs still reading them): deleting is the action below only.
        return False

    def has_remove_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.delete_dataset")

    @admin.action(description="Delete selected datasets and their files", permissions=["remove"])
    def delete_through_service(self, request: HttpRequest, queryset: QuerySet[Dataset]) -> None:
        deleted, refused = 0, []
        for dataset in queryset:
            try:
                datasets.delete_dataset(dataset)
                deleted += 1
            except datasets.DatasetRejected as exc:
                refused.append(exc.detail)
        self.message_user(request, f"Deleted {deleted} dataset(s).", messages.SUCCESS)
        for detail in refused:
            self.message_user(request, detail, messages.ERROR)


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "path", "present", "max_lora_rank", "max_context", "enabled"]
    list_filter = ["enabled"]
    list_editable = ["enabled"]
    search_fields = ["name", "path", "hub_id", "description"]
    readonly_fields = ["created", "resolved"]

    @admin.display(boolean=True, description="files here")
    def present(self, obj: BaseModel) -> bool:
        # Informational: GPU workers may mount models where this web host does not.
        return obj.resolved_path().is_dir()

    @admin.display(description="resolved path")
    def resolved(self, obj: BaseModel) -> str:
        return str(obj.resolved_path())
