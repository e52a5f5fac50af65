#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

from __future__ import annotations

import os
import sys


def main() -> None:
    # Local development is the default; production sets DJANGO_SETTINGS_MODULE explicitly.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
