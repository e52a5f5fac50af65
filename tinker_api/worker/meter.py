"""The GPU time a model worker spends on each team's requests, for the monthly GPU-hours quota.

A batch holds requests of several teams: its time is split between them by their share of it
(rows for sampling, body bytes for forward/backward, one share per request otherwise). Time
with nothing to run is the service's, charged to no one."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping

from django.db import close_old_connections

from jobs.charge_services import charge_serving
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
        self.seconds: Counter[int] = Counter()
        self.requests: Counter[int] = Counter()
        self.flushed_at = time.monotonic()
        self.every = conf.int_setting("OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS", minimum=0)

    def charge(self, shares: Shares, seconds: float) -> None:
        """``seconds`` of the worker's block, split by ``shares``; a request of no team
        (the service's own) keeps its share uncharged."""
        total = sum(w for w in shares.values() if w > 0)
        if total <= 0 or seconds <= 0:
            return
        for team, weight in shares.items():
            if team is not None and weight > 0:
                self.seconds[team] += seconds * self.gpus * weight / total

    def count(self, ops: Iterable[Op]) -> None:
        for op in ops:
            if op.team is not None:
                self.requests[op.team] += 1

    def flush(self, *, force: bool = False) -> None:
        """Write what was charged since the last flush; kept for the next one if the
        database cannot take it now (nothing is lost while the worker lives)."""
        if not force and time.monotonic() - self.flushed_at < self.every:
            return
        self.flushed_at = time.monotonic()
        if not self.seconds and not self.requests:
            return
        seconds, requests = dict(self.seconds), dict(self.requests)
        self.seconds.clear()
        self.requests.clear()
        try:
            close_old_connections()
            charge_serving(self.base, seconds, requests)
        except Exception as exc:
            log.warning("GPU time on %s not charged yet (kept for later): %s", self.base, exc)
            self.seconds.update(seconds)
            self.requests.update(requests)
