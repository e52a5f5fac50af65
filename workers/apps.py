from __future__ import annotations

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers and GPU leases"
    default_auto_field = "django.db.models.BigAutoField"
