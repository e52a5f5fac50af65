from __future__ import annotations

from django.apps import AppConfig


class WebConfig(AppConfig):
    name = "web"
    verbose_name = "Web UI"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (connects the allauth receivers)
