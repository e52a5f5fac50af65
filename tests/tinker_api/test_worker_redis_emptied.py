"""A model worker whose Redis comes back empty (the embedded Valkey keeps nothing on disk),
and stream entries delivered to a worker but never acknowledged.

After an empty restart the worker recreates its stream's consumer group, keeps its models'
live state and their next seq_ids (written back to Redis), skips the seq_ids lost with the
stream instead of waiting out the gap time, and takes its lease and registration back. An
entry whose read reply never arrived (a dropped connection) or whose reader died is taken up
and run, not left pending while its client polls.

The worker runs its real serve loop in a thread, in-process; the emptied Redis is a Valkey of
the test's own, stopped and started again empty on its port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.fixtures.valkeys import StoppableValkey
from tests.fixtures.workers import wait_for
from tests.tinker_api.test_modelworker import ROWS_A, create, fwdbwd, optim
from tinker_api import futures
from tinker_api.tasks import Heartbeat
from tinker_api.worker import server
from tinker_api.worker.server import ModelWorker
from workers import conf
from workers.locktable import GpuLockTable

BASE = "batching-test"  # the helpers of test_modelworker queue on this base model


class EmptiedValkey(StoppableValkey):
    """Stopped and started again, it comes back empty."""

    def restart_empty(self) -> None:
        self.stop()
        self.start()
        assert redis.Redis(port=self.port).dbsize() == 0


@pytest.fixture
def emptied(settings: Any, tmp_path: Path) -> Iterator[EmptiedValkey]:
    valkey = EmptiedValkey(tmp_path / "valkey", keep=False)
    valkey.start()
    settings.REDIS_URL = valkey.url
    yield valkey
    valkey.stop()


class Serving:
    """``worker.serve()`` in a thread, patient with Redis as the Celery task is."""

    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with conf.redis_patience(30):
                self.worker.serve()
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self.worker.stopping.set()
        self.thread.join(timeout=60)


def ended(rid: str, timeout: float = 60) -> dict[str, Any]:
    def final() -> bool:
        fut = futures.get(rid)
        return fut is not None and fut["status"] in futures.FINAL

    wait_for(final, timeout, f"the future {rid}")
    fut = futures.get(rid)
    assert fut is not None
    return fut


def forward(model: str, seq: int) -> str:
    return fwdbwd(model, seq, "cross_entropy", ROWS_A)


@pytest.fixture(autouse=True)
def no_session_reaping(monkeypatch: pytest.MonkeyPatch) -> None:
    # The session reaper reads the database, which these threads have no access to.
    monkeypatch.setattr(server, "REAP_SECONDS", 3600.0)


def test_it_carries_on_with_its_models_after_redis_comes_back_empty(
    base_model_dir: Path, emptied: EmptiedValkey, settings: Any
) -> None:
    # Far longer than the test waits: the lost seq_id must be skipped, not timed out.
    settings.OPENTINKER_TINKER_SEQ_GAP_SECONDS = 600
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-emptied")
    created = create("a", 1)
    serving = Serving(worker)
    try:
        assert ended(created)["status"] == futures.DONE
        assert ended(forward("a", 1))["status"] == futures.DONE
        assert ended(optim("a", 2, learning_rate=1e-2))["status"] == futures.DONE
        step = worker.policies["a"].step
        weights = [p.detach().clone() for p in worker.policies["a"].parameters()]
        earlier = forward("a", 3)
        assert ended(earlier)["status"] == futures.DONE

        emptied.restart_empty()
        # The worker's reads hit the missing group while nothing is queued yet.
        time.sleep(2)
        assert not serving.errors, serving.errors
        assert futures.get(earlier) is None  # the data is gone
        # seq_id 4 was queued when the data vanished: lost with the stream.
        after = ended(forward("a", 5))
        assert not serving.errors, serving.errors
        assert after["status"] == futures.DONE, after
        # The same policy, trained and stepped, not one rebuilt from its initial weights.
        assert worker.policies["a"].step == step
        now = list(worker.policies["a"].parameters())
        assert all(x.equal(y) for x, y in zip(weights, now, strict=True))
        assert futures.next_seq("a") == 6
        assert ended(optim("a", 6, learning_rate=1e-2))["status"] == futures.DONE
        assert worker.policies["a"].step == step + 1
    finally:
        serving.stop()


def test_it_takes_its_lease_and_registration_back_after_redis_comes_back_empty(
    emptied: EmptiedValkey,
) -> None:
    table = GpuLockTable(conf.get_redis())
    table.announce("n1", [0, 1], kind="cpu")
    lease = table.allocate("tinker:x:1", 1, 30)
    assert lease is not None
    lost: list[bool] = []
    beat = Heartbeat(table, lease, BASE, "w-beat", on_lost=lambda: lost.append(True))
    assert beat.still_held()

    emptied.restart_empty()
    table.redis.connection_pool.disconnect()
    beat.check_now()
    assert not lost
    back = table.lease_of(lease.job_id)
    assert back is not None and back.gpus == lease.gpus and back.token == lease.token
    assert futures.worker_of(BASE) == "w-beat" and futures.worker_alive("w-beat")
    # Its GPU is held again: no other lease gets it once the node is announced again.
    table.announce("n1", [0, 1], kind="cpu")
    other = table.allocate("job-2", 1, 30)
    assert other is not None and other.gpus != lease.gpus
    assert table.allocate("job-3", 1, 30) is None

    # A lease whose GPU another lease took while it was gone is lost for good.
    emptied.restart_empty()
    table.redis.connection_pool.disconnect()
    table.announce("n1", [0], kind="cpu")
    assert table.allocate("job-4", 1, 30) is not None
    beat.check_now()
    assert lost == [True]


@pytest.mark.usefixtures("clean_tinker_keys")
def test_it_runs_entries_delivered_but_never_acknowledged(
    base_model_dir: Path, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead reader's entries are taken up after this long without an acknowledgement.
    monkeypatch.setattr(server, "ORPHAN_IDLE_MS", 200, raising=False)
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-pending")
    create("a", 1), create("b", 2), create("c", 3)
    while worker.read(0) or worker.step():
        pass
    stream = futures.stream_key(BASE)

    def delivered_not_acked(consumer: str) -> None:
        # What a read leaves behind when its reply never reaches the reader.
        got = redis_client.xreadgroup(futures.GROUP, consumer, {stream: ">"}, count=10)
        assert len(got[0][1]) == 1

    own = forward("a", 1)
    delivered_not_acked("w-pending")
    orphan = forward("b", 1)
    delivered_not_acked("w-dead")
    # Already ran: taken up again, it must not run (nor fail) a second time.
    done = forward("c", 1)
    while worker.read(0) or worker.step():
        pass
    assert futures.get(done)["status"] == futures.DONE
    redis_client.xgroup_createconsumer(stream, futures.GROUP, "w-pending")
    entry = redis_client.xrange(stream)[-1][0]
    redis_client.xclaim(stream, futures.GROUP, "w-pending", 0, [entry])

    serving = Serving(worker)
    try:
        assert ended(own)["status"] == futures.DONE
        assert ended(orphan)["status"] == futures.DONE
        assert not serving.errors, serving.errors
        assert futures.get(done)["status"] == futures.DONE
        assert futures.next_seq("c") == 2
        wait_for(
            lambda: redis_client.xpending(stream, futures.GROUP)["pending"] == 0,
            10,
            "no entry left pending",
        )
    finally:
        serving.stop()
