"""A native RL job across two nodes: two real Celery GPU workers with distinct node names, each
one CPU slot, train it as two gloo ranks (rank 0 in the leader's ``run_job``, rank 1 in the
follower's ``join_job``).

It matches the single-process loop on the same global batch and seed; killing the follower's
rank requeues the attempt, which resumes from its checkpoint on a fresh gang and finishes with
every slot of both nodes free again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent, JobMetric, JobState
from jobs.spec import parse_spec
from tests.e2e.test_managed_training import finished, rl_spec, submit
from tests.e2e.test_training_loop import Recorder
from tests.fixtures.workers import wait_for
from training.engine import Engine
from workers import conf
from workers.locktable import GpuLockTable
from workers.runners.inputs import dataset_rows
from workers.runners.loop import TrainingLoop

# The waits are sized for two cores running four parts of `make test` at once: the kill test
# took 106 s there once against 45 s alone.
pytestmark = [pytest.mark.timeout(600), pytest.mark.django_db(transaction=True)]


def gang_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "gpus": 2,
        "gpus_per_node": 1,
        "steps": 5,
        "eval_every": 0,
        "checkpoint_every": 0,
    }
    return rl_spec(dataset, **{**base, **overrides})


def losses(job_id: str) -> dict[int, float]:
    rows = JobMetric.objects.filter(job_id=job_id, name="loss").values_list("step", "value")
    return {int(step): float(value) for step, value in rows}


def single_process_losses(spec_data: dict[str, Any], model_dir: Path, workdir: Path) -> dict:
    """The same spec in this process, one rank: the run the gang must reproduce."""
    torch.set_num_threads(1)
    spec = parse_spec({**spec_data, "gpus": 1, "gpus_per_node": None})
    rows, eval_rows = dataset_rows(spec)
    ctx = Recorder(workdir)
    loop = TrainingLoop(
        ctx, spec, Engine(model_dir), rows=rows, eval_rows=eval_rows, policy_id="reference"
    )
    try:
        assert loop.run() is True
    finally:
        loop.close()
    return {step: m["loss"] for step, m in ctx.metrics.items() if step > 0}


def all_free(table: GpuLockTable, *nodes: str) -> bool:
    snapshot = table.snapshot()
    return not snapshot["leases"] and all(
        not snapshot["nodes"][n]["held"] for n in nodes if n in snapshot["nodes"]
    )


def test_a_two_node_rl_job_trains_as_two_ranks_and_matches_one_process(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    leader, follower = trainer(node="rank-a"), trainer(node="rank-b")
    spec = gang_spec(addition_dataset)
    job_id = submit(owner_client, spec)
    job = finished(job_id, 300)
    logs = leader.log()[-3000:] + follower.log()[-3000:]
    assert job.state == JobState.SUCCEEDED, (job.error_message, logs)
    assert sorted(job.gpus_held) == ["rank-a:0", "rank-b:0"]
    assert "rank 1: done" in follower.log() or "rank 1: done" in leader.log(), logs

    ranks = JobMetric.objects.filter(job_id=job_id, name="dist/ranks").values_list("value")
    assert {v for (v,) in ranks} == {2.0}
    got = losses(job_id)
    want = single_process_losses(Job.objects.get(pk=job_id).spec, tiny_model_dir, tmp_path)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-4), step
    assert any(abs(v) > 0 for v in want.values())
    assert all_free(GpuLockTable(conf.get_redis()), "rank-a", "rank-b")


def test_killing_the_follower_requeues_the_gang_which_resumes_and_frees_every_slot(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    redis_client: Any,
) -> None:
    leader, follower = trainer(node="kill-a"), trainer(node="kill-b")
    # Enough steps that the kill lands mid-run: a quiet machine runs a step in well under a
    # second, and the job's step counter moves once a second or so.
    steps = 30
    job_id = submit(owner_client, gang_spec(addition_dataset, steps=steps, checkpoint_every=2))
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=3).exists(), 240, "step 3")

    def rank_one() -> tuple[int, int] | None:
        # The heartbeat key of the attempt under way names the process rank 1 runs in. (On a
        # loaded machine an attempt may already have been requeued: its successor is read.)
        attempt = Job.objects.values_list("attempt", flat=True).get(pk=job_id)
        beat = redis_client.get(f"ot:gang:{job_id}:{attempt}:member:1")
        return (attempt, int(beat)) if beat and beat.isdigit() else None

    attempt, pid = wait_for(rank_one, 60, "rank 1's heartbeat")
    os.kill(pid, signal.SIGKILL)

    job = finished(job_id, 300)
    logs = leader.log()[-4000:] + follower.log()[-4000:]
    assert (job.state, job.attempt) == (JobState.SUCCEEDED, attempt + 1), (
        job.error_message,
        logs,
    )
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    assert any("requeued" in e for e in events), events
    assert any("resumed from checkpoint step-" in e for e in events), events
    assert sorted(losses(job_id)) == list(range(1, steps + 1))
    table = GpuLockTable(conf.get_redis())
    wait_for(lambda: all_free(table, "kill-a", "kill-b"), 10, "both nodes' slots to be free")
    # A follower's part may end a moment after the leader's: whatever it writes then must not
    # outlive the attempt.
    wait_for(
        lambda: not list(redis_client.scan_iter(match=f"ot:gang:{job_id}:*")),
        10,
        "the gang's keys to be cleared",
    )
