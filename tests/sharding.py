"""Splitting one pytest run into shards that run side by side, balanced by recorded durations.

Most of the suite's wall time is spent waiting on worker subprocesses, servers and polls, so
one pytest process keeps the machine's cores only partly busy; `make test` runs several
shards at once. ``OPENTINKER_TEST_SHARD=i/n`` keeps shard i (1-based) of n. The unit of the
split is a test file (its module fixtures are built once), or a single test with
``OPENTINKER_TEST_SHARD_UNIT=test`` (for files of a few long tests, such as the verl jobs).
Units are dealt out longest first to the shard with the least work so far, their cost taken
from tests/durations.json (seconds per test id; a test not listed costs ``DEFAULT_COST``),
after the other plugins' deselection, so that each shard's share is of what really runs.

``OPENTINKER_TEST_DURATIONS_OUT=path`` records this run's durations (setup, call and
teardown of every test) as JSON; `scripts/test_durations.py` merges such files into
tests/durations.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / "durations.json"
DEFAULT_COST = 0.3


def parse_shard(value: str) -> tuple[int, int]:
    """``"i/n"`` as (i, n), 1 <= i <= n; a ValueError naming the variable otherwise."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise ValueError(f"OPENTINKER_TEST_SHARD={value!r}: expected i/n, e.g. 2/4") from None
    if not 1 <= index <= count:
        raise ValueError(f"OPENTINKER_TEST_SHARD={value!r}: i must be between 1 and n")
    return index, count


def assign(costs: dict[str, float], count: int) -> dict[str, int]:
    """Each unit's shard (0-based): longest first, to the least loaded shard."""
    loads = [0.0] * count
    shards: dict[str, int] = {}
    for unit in sorted(costs, key=lambda u: (-costs[u], u)):
        shard = min(range(count), key=lambda s: (loads[s], s))
        shards[unit] = shard
        loads[shard] += costs[unit]
    return shards


def _recorded() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


def _unit(item: pytest.Item, by_test: bool) -> str:
    return item.nodeid if by_test else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = os.environ.get("OPENTINKER_TEST_SHARD", "")
    if not value:
        return
    try:
        index, count = parse_shard(value)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    by_test = os.environ.get("OPENTINKER_TEST_SHARD_UNIT", "file") == "test"
    recorded = _recorded()
    costs: dict[str, float] = {}
    for item in items:
        unit = _unit(item, by_test)
        costs[unit] = costs.get(unit, 0.0) + recorded.get(item.nodeid, DEFAULT_COST)
    shards = assign(costs, count)
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (keep if shards[_unit(item, by_test)] == index - 1 else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("OPENTINKER_TEST_DURATIONS_OUT"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("OPENTINKER_TEST_DURATIONS_OUT")
    if out and _durations:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_durations.items())}))
