"""Test settings: fast hashing, a SQLite file (or DATABASE_URL), the embedded Valkey."""

from __future__ import annotations

from .base import *  # noqa: F403
from .base import OPENTINKER_DATA_DIR, env

DEBUG = False

# Hashing strength is irrelevant in tests and MD5 keeps user fixtures fast.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    # A named file rather than pytest-django's in-memory default, so that a Celery worker
    # subprocess started by a test opens the same database as the test itself.
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": env.str(
            "OPENTINKER_TEST_DB_NAME", default=str(OPENTINKER_DATA_DIR / "test.sqlite3")
        )
    }

if REDIS_URL is None:  # noqa: F405
    from opentinker_site.embedded import ensure_valkey

    REDIS_URL = ensure_valkey()
