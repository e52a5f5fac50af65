"""Every timing follows from OPENTINKER_JOB_LEASE_SECONDS and the job's own max runtime."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from workers import conf
from workers.celeryconf import celery_settings


def test_it_derives_every_timing_from_the_lease_setting(settings: Any) -> None:
    settings.OPENTINKER_JOB_LEASE_SECONDS = 30
    assert conf.lease_seconds() == 30
    assert conf.heartbeat_interval() == 10
    assert conf.inventory_ttl() == 30
    assert 1 <= conf.reap_interval() <= 5
    soft, hard = conf.task_time_limits({"max_runtime_s": 600})
    assert (soft, hard) == (630, 660)

    settings.OPENTINKER_JOB_LEASE_SECONDS = 90
    assert conf.heartbeat_interval() == 30
    assert conf.task_time_limits({"max_runtime_s": 600}) == (690, 780)


def test_it_keeps_the_visibility_timeout_above_the_longest_job(settings: Any) -> None:
    settings.OPENTINKER_JOB_LEASE_SECONDS = 30
    longest = conf.task_time_limits({"max_runtime_s": 10**9})[1]
    cfg = celery_settings()
    assert cfg["broker_transport_options"]["visibility_timeout"] > longest
    assert cfg["worker_prefetch_multiplier"] == 1
    assert cfg["accept_content"] == ["json"] and cfg["task_serializer"] == "json"
    assert cfg["beat_schedule"]["reap-expired-leases"]["schedule"] == conf.reap_interval()
    assert {q.name for q in cfg["task_queues"]} == {"control", "gpu", "env"}
    # Each queue routes by its own key: a gpu task can never land on the control queue.
    assert all(q.routing_key == q.name for q in cfg["task_queues"])


def test_it_uses_a_default_runtime_when_the_spec_names_none() -> None:
    assert conf.job_max_runtime({}) == conf.DEFAULT_MAX_RUNTIME_SECONDS
    assert conf.job_max_runtime({"max_runtime_s": 10**9}) == conf.MAX_RUNTIME_CAP_SECONDS


def test_it_rejects_bad_worker_settings(settings: Any) -> None:
    settings.OPENTINKER_CPU_SLOTS = "two"
    with pytest.raises(ImproperlyConfigured, match="OPENTINKER_CPU_SLOTS"):
        conf.cpu_slots()
    settings.OPENTINKER_NODE_NAME = "a:b"
    with pytest.raises(ImproperlyConfigured, match="OPENTINKER_NODE_NAME"):
        conf.node_name()
