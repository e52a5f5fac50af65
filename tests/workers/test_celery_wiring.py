"""A plain ``celery -A opentinker_site worker -Q gpu`` is a complete GPU worker.

The site package holds only the Celery app; queues, routes and signal handlers come from
``workers``. This starts the bare Celery command (not ``manage.py runworker``) and checks that
it still consumes ``gpu.<node>``, announces its inventory, runs a dispatched job, and at warm
shutdown raises its stopping flag and withdraws the node.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs import hooks, services
from jobs.models import Job, JobState
from tests.fixtures.workers import TEST_LEASE_SECONDS, database_url_for_subprocess, wait_for
from workers import control, dispatcher, inventory
from workers.locktable import GpuLockTable
from workers.processes import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
NODE = "plainnode"

pytestmark = [pytest.mark.live, pytest.mark.timeout(120)]


def test_it_makes_a_plain_celery_gpu_worker_complete(
    transactional_db: None,
    clean_control_plane: Any,
    redis_url: str,
    settings: Any,
    tmp_path: Path,
    team: Any,
    owner: Any,
) -> None:
    settings.OPENTINKER_JOB_LEASE_SECONDS = TEST_LEASE_SECONDS
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="opentinker_site.settings.test",
        DATABASE_URL=database_url_for_subprocess(),
        REDIS_URL=redis_url,
        OPENTINKER_NODE_NAME=NODE,
        OPENTINKER_CPU_SLOTS="1",
        OPENTINKER_GPUS="",
        CUDA_VISIBLE_DEVICES="",
        OPENTINKER_JOB_LEASE_SECONDS=str(TEST_LEASE_SECONDS),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        *(sys.executable, "-m", "celery", "-A", "opentinker_site", "worker", "-Q", "gpu"),
        *("--concurrency=1", "--pool=prefork", f"--hostname={NODE}@%h"),
        *("--without-gossip", "--without-mingle", "--loglevel=INFO"),
    ]
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    table = GpuLockTable(clean_control_plane)

    def worker_log() -> str:
        return log_path.read_text(errors="replace")

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}:\n{worker_log()}")
        info = table.nodes().get(NODE)
        return bool(info and info["alive"]) and " ready." in worker_log()

    try:
        wait_for(ready, 60, "the plain worker to announce its inventory")
        assert f"gpu.{NODE}" in worker_log()  # the startup banner lists the queues consumed
        job = services.submit_job(
            team=team,
            user=owner,
            spec={"method": "smoke", "smoke_steps": 2, "smoke_step_seconds": 0.1},
            name="plain",
        )
        wait_for(
            lambda: Job.objects.get(pk=job.pk).state in {"SUCCEEDED", "FAILED", "CANCELLED"},
            40,
            "the job",
        )
        done = Job.objects.get(pk=job.pk)
        assert done.state == JobState.SUCCEEDED, (done.error_message, worker_log())
        assert done.node == NODE
    finally:
        stop_process_group(proc, grace_s=15)

    assert not table.nodes().get(NODE, {}).get("alive", False), worker_log()
    # The main process flagged itself as stopping; its host name and pid name the flag.
    flag = f"{control.STOPPING_PREFIX}{socket.gethostname()}:{proc.pid}"
    assert clean_control_plane.exists(flag), worker_log()
    clean_control_plane.delete(flag)


def test_it_registers_the_control_plane_for_jobs() -> None:
    plane = hooks.control_plane()
    assert plane is not None
    assert plane.dispatch is dispatcher.request_dispatch
    assert plane.cancel_running is control.cancel_running
    assert plane.max_block_size is inventory.max_block_size
