"""Celery tasks of the Tinker protocol (found by ``app.autodiscover_tasks``)."""

from __future__ import annotations

from tinker_api.modelworker import serve_base_model

__all__ = ["serve_base_model"]
