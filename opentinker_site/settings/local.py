"""Development settings: SQLite and the embedded Valkey unless told otherwise.

DEBUG stays off (``OPENTINKER_DEBUG=1`` turns it on); static files are served from the apps'
and the project's folders without ``collectstatic``.
"""

from __future__ import annotations

from .base import *  # noqa: F403

WHITENOISE_USE_FINDERS = True

if REDIS_URL is None:  # noqa: F405
    from opentinker_site.embedded import ensure_valkey

    REDIS_URL = ensure_valkey(OPENTINKER_VALKEY_DIR)  # noqa: F405
