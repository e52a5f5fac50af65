"""A Redis outage during a running RL job: the worker rides through it and the job ends
SUCCEEDED with every metric step exactly once, no lease left behind and the adapter of an
undisturbed run. Whether Redis keeps its data (an append-only file, as a production Redis
with persistence does) or comes back empty (as the embedded Valkey of ``manage.py serve``
does: the lease is gone, the reaper requeues the job and it resumes from its checkpoint).

The server here is the test's own, stopped and started again on its port; never the shared
server of the other tests.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from jobs import hooks
from jobs.models import JobMetric, JobState
from tests.e2e.test_managed_training import finished, rl_spec, series, steps_of, submit
from tests.e2e.test_worker_kills import adapter_tensors
from tests.fixtures.served import free_port
from tests.fixtures.valkeys import StoppableValkey
from tests.fixtures.workers import wait_for
from workers.locktable import GpuLockTable

# The server under test is the test's own: the pass against PostgreSQL and Redis skips it.
pytestmark = [pytest.mark.once, pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]


class BlinkingRedis:
    """Debian's redis-server, as the CI machine runs it, on a port and directory of its own."""

    def __init__(self, data_dir: Path, executable: str) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.executable = executable
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                self.executable,
                *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)),
                *("--appendonly", "yes", "--save", ""),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        wait_for(lambda: _answers(client), 20, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(params=["valkey", "valkey-empty", "redis-server"])
def server_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def valkey(tmp_path: Path, server_kind: str) -> Iterator[StoppableValkey | BlinkingRedis]:
    if server_kind == "redis-server":
        executable = shutil.which("redis-server")
        if executable is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        server: StoppableValkey | BlinkingRedis = BlinkingRedis(tmp_path / "redis", executable)
    else:
        server = StoppableValkey(tmp_path / "valkey", keep=server_kind == "valkey")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(
    valkey: StoppableValkey | BlinkingRedis, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> str:
    """This module's workers and the test process use the blinking server.

    The test process's Celery app keeps the broker of its first use for good, so it must not
    publish here: admission is left to the worker's beat (the reaper dispatches every
    second), and the test only reads and writes the lock table and the database.
    """
    url = f"redis://127.0.0.1:{valkey.port}/0"
    settings.REDIS_URL = url
    plane = hooks.control_plane()
    assert plane is not None
    monkeypatch.setattr(hooks, "_control_plane", dataclasses.replace(plane, dispatch=lambda: None))
    return url


# Outages: a blink, and a minute (the runner carries on meanwhile; the GPUs are released as
# soon as the server is back), of a server that keeps its data; a blink of one that comes
# back empty. redis-server gets the blink only: its path is the same.
OUTAGES = [
    pytest.param("valkey", 10, id="valkey-10s"),
    pytest.param("valkey", 60, id="valkey-60s"),
    pytest.param("valkey-empty", 10, id="valkey-empty-10s"),
    pytest.param("redis-server", 10, id="redis-server-10s"),
]


@pytest.mark.parametrize(("server_kind", "outage_s"), OUTAGES, indirect=["server_kind"])
def test_it_rides_through_a_redis_outage_during_a_job(
    trainer: Any,
    owner_client: Any,
    valkey: StoppableValkey | BlinkingRedis,
    redis_url: str,
    server_kind: str,
    outage_s: float,
) -> None:
    worker = trainer(beat=True)
    steps = 40
    spec = rl_spec("builtin:arith_train", steps=steps, eval_every=0, checkpoint_every=4)
    job_id = submit(owner_client, spec)
    wait_for(
        lambda: JobMetric.objects.filter(job_id=job_id, name="loss", step__gte=3).exists(),
        90,
        "step 3",
    )
    # What the server comes back with: its data, or (empty) nothing at all. Read from a key
    # of the test's own: the service's keys may be rewritten by the runner or the reaper in
    # the moment after the restart, before the test can look.
    redis.Redis.from_url(redis_url).set("outage-test:marker", "1")
    valkey.stop()
    time.sleep(outage_s)
    valkey.start()
    back = time.monotonic()
    kept = redis.Redis.from_url(redis_url).get("outage-test:marker") is not None
    assert kept == (server_kind != "valkey-empty")
    done_when_back = JobMetric.objects.filter(job_id=job_id, name="loss").count()
    job = finished(job_id, 240)
    ended_after_s = time.monotonic() - back
    tail = worker.log()[-4000:]
    assert job.state == JobState.SUCCEEDED, (job.error_code, job.error_message, tail)
    # The worker that lived through the outage ran the job to its end.
    assert worker.proc.poll() is None, tail
    assert steps_of(series(owner_client, job_id)["loss"]) == list(range(1, steps + 1))
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: GpuLockTable(client).lease_of(job_id) is None, 30, "the lease's release")
    # The worker's consumer is connected again: a new job runs on it, the same one undisturbed,
    # and the outage changed nothing in what was trained.
    after = finished(submit(owner_client, spec, name="undisturbed"), 180)
    assert after.state == JobState.SUCCEEDED, (after.error_message, worker.log()[-4000:])
    expected = adapter_tensors(owner_client, str(after.pk))
    got = adapter_tensors(owner_client, job_id)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), "adapters differ"
    print(
        f"{outage_s} s outage, {done_when_back} steps logged when the server came back: "
        f"attempt {job.attempt}, SUCCEEDED {ended_after_s:.1f} s later"
    )
