"""Every control-plane timing and worker setting, derived in one place.

``OPENTINKER_JOB_LEASE_SECONDS`` is the single knob: the GPU lease TTL, the heartbeat interval,
the reaper period, the Celery time limits of a job (from its own max runtime) and the broker
visibility timeout all follow from it. Deriving them separately is how a job ends up running
twice (a visibility timeout shorter than a job makes the broker redeliver it while it runs).
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# Default and ceiling of a job's wall-clock budget when its spec does not name one.
DEFAULT_MAX_RUNTIME_SECONDS = 24 * 3600
MAX_RUNTIME_CAP_SECONDS = 7 * 24 * 3600


def setting(name: str) -> Any:
    """A setting declared (and validated at start) in ``opentinker_site/settings``.

    Read at call time rather than copied at import, so that an override in a test or a
    management command is seen. An undeclared name is a programming error: every
    ``OPENTINKER_*`` variable has one home, the settings module.
    """
    try:
        return getattr(settings, name)
    except AttributeError as exc:
        raise ImproperlyConfigured(f"{name} is not declared in opentinker_site.settings.") from exc


def int_setting(name: str, *, minimum: int) -> int:
    """An integer setting, checked again because an override at run time skips the start check."""
    raw = setting(name)
    try:
        value = int(raw)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}.") from exc
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {value}.")
    return value


def redis_url() -> str:
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        raise ImproperlyConfigured("REDIS_URL is not configured.")
    return str(url)


@lru_cache(maxsize=8)
def _client_for(url: str, pid: int) -> Any:
    import redis

    # Keyed by pid too: a forked Celery child must not reuse its parent's sockets.
    return redis.Redis.from_url(url, socket_timeout=10, health_check_interval=30)


@lru_cache(maxsize=8)
def _patient_client_for(url: str, pid: int, patience_s: float) -> Any:
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    # Waits of 1, 2, 4 s, then 5 s each, until they add up to the patience.
    retries = 3 + math.ceil(max(0.0, patience_s - 7.0) / 5.0)
    retry = Retry(ExponentialBackoff(cap=5.0, base=0.5), retries)
    return redis.Redis.from_url(
        url,
        socket_timeout=10,
        health_check_interval=30,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


_patience = threading.local()


@contextmanager
def redis_patience(patience_s: float) -> Iterator[None]:
    """Within this block, this thread's ``get_redis()`` waits out a Redis outage of about
    ``patience_s`` (each call retried with backoff) instead of raising at once. For a loop
    that holds state Redis does not (a model worker's live models), where an error raised
    mid-step would leave a request taken but never answered, and ending the loop would lose
    that state. Other threads keep failing fast: a heartbeat must go on trying on its own
    schedule."""
    before = getattr(_patience, "seconds", 0.0)
    _patience.seconds = patience_s
    try:
        yield
    finally:
        _patience.seconds = before


def get_redis() -> Any:
    """The shared ``redis.Redis`` client of this process for ``REDIS_URL`` (of this thread,
    inside ``redis_patience``)."""
    patience_s = getattr(_patience, "seconds", 0.0)
    if patience_s:
        return _patient_client_for(redis_url(), os.getpid(), patience_s)
    return _client_for(redis_url(), os.getpid())


# --- timings ------------------------------------------------------------------------------


def lease_seconds() -> int:
    return int_setting("OPENTINKER_JOB_LEASE_SECONDS", minimum=3)


def heartbeat_interval() -> float:
    """Renew a lease three times per TTL, so two lost renewals in a row are survivable."""
    return lease_seconds() / 3.0


def inventory_ttl() -> int:
    """A node's inventory disappears after this long without a refresh from its worker."""
    return lease_seconds()


def reap_interval() -> float:
    """The reaper runs a few times per TTL, but never less often than every 5 s."""
    return max(1.0, min(5.0, lease_seconds() / 3.0))


def max_attempts() -> int:
    return int_setting("OPENTINKER_MAX_ATTEMPTS", minimum=1)


def job_max_runtime(spec: dict[str, Any] | None) -> int:
    """The job's own wall-clock budget in seconds (its spec), bounded by the global cap."""
    raw = None
    if spec:
        raw = spec.get("max_runtime_s")
    try:
        value = int(raw) if raw is not None else DEFAULT_MAX_RUNTIME_SECONDS
    except (TypeError, ValueError):
        value = DEFAULT_MAX_RUNTIME_SECONDS
    return max(1, min(value, MAX_RUNTIME_CAP_SECONDS))


def task_time_limits(spec: dict[str, Any] | None) -> tuple[int, int]:
    """(soft, hard) Celery time limits of ``run_job``: the runtime plus one and two leases.

    The soft limit lets the runner finish the job as FAILED (timeout) and release its GPUs;
    the hard limit kills the process, after which the lease expires and the reaper acts.
    """
    runtime = job_max_runtime(spec)
    lease = lease_seconds()
    return runtime + lease, runtime + 2 * lease


def visibility_timeout() -> int:
    """Longer than the hard limit of the longest job, so a running job is never redelivered."""
    return MAX_RUNTIME_CAP_SECONDS + 3 * lease_seconds()


# --- scheduling ---------------------------------------------------------------------------


def aging_seconds() -> int:
    """Waiting this long raises a queued job's effective priority by one."""
    return int_setting("OPENTINKER_AGING_SECONDS", minimum=1)


def backfill_window_seconds() -> int:
    """How long a blocked job lets smaller jobs behind it backfill before it reserves the pool."""
    return int_setting("OPENTINKER_BACKFILL_WINDOW_SECONDS", minimum=0)


# --- this node ----------------------------------------------------------------------------


def node_name() -> str:
    name = str(setting("OPENTINKER_NODE_NAME") or socket.gethostname().split(".")[0])
    if not name or any(c in name for c in " :\t\n"):
        raise ImproperlyConfigured(f"OPENTINKER_NODE_NAME {name!r} must be a word without ':'.")
    return name


def cpu_slots() -> int:
    return int_setting("OPENTINKER_CPU_SLOTS", minimum=1)


def node_address() -> str:
    """Where the other nodes of a gang reach this one (its rank 0's rendezvous store)."""
    configured = str(setting("OPENTINKER_NODE_ADDRESS") or "").strip()
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def gang_timeout() -> float:
    return float(int_setting("OPENTINKER_GANG_TIMEOUT_SECONDS", minimum=5))
