"""Test settings: fast hashing, a SQLite file (or DATABASE_URL), the embedded Valkey."""

from __future__ import annotations

from .base import *  # noqa: F403
from .base import OPENTINKER_DATA_DIR, env

DEBUG = False

# Hashing strength is irrelevant in tests and MD5 keeps user fixtures fast.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The SQLite file of the test database (a Celery worker subprocess of a test opens it too).
OPENTINKER_TEST_DB_NAME = env.str(
    "OPENTINKER_TEST_DB_NAME", default=str(OPENTINKER_DATA_DIR / "test.sqlite3")
)
# Browser tests: the Chromium binary, and where screenshots for the README go (empty: none).
OPENTINKER_CHROMIUM = env.str("OPENTINKER_CHROMIUM", default="/usr/bin/chromium")
OPENTINKER_SCREENSHOT_DIR = env.str("OPENTINKER_SCREENSHOT_DIR", default="")

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    # A named file rather than pytest-django's in-memory default, so that a Celery worker
    # subprocess started by a test opens the same database as the test itself.
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": OPENTINKER_TEST_DB_NAME
    }
elif env.str("OPENTINKER_TEST_DB_NAME", default=""):
    # Test runs side by side on one server (`make test`'s shards) each need a database.
    DATABASES["default"]["TEST"] = {"NAME": OPENTINKER_TEST_DB_NAME}  # noqa: F405

if REDIS_URL is None:  # noqa: F405
    from opentinker_site.embedded import ensure_valkey

    REDIS_URL = ensure_valkey(OPENTINKER_VALKEY_DIR)  # noqa: F405
