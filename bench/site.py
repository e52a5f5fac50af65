"""The Django site for a benchmark that runs parts of the service in its own process."""

from __future__ import annotations

import os
import tempfile


def setup_site(prefix: str) -> None:
    """Django on the development settings, migrated: SQLite in a fresh temporary data
    directory (and the embedded Valkey) unless ``DATABASE_URL`` names a database."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    if not os.environ.get("DATABASE_URL"):
        os.environ["OPENTINKER_DATA_DIR"] = tempfile.mkdtemp(prefix=prefix)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
