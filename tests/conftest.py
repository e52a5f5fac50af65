"""Shared fixtures: accounts (owner, teammate, outsider, API clients) and workers (Valkey, Celery)."""

pytest_plugins = ["tests.fixtures.accounts", "tests.fixtures.workers"]
