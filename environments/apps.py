from __future__ import annotations

from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    """Registers environments.tasks with Celery's autodiscovery; no models."""

    name = "environments"
    verbose_name = "Environments"
