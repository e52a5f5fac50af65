"""What a Celery worker of this project does as it starts and stops.

A worker that consumes ``gpu`` also consumes ``gpu.<its node>`` and announces its GPU inventory
when ready (and withdraws it at shutdown); every worker clears a stale stopping flag at start
and raises its own at warm shutdown. ``workers.apps`` connects them once Django is set up; a
Celery worker sets Django up before it sets up its queues, so they are connected in time.
"""

from __future__ import annotations

from typing import Any

from celery.signals import (
    celeryd_after_setup,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from workers import conf, control, inventory
from workers.celeryconf import CONTROL_QUEUE, GPU_QUEUE, node_queue

__all__ = [
    "add_node_queue",
    "announce_inventory",
    "clear_stopping_flag",
    "connect",
    "flag_stopping",
    "withdraw_inventory",
]


def _consumes_gpu(worker: Any) -> bool:
    """``worker`` is the WorkController or its Consumer; both carry the app and its queues."""
    return GPU_QUEUE in worker.app.amqp.queues.consume_from


def add_node_queue(sender: str, instance: Any, **kwargs: Any) -> None:
    """A GPU worker also consumes ``gpu.<node>``: the dispatcher pins jobs to leased nodes."""
    if _consumes_gpu(instance):
        instance.app.amqp.queues.select_add(node_queue(conf.node_name()))


def clear_stopping_flag(sender: str, instance: Any, **kwargs: Any) -> None:
    control.clear_stopping()


def flag_stopping(sender: Any = None, **kwargs: Any) -> None:
    """Warm shutdown waits for running tasks: tell the ones that would otherwise serve until
    idle (``tinker_api.serve_base_model``) to end now."""
    control.mark_stopping()


def announce_inventory(sender: Any, **kwargs: Any) -> None:
    if not _consumes_gpu(sender):
        return
    controller = getattr(sender, "controller", None)
    pool_size = getattr(controller, "concurrency", None)
    serves_control = CONTROL_QUEUE in sender.app.amqp.queues.consume_from
    inventory.start_announcer(int(pool_size) if pool_size else None, serves_control=serves_control)


def withdraw_inventory(sender: Any = None, **kwargs: Any) -> None:
    inventory.stop_announcer()


def connect() -> None:
    """Connect every handler; connecting again changes nothing (each has a dispatch uid)."""
    handlers = (
        (celeryd_after_setup, add_node_queue),
        (celeryd_after_setup, clear_stopping_flag),
        (worker_shutting_down, flag_stopping),
        (worker_ready, announce_inventory),
        (worker_shutdown, withdraw_inventory),
    )
    for signal, handler in handlers:
        signal.connect(handler, weak=False, dispatch_uid=f"workers.signals.{handler.__name__}")
