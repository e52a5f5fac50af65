from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django import template
from django.utils import timezone

register = template.Library()


def _span(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {s:02d}s"
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {m:02d}m"
    return f"{hours // 24}d {hours % 24}h"


@register.filter
def age(value: datetime | None) -> str:
    if value is None:
        return "—"
    return _span((timezone.now() - value).total_seconds())


@register.simple_tag
def duration(job: Any) -> str:
    """Run time of the current attempt: start to finish, or to now while it runs."""
    if job.started is None:
        return "—"
    end = job.finished or timezone.now()
    return _span((end - job.started).total_seconds())


@register.filter
def state_class(state: str) -> str:
    return f"state state-{str(state).lower()}"


@register.filter
def spec_get(spec: dict[str, Any] | None, key: str) -> Any:
    return (spec or {}).get(key) or "—"


@register.filter
def filesize(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@register.filter
def seconds_from_now(ts: float | None) -> str:
    if not ts:
        return "—"
    delta = datetime.fromtimestamp(ts, tz=timezone.get_current_timezone()) - timezone.now()
    return _span(delta.total_seconds()) if delta > timedelta(0) else "expired"
