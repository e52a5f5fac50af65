"""WSGI entry point (gunicorn opentinker_site.wsgi)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.production")

application = get_wsgi_application()
