"""The runner registry, the JobContext contract, and run_job executed in this process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from jobs import services
from jobs.models import Job, JobState
from jobs.spec import parse_spec
from workers import runners
from workers.locktable import GpuLockTable
from workers.runners.base import JobContext
from workers.runners.smoke import run as smoke
from workers.tasks import run_job


@dataclass
class RecordingContext(JobContext):
    """A context that keeps metrics in memory; cancels after ``cancel_after`` checks."""

    cancel_after: int | None = None
    checks: int = 0
    metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def cancelled(self) -> bool:
        self.checks += 1
        if self.cancel_after is not None and self.checks > self.cancel_after:
            self.stop_reason = "cancelled"
            return True
        return super().cancelled()

    def log_metrics(self, step: int, metrics: Any) -> None:
        self.metrics.append((step, dict(metrics)))

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None:
        pass

    def event(self, message: str, data: Any = None) -> None:
        pass


def context(**spec: Any) -> RecordingContext:
    return RecordingContext(
        job_id="job",
        attempt=1,
        spec={"method": "smoke", **spec},
        devices=["cpu"],
        workdir=Path("."),
    )


def test_it_finds_the_built_in_smoke_runner_and_refuses_unknown_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert runners.runner_for(parse_spec({"method": "smoke"})) is smoke
    assert "smoke" in runners.available()
    monkeypatch.delitem(runners._registry, ("smoke", "native"))
    with pytest.raises(runners.UnknownMethod, match="no runner for method 'smoke'"):
        runners.runner_for(parse_spec({"method": "smoke"}))
    with pytest.raises(ValueError, match="module:function"):
        runners.register("x", "not-a-path")


def test_it_chooses_the_runner_by_method_and_runner() -> None:
    from workers.runners import native, verl

    rl = {"method": "rl", "env": "math", "dataset": "builtin:arith_train"}
    assert runners.runner_for(parse_spec(rl)) is native.run
    assert runners.runner_for(parse_spec({**rl, "method": "sft"})) is native.run
    assert runners.runner_for(parse_spec({**rl, "runner": "verl"})) is verl.run


def test_it_runs_the_smoke_job_step_by_step() -> None:
    ctx = context(smoke_steps=3, smoke_step_seconds=0.05)
    smoke(ctx)
    assert [step for step, _ in ctx.metrics] == [1, 2, 3]
    first, last = ctx.metrics[0][1]["eigenvalue_error"], ctx.metrics[-1][1]["eigenvalue_error"]
    assert last < first or last < 1e-12


def test_it_stops_the_smoke_job_at_a_cancel() -> None:
    ctx = context(smoke_steps=100, smoke_step_seconds=0.05)
    ctx.cancel_after = 2
    smoke(ctx)
    assert ctx.stop_reason == "cancelled" and len(ctx.metrics) < 3


def test_it_reports_a_lost_lease_as_the_stop_reason() -> None:
    ctx = context()
    ctx.lose_lease()
    assert ctx.cancelled() and ctx.stop_reason == "lease_lost" and ctx.lease_lost


@pytest.fixture
def placed_job(transactional_db: None, clean_control_plane: Any, team: Any, owner: Any):
    """Place a job on a node without a worker; the test then runs its task in-process."""

    def place() -> tuple[str, Any]:
        table = GpuLockTable(clean_control_plane)
        table.announce("inproc", [0], ttl=60)
        job = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="inproc")
        lease = table.lease_of(str(job.pk))
        assert lease is not None
        return str(job.pk), lease

    return place


def test_it_fails_a_job_whose_method_has_no_runner(
    placed_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(runners._registry, ("smoke", "native"))
    job_id, lease = placed_job()
    outcome = run_job(
        job_id, attempt=1, node=lease.node, gpus=list(lease.gpus), lease_token=lease.token
    )
    job = Job.objects.get(pk=job_id)
    assert outcome == "failed" and job.state == JobState.FAILED
    assert job.error_code == "unknown_method" and "'smoke'" in job.error_message


def boom(ctx: JobContext) -> None:
    raise RuntimeError("the reward server is down")


def test_it_fails_a_job_whose_runner_raises_and_releases_its_gpus(
    placed_job: Any, clean_control_plane: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(runners._registry, ("smoke", "native"), boom)
    job_id, lease = placed_job()
    run_job(job_id, attempt=1, node=lease.node, gpus=list(lease.gpus), lease_token=lease.token)
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.FAILED and job.error_code == "runner_error"
    assert "reward server is down" in job.error_message
    assert GpuLockTable(clean_control_plane).lease_of(job_id) is None


def test_it_does_nothing_for_a_task_whose_lease_was_taken(
    placed_job: Any, clean_control_plane: Any
) -> None:
    job_id, lease = placed_job()
    GpuLockTable(clean_control_plane).release_job(job_id)
    outcome = run_job(
        job_id, attempt=1, node=lease.node, gpus=list(lease.gpus), lease_token=lease.token
    )
    assert outcome == "lease-lost" and Job.objects.get(pk=job_id).state == JobState.STARTING


def test_it_does_not_start_a_stale_attempt(placed_job: Any) -> None:
    job_id, lease = placed_job()
    outcome = run_job(
        job_id, attempt=2, node=lease.node, gpus=list(lease.gpus), lease_token=lease.token
    )
    assert outcome == "not-startable"
    assert Job.objects.get(pk=job_id).state == JobState.STARTING


def test_it_buffers_metrics_and_writes_them_in_one_go(placed_job: Any) -> None:
    from jobs.models import JobMetric

    job_id, _ = placed_job()
    ctx = JobContext(
        job_id=job_id,
        attempt=1,
        spec={"method": "smoke"},
        devices=["cpu"],
        workdir=Path("."),
        metrics_flush_interval=3600.0,
    )

    def stored() -> list[tuple[int, str, float]]:
        rows = JobMetric.objects.filter(job_id=job_id).order_by("step", "name")
        return list(rows.values_list("step", "name", "value"))

    ctx.log_metrics(0, {"eval/reward": 0.5})  # the first write goes out at once
    assert stored() == [(0, "eval/reward", 0.5)]
    for step in (1, 2, 3):
        ctx.log_metrics(step, {"loss": float(step)})
    assert [s for s, _, _ in stored()] == [0]
    with pytest.raises(ValueError, match="not finite"):
        ctx.log_metrics(4, {"loss": float("nan")})
    ctx.flush_metrics()
    assert stored() == [
        (0, "eval/reward", 0.5),
        (1, "loss", 1.0),
        (2, "loss", 2.0),
        (3, "loss", 3.0),
    ]

    # A resume from the checkpoint of step 1: later steps go, stored or buffered.
    ctx.log_metrics(4, {"loss": 4.0})
    ctx.discard_metrics_after(1)
    ctx.flush_metrics()
    assert [s for s, _, _ in stored()] == [0, 1]

    # Once the interval has passed, the next log writes everything buffered.
    ctx.metrics_flush_interval = 0.0
    ctx.log_metrics(2, {"loss": 20.0})
    assert stored()[-1] == (2, "loss", 20.0)


def log_then_fail(ctx: JobContext) -> None:
    ctx.metrics_flush_interval = 3600.0
    for step in range(1, 6):
        ctx.log_metrics(step, {"loss": 1.0 / step})
    raise RuntimeError("out of memory at step 6")


def test_it_stores_buffered_metrics_of_a_failed_runner(
    placed_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.models import JobMetric

    monkeypatch.setitem(runners._registry, ("smoke", "native"), log_then_fail)
    job_id, lease = placed_job()
    run_job(job_id, attempt=1, node=lease.node, gpus=list(lease.gpus), lease_token=lease.token)
    assert Job.objects.get(pk=job_id).state == JobState.FAILED
    steps = JobMetric.objects.filter(job_id=job_id, name="loss").values_list("step", flat=True)
    assert sorted(steps) == [1, 2, 3, 4, 5]


def test_it_writes_no_metrics_for_an_attempt_that_is_no_longer_live(placed_job: Any) -> None:
    from jobs.models import JobMetric

    job_id, _ = placed_job()
    ctx = JobContext(
        job_id=job_id, attempt=2, spec={"method": "smoke"}, devices=["cpu"], workdir=Path(".")
    )
    ctx.log_metrics(1, {"loss": 1.0})
    assert ctx.lease_lost and not JobMetric.objects.filter(job_id=job_id).exists()


def test_it_describes_a_failure_in_words_without_internals() -> None:
    import redis

    from workers.tasks import failure_message

    lost = redis.ConnectionError("Error 111 connecting to 10.0.0.7:6379. Connection refused.")
    expected = "the runner lost the connection to Redis (redis ConnectionError)"
    assert failure_message(lost) == expected
    long = ValueError("bad value\n" + "x" * 2000)
    message = failure_message(long)
    assert message.startswith("ValueError: bad value x") and len(message) <= 512
    assert "\n" not in message
