"""The whole path with a real Valkey and a real Celery worker subprocess.

Submit through the API -> dispatcher leases GPUs -> worker runs the smoke job -> SUCCEEDED;
cancel mid-run frees the GPUs; a SIGKILLed worker's lease is reaped, the job is requeued and
finishes on a fresh worker.
"""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent, JobState
from tests.fixtures.workers import TEST_LEASE_SECONDS, wait_for
from workers.control import reap
from workers.locktable import GpuLockTable
from workers.models import GpuLeaseRecord

pytestmark = pytest.mark.timeout(120)


def submit(client: APIClient, **spec: Any) -> str:
    response = client.post(
        "/api/v1/jobs", {"name": "smoke", "spec": {"method": "smoke", **spec}}, format="json"
    )
    assert response.status_code == 201, response.content
    return str(response.json()["id"])


def state_of(job_id: str) -> str:
    return Job.objects.values_list("state", flat=True).get(pk=job_id)


def held_gpus(table: GpuLockTable, node: str) -> dict[int, str]:
    return table.snapshot()["nodes"][node]["held"]


def test_it_runs_a_smoke_job_to_success(
    celery_worker: Any, owner_client: APIClient, clean_control_plane: Any
) -> None:
    job_id = submit(owner_client, smoke_steps=3, smoke_step_seconds=0.2)
    wait_for(lambda: state_of(job_id) in {"SUCCEEDED", "FAILED", "CANCELLED"}, 40, "the job")
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED, (job.error_code, job.error_message, celery_worker.log())
    assert job.node == "testnode" and len(job.gpus_held) == 1 and job.attempt == 1

    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    assert [int(step) for step, _ in series["eigenvalue"]] == [1, 2, 3]
    # Power iteration converges: the Rayleigh quotient's error only shrinks (down to the
    # floating-point floor).
    errors = [value for _, value in series["eigenvalue_error"]]
    assert errors[-1] < errors[0] or errors[-1] < 1e-12
    assert series["eigenvalue_error"][-1][1] < 1e-3 * series["eigenvalue"][-1][1]
    assert all(value >= 1 for _, value in series["iterations"])

    transitions = list(
        JobEvent.objects.filter(job_id=job_id, kind="state").values_list("to_state", flat=True)
    )
    assert transitions == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]
    table = GpuLockTable(clean_control_plane)
    # The runner releases its lease right after finishing the job.
    wait_for(
        lambda: table.lease_of(job_id) is None and held_gpus(table, "testnode") == {},
        5,
        "the GPUs to be released",
    )
    # The worker announced its 2 CPU slots and, with a pool of 3 (one kept for control
    # tasks), at most 2 jobs at once.
    node = table.nodes()["testnode"]
    assert (node["kind"], node["gpus"], node["max_jobs"]) == ("cpu", [0, 1], 2)
    wait_for(
        lambda: GpuLeaseRecord.objects.filter(job_id=job_id, outcome="released").exists(),
        5,
        "the lease record to close",
    )


def test_it_frees_the_gpus_within_seconds_of_a_cancel(
    celery_worker: Any, owner_client: APIClient, clean_control_plane: Any
) -> None:
    table = GpuLockTable(clean_control_plane)
    job_id = submit(owner_client, smoke_steps=200, smoke_step_seconds=0.2, gpus=2)
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=1).exists(), 30, "step 1")
    assert state_of(job_id) == JobState.RUNNING
    assert len(held_gpus(table, "testnode")) == 2

    response = owner_client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200, response.content
    wait_for(lambda: held_gpus(table, "testnode") == {}, 5, "the GPUs to be released")
    wait_for(lambda: state_of(job_id) == JobState.CANCELLED, 5, "CANCELLED")
    assert Job.objects.get(pk=job_id).current_step < 200

    # The freed block is usable at once: the next job runs on it.
    next_id = submit(owner_client, smoke_steps=1, smoke_step_seconds=0, gpus=2)
    wait_for(lambda: state_of(next_id) == JobState.SUCCEEDED, 30, "the next job")


