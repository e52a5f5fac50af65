"""Worker policy for the Celery app: queues, routes, the beat schedule, and every other option.

Queues: ``control`` (dispatch, reap), ``gpu`` and ``gpu.<node>`` (jobs pinned to the node whose
GPUs they lease), ``env`` (environment steps). The site's Celery app reads ``celery_settings``
lazily (when its configuration is first needed), so the timings come from ``workers.conf`` as
the Django settings say at that moment; ``CELERY_*`` settings may override any of it.
"""

from __future__ import annotations

from typing import Any

from kombu import Exchange, Queue

from workers import conf

__all__ = [
    "CONTROL_QUEUE",
    "ENFORCE_CANCEL_TASK",
    "ENV_QUEUE",
    "GPU_QUEUE",
    "JOIN_JOB_TASK",
    "REAP_TASK",
    "RUN_JOB_TASK",
    "celery_settings",
    "node_queue",
]

CONTROL_QUEUE = "control"
GPU_QUEUE = "gpu"
ENV_QUEUE = "env"

# The dispatcher sends run_job by name: importing the task module there would close a circle
# (the task calls the dispatcher after every release).
RUN_JOB_TASK = "workers.tasks.run_job"
JOIN_JOB_TASK = "workers.tasks.join_job"
REAP_TASK = "workers.tasks.reap"
# Defined in tinker_api.tasks (above this package): named here, not imported.
END_SILENT_SESSIONS_TASK = "tinker_api.end_silent_sessions"
SESSIONS_SWEEP_SECONDS = 60.0
ENFORCE_CANCEL_TASK = "workers.tasks.enforce_cancel"


def _queue(name: str) -> Queue:
    """A queue with its own direct exchange and routing key; without them kombu would bind
    every queue to the default routing key and a ``gpu`` message could land on ``control``."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def node_queue(node: str) -> Queue:
    """The queue of one node's GPU jobs; publisher and worker must declare it identically."""
    return _queue(f"{GPU_QUEUE}.{node}")


def celery_settings() -> dict[str, Any]:
    """Celery configuration derived from the Django settings (read when first needed)."""
    url = conf.redis_url()
    transport = {"visibility_timeout": conf.visibility_timeout()}
    return {
        "broker_url": url,
        # kombu's Redis transport, with a restore path that survives a broker outage.
        "broker_transport": "workers.broker:Transport",
        "result_backend": url,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_default_queue": CONTROL_QUEUE,
        "task_default_exchange": CONTROL_QUEUE,
        "task_default_routing_key": CONTROL_QUEUE,
        "task_queues": tuple(_queue(name) for name in (CONTROL_QUEUE, GPU_QUEUE, ENV_QUEUE)),
        "task_routes": {
            REAP_TASK: {"queue": CONTROL_QUEUE},
            ENFORCE_CANCEL_TASK: {"queue": CONTROL_QUEUE},
            RUN_JOB_TASK: {"queue": GPU_QUEUE},
            JOIN_JOB_TASK: {"queue": GPU_QUEUE},
            "tinker_api.serve_base_model": {"queue": GPU_QUEUE},
            END_SILENT_SESSIONS_TASK: {"queue": CONTROL_QUEUE},
            "environments.tasks.*": {"queue": ENV_QUEUE},
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
                "task": REAP_TASK,
                "schedule": conf.reap_interval(),
                "options": {"queue": CONTROL_QUEUE, "expires": conf.reap_interval() * 2},
            },
            # Tinker sessions whose client went away while no model worker held their models
            # (a worker ends those of its own models itself).
            "end-silent-tinker-sessions": {
                "task": END_SILENT_SESSIONS_TASK,
                "schedule": SESSIONS_SWEEP_SECONDS,
                "options": {"queue": CONTROL_QUEUE, "expires": SESSIONS_SWEEP_SECONDS},
            },
        },
    }
