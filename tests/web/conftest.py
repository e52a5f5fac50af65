from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from accounts.models import Team
from jobs import services
from jobs.models import Job


@pytest.fixture
def gpu_inventory_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest-node size lives in the shared Redis; page tests are not about placement."""
    monkeypatch.setattr(services, "largest_node_gpus", lambda: None)


@pytest.fixture
def login() -> Callable[[Any], Client]:
    """``login(user)`` -> a test client with a session for ``user``."""

    def make(user: Any) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def submit(gpu_inventory_unknown: None) -> Callable[..., Job]:
    """``submit(team, user, name="j", **spec)`` -> a QUEUED smoke job made by the services."""

    def make(team: Team, user: Any, name: str = "job", **spec: Any) -> Job:
        return services.submit_job(
            team=team, user=user, spec={"method": "smoke", **spec}, name=name
        )

    return make