def test_it_requeues_the_job_of_a_killed_worker_and_finishes_it_on_a_fresh_one(
    start_worker: Any, owner_client: APIClient, clean_control_plane: Any
) -> None:
    table = GpuLockTable(clean_control_plane)
    first = start_worker(node="testnode")
    job_id = submit(owner_client, smoke_steps=5, smoke_step_seconds=0.4)
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=1).exists(), 30, "step 1")
    first.kill()
    lease = table.lease_of(job_id)
    assert lease is not None and state_of(job_id) == JobState.RUNNING

    # Nothing renews the lease any more: it expires within one TTL and the reaper requeues.
    wait_for(lambda: table.expired(), TEST_LEASE_SECONDS + 3, "the lease to expire")
    result = reap()
    assert job_id in result["reclaimed"] and job_id in result["requeued"]
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.QUEUED and job.attempt == 2
    assert GpuLeaseRecord.objects.get(job_id=job_id, attempt=1).outcome == "reaped"

    start_worker(node="testnode")
    wait_for(lambda: state_of(job_id) in {"SUCCEEDED", "FAILED"}, 40, "the requeued job")
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED and job.attempt == 2, job.error_message
    messages = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    assert any("expired" in m for m in messages)


def test_it_recovers_from_a_lost_worker_with_nothing_but_beat(
    start_worker: Any, owner_client: APIClient, clean_control_plane: Any
) -> None:
    lost = start_worker(node="node-a")
    start_worker(node="node-b", beat=True)  # its beat runs the reaper every second
    # Both nodes are equally free: placement breaks the tie by name, so node-a gets the job.
    job_id = submit(owner_client, smoke_steps=4, smoke_step_seconds=0.5)
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=1).exists(), 30, "step 1")
    assert Job.objects.get(pk=job_id).node == "node-a"
    lost.kill()

    wait_for(lambda: state_of(job_id) in {"SUCCEEDED", "FAILED"}, 45, "recovery on node-b")
    job = Job.objects.get(pk=job_id)
    assert (job.state, job.attempt, job.node) == (JobState.SUCCEEDED, 2, "node-b")
    # The runner finishes the job first and then releases its lease.
    expected = [("node-a", "reaped"), ("node-b", "released")]
    wait_for(
        lambda: (
            [
                (r.node, r.outcome)
                for r in GpuLeaseRecord.objects.filter(job_id=job_id).order_by("attempt")
            ]
            == expected
        ),
        5,
        "the lease records",
    )


def test_a_smoke_gang_spans_two_workers_nodes_and_frees_both_when_its_leader_dies(
    start_worker: Any, owner_client: APIClient, clean_control_plane: Any
) -> None:
    """A gang across two real workers' nodes: one lease holds a slot on each; the leader's
    worker runs the job; when the leader dies, the whole lease expires, every member's slot
    is freed, and a new leader worker finishes the requeued job."""
    table = GpuLockTable(clean_control_plane)
    leader = start_worker(node="gang-a", slots=1)
    start_worker(node="gang-b", slots=1)
    job_id = submit(owner_client, smoke_steps=6, smoke_step_seconds=0.4, gpus=2, gpus_per_node=1)
    wait_for(lambda: Job.objects.filter(pk=job_id, current_step__gte=1).exists(), 30, "step 1")
    lease = table.lease_of(job_id)
    assert lease is not None and lease.is_gang
    assert sorted(node for node, _ in lease.blocks) == ["gang-a", "gang-b"]
    assert sorted(Job.objects.get(pk=job_id).gpus_held) == ["gang-a:0", "gang-b:0"]
    assert held_gpus(table, "gang-a") == {0: job_id} and held_gpus(table, "gang-b") == {0: job_id}

    leader.kill()
    wait_for(lambda: table.expired(), TEST_LEASE_SECONDS + 3, "the gang's lease to expire")
    result = reap()
    assert job_id in result["requeued"]
    assert held_gpus(table, "gang-a") == {} and held_gpus(table, "gang-b") == {}

    start_worker(node="gang-a", slots=1)
    wait_for(lambda: state_of(job_id) in {"SUCCEEDED", "FAILED"}, 40, "the requeued gang")
    job = Job.objects.get(pk=job_id)
    assert (job.state, job.attempt) == (JobState.SUCCEEDED, 2), job.error_message
    wait_for(
        lambda: held_gpus(table, "gang-a") == {} and held_gpus(table, "gang-b") == {},
        5,
        "both members' slots to be released",
    )
