"""The Celery application ``opentinker``.

The app only: worker policy (queues, routes, beat, signal handlers) lives in ``workers/``.
Its configuration is ``workers.celeryconf.celery_settings``, read when first needed; the
signal handlers are connected by ``workers.apps`` once Django is set up, which a worker does
before it sets up its queues, so a plain ``celery -A opentinker_site worker -Q gpu`` is a
complete GPU worker.
"""

from __future__ import annotations

import os

from celery import Celery

from workers.celeryconf import celery_settings

# Before the app exists: Celery installs its Django fixup (django.setup() in the worker) only
# when it sees this variable at construction.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")

app = Celery("opentinker")
app.add_defaults(celery_settings)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

__all__ = ["app"]
