from __future__ import annotations

from django.apps import AppConfig


class TinkerApiConfig(AppConfig):
    name = "tinker_api"
    verbose_name = "Tinker protocol"
    default_auto_field = "django.db.models.BigAutoField"
