"""The Celery application ``opentinker``.

Queues: ``control`` (dispatch, reap), ``gpu`` and ``gpu.<node>`` (jobs pinned to the node whose
GPUs they lease), ``env`` (environment steps). Configuration is built lazily from the Django
settings (``REDIS_URL``, and every timing from ``workers.conf``); ``CELERY_*`` settings may
override any of it. A worker that consumes ``gpu`` also consumes ``gpu.<its node>`` and
announces its GPU inventory when ready, so a plain ``celery -A opentinker_site worker -Q gpu``
is a complete GPU worker.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import (
    celeryd_after_setup,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu import Exchange, Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")

log = logging.getLogger(__name__)

app = Celery("opentinker")


def _queue(name: str) -> Queue:
    """A queue with its own direct exchange and routing key; without them kombu would bind
    every queue to the default routing key and a ``gpu`` message could land on ``control``."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def node_queue(node: str) -> Queue:
    """The queue of one node's GPU jobs; publisher and worker must declare it identically."""
    return _queue(f"gpu.{node}")


def celery_settings() -> dict[str, Any]:
    """Celery configuration derived from the Django settings (read when first needed)."""
    from workers import conf

    url = conf.redis_url()
    transport = {"visibility_timeout": conf.visibility_timeout()}
    return {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_default_queue": "control",
        "task_default_exchange": "control",
        "task_default_routing_key": "control",
        "task_queues": tuple(_queue(name) for name in ("control", "gpu", "env")),
        "task_routes": {
            "workers.tasks.dispatch": {"queue": "control"},
            "workers.tasks.reap": {"queue": "control"},
            "workers.tasks.run_job": {"queue": "gpu"},
            "tinker_api.serve_base_model": {"queue": "gpu"},
            "environments.tasks.*": {"queue": "env"},
        },
        # A GPU task occupies its worker for minutes: never reserve a second one behind it.
        "worker_prefetch_multiplier": 1,
        # Job state lives in the database; task results are not read by anyone.
        "task_ignore_result": True,
        "result_expires": 24 * 3600,
        "timezone": "UTC",
        "enable_utc": True,
        "worker_hijack_root_logger": False,
        # The schedule is a few seconds long; nothing worth persisting to a shelve file.
        "beat_scheduler": "celery.beat:Scheduler",
        "beat_schedule": {
            "reap-expired-leases": {
                "task": "workers.tasks.reap",
                "schedule": conf.reap_interval(),
                "options": {"queue": "control", "expires": conf.reap_interval() * 2},
            },
        },
    }


app.add_defaults(celery_settings)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _consumes_gpu(worker: Any) -> bool:
    """``worker`` is the WorkController or its Consumer; both carry the app and its queues."""
    return "gpu" in worker.app.amqp.queues.consume_from


@celeryd_after_setup.connect
def _add_node_queue(sender: str, instance: Any, **kwargs: Any) -> None:
    """A GPU worker also consumes ``gpu.<node>``: the dispatcher pins jobs to leased nodes."""
    if not _consumes_gpu(instance):
        return
    from workers import conf

    instance.app.amqp.queues.select_add(node_queue(conf.node_name()))


@celeryd_after_setup.connect
def _clear_stopping_flag(sender: str, instance: Any, **kwargs: Any) -> None:
    from workers import control

    control.clear_stopping()


@worker_shutting_down.connect
def _flag_stopping(sender: Any = None, **kwargs: Any) -> None:
    """Warm shutdown waits for running tasks: tell the ones that would otherwise serve until
    idle (``tinker_api.serve_base_model``) to end now."""
    from workers import control

    control.mark_stopping()


@worker_ready.connect
def _announce_inventory(sender: Any, **kwargs: Any) -> None:
    from workers import inventory

    if not _consumes_gpu(sender):
        return
    controller = getattr(sender, "controller", None)
    pool_size = getattr(controller, "concurrency", None)
    serves_control = "control" in sender.app.amqp.queues.consume_from
    inventory.start_announcer(int(pool_size) if pool_size else None, serves_control=serves_control)


@worker_shutdown.connect
def _withdraw_inventory(sender: Any = None, **kwargs: Any) -> None:
    from workers import inventory

    inventory.stop_announcer()
