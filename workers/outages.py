"""Redis is a dependency that blinks: calls that must happen retry through an outage.

A failover or a restarted server takes seconds to a minute. The runner's own loop must not
fail a job over it (the cancel flag falls back to the job row, see ``control``), and the
steps after a job ends (release the GPUs, clear its flags, dispatch the next job) retry with
backoff so that they happen as soon as the server is back, not a lease period later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["OUTAGE_PATIENCE_SECONDS", "RateLimitedWarning", "through_outage"]

# How long a step that must happen keeps trying; past this, what it would have done is left
# to the lease TTL and the reaper.
OUTAGE_PATIENCE_SECONDS = 90.0


def through_outage(
    call: Callable[[], T], what: str, *, patience_s: float = OUTAGE_PATIENCE_SECONDS
) -> T | None:
    """``call()``, retried with backoff (0.5 s doubling to 5 s) while Redis is unreachable;
    None if it still is after ``patience_s``."""
    delay = 0.5
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return call()
        except redis.RedisError as exc:
            if time.monotonic() + delay > deadline:
                log.error("%s: Redis unreachable for %.0f s, giving up (%s)", what, patience_s, exc)
                return None
            log.warning("%s: Redis unreachable (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay = min(5.0, delay * 2)


class RateLimitedWarning:
    """Logs a warning at most once per ``every`` seconds: a loop that meets an outage at every
    step would otherwise write one line per step."""

    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        self.logger = logger
        self.every = every
        self._last = -float("inf")

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self.logger.warning(message, *args)
