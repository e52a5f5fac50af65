from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def gpu_inventory_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the largest-node size to "unknown".

    The real value lives in the shared Redis and changes as GPU workers (and the workers
    tests) announce nodes; these tests are about jobs, not placement. Tests of the
    too-large refusal set their own value.
    """
    from jobs import services

    monkeypatch.setattr(services, "largest_node_gpus", lambda: None)
