"""The GPU time a model worker spends on each team's requests, for the monthly GPU-hours quota.

A batch holds requests of several teams: its time is split between them by their share of it
(rows for sampling, body bytes for forward/backward, one share per request otherwise). Time
with nothing to run is the service's, charged to no one."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime

from django.db import close_old_connections

from jobs.charge_services import charge_serving
from jobs.quotas import month_start
from tinker_api.worker.requests import Op, rows_of
from workers import conf

log = logging.getLogger(__name__)

Shares = Mapping[int | None, float]


def by_rows(ops: Iterable[Op]) -> Counter[int | None]:
    shares: Counter[int | None] = Counter()
    for op in ops:
        shares[op.team] += rows_of(op)
    return shares


def by_size(ops: Iterable[Op]) -> Counter[int | None]:
    """Forward/backward: a request's bytes stand for its tokens (and pictures)."""
    shares: Counter[int | None] = Counter()
    for op in ops:
        shares[op.team] += max(1, len(op.body or b""))
    return shares


def each(ops: Iterable[Op]) -> Counter[int | None]:
    return Counter(op.team for op in ops)


class Meter:
    """GPU-seconds and requests per team, added to ``ServingCharge`` every
    ``OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS``."""

    def __init__(self, base: str, gpus: int) -> None:
        self.base = base
        self.gpus = max(1, gpus)
        # This month's (UTC), not yet written.
        self.month = month_start().date()
        self.seconds: Counter[int] = Counter()
        self.requests: Counter[int] = Counter()
        # Months that ended before their charges were written (the database was down then):
        # each is written to its own month.
        self.earlier: dict[date, tuple[Counter[int], Counter[int]]] = {}
        self.flushed_at = time.monotonic()
        self.every = conf.int_setting("OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS", minimum=0)

    def _turn(self) -> None:
        """Set this month's charges aside once the month has turned."""
        month = month_start().date()
        if month == self.month:
            return
        if self.seconds or self.requests:
            seconds, requests = self.earlier.setdefault(self.month, (Counter(), Counter()))
            seconds.update(self.seconds)
            requests.update(self.requests)
        self.month, self.seconds, self.requests = month, Counter(), Counter()

    def charge(self, shares: Shares, seconds: float) -> None:
        """``seconds`` of the worker's block, split by ``shares``; a request of no team
        (the service's own) keeps its share uncharged."""
        total = sum(w for w in shares.values() if w > 0)
        if total <= 0 or seconds <= 0:
            return
        self._turn()
        for team, weight in shares.items():
            if team is not None and weight > 0:
                self.seconds[team] += seconds * self.gpus * weight / total

    def count(self, ops: Iterable[Op]) -> None:
        self._turn()
        for op in ops:
            if op.team is not None:
                self.requests[op.team] += 1

    def flush(self, *, force: bool = False) -> None:
        """Write what was charged since the last flush, team by team, each to its month; what
        the database could not take stays for the next one (nothing is lost while the worker
        lives, and nothing written is written again)."""
        if not force and time.monotonic() - self.flushed_at < self.every:
            return
        self.flushed_at = time.monotonic()
        self._turn()
        months = [(month, *counts) for month, counts in sorted(self.earlier.items())]
        months.append((self.month, self.seconds, self.requests))
        try:
            for month, seconds, requests in months:
                if not seconds and not requests:
                    continue
                close_old_connections()
                at = datetime(month.year, month.month, 1, tzinfo=UTC)
                for team in sorted(set(seconds) | set(requests)):
                    charge_serving(self.base, {team: seconds[team]}, {team: requests[team]}, now=at)
                    # Written: never again, whatever happens to the next team's.
                    seconds.pop(team, None)
                    requests.pop(team, None)
                self.earlier.pop(month, None)
        except Exception as exc:
            log.warning("GPU time on %s not charged yet (kept for later): %s", self.base, exc)
