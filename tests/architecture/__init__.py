"""Checks of the tree itself: imports, module sizes, where state changes, the settings door."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The server's packages (the client, a distribution of its own, has its own contract).
PACKAGES = (
    "opentinker_site",
    "web",
    "tinker_api",
    "workers",
    "jobs",
    "accounts",
    "environments",
    "training",
)
