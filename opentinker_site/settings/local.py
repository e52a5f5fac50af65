"""Development settings: DEBUG on, SQLite and the embedded Valkey unless told otherwise."""

from __future__ import annotations

from .base import *  # noqa: F403
from .base import read_bool

DEBUG = read_bool("DEBUG", True)

if REDIS_URL is None:  # noqa: F405
    from opentinker_site.embedded import ensure_valkey

    REDIS_URL = ensure_valkey(OPENTINKER_VALKEY_DIR)  # noqa: F405
