"""Dispatcher admission rules against the real lock table and database (no worker needed:
the nodes are announced directly, the tasks land in queues nobody consumes)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Job, JobState
from workers import dispatcher
from workers.dispatcher import Candidate, admission_order, dispatch_once, request_dispatch
from workers.locktable import GpuLockTable
from workers.models import GpuLeaseRecord


@pytest.fixture
def table(transactional_db: None, clean_control_plane: Any) -> GpuLockTable:
    return GpuLockTable(clean_control_plane)


@pytest.fixture
def offline_node(table: GpuLockTable):
    """Announce a node but keep it out of placement until the test brings it online."""

    def make(name: str, slots: int) -> None:
        table.announce(name, list(range(slots)), ttl=60)
        table.withdraw(name)

    return make


def queue_job(
    team: Any,
    user: Any,
    *,
    gpus: int = 1,
    priority: int = 50,
    age_s: float = 0,
    expect: str = JobState.QUEUED,
    per_node: int | None = None,
) -> str:
    spec: dict[str, Any] = {"method": "smoke", "gpus": gpus, "priority": priority}
    if per_node is not None:
        spec["gpus_per_node"] = per_node
    job = services.submit_job(team=team, user=user, spec=spec, name=f"p{priority}-g{gpus}")
    if age_s:
        # Test setup only: pretend the job was submitted earlier.
        Job.objects.filter(pk=job.pk).update(created=timezone.now() - timedelta(seconds=age_s))
    assert Job.objects.get(pk=job.pk).state == expect
    return str(job.pk)


def test_it_admits_by_priority_then_age(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    offline_node("n", 2)
    low = queue_job(team, owner, priority=10, age_s=30)
    high = queue_job(team, owner, priority=90)
    mid_old = queue_job(team, owner, priority=50, age_s=20)
    queue_job(team, owner, priority=50, age_s=10)
    table.refresh("n", ttl=60)

    assert dispatch_once(table) == [high, mid_old]
    for job_id in (high, mid_old):
        job = Job.objects.get(pk=job_id)
        assert job.state == JobState.STARTING and job.node == "n" and job.celery_task_id
        assert GpuLeaseRecord.objects.get(job_id=job_id).outcome == "held"
    assert Job.objects.get(pk=low).state == JobState.QUEUED


def test_it_lets_small_jobs_backfill_while_a_big_one_waits(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_BACKFILL_WINDOW_SECONDS = 300
    offline_node("n", 4)
    table.refresh("n", ttl=60)
    assert table.allocate("someone-else", 2, ttl=60) is not None
    table.withdraw("n")
    big = queue_job(team, owner, gpus=4, priority=90)
    small = queue_job(team, owner, gpus=1, priority=10)
    table.refresh("n", ttl=60)

    assert dispatch_once(table) == [small]
    assert Job.objects.get(pk=big).state == JobState.QUEUED
    # Why it waits, with the pool as the pass found it ("someone-else" is no job's lease).
    assert Job.objects.get(pk=big).queue_note == (
        "waiting for 4 GPUs (2 of 4 free; 2 held by model workers, which give them back when idle)"
    )
    assert Job.objects.get(pk=small).queue_note == ""
    # Model workers serving nothing on the node are told that a job waits for their GPUs.
    assert table.redis.ttl(dispatcher.JOBS_WAITING_KEY) > 0
    assert json.loads(table.redis.get(dispatcher.JOBS_WAITING_KEY)) == ["n"]


def test_it_stops_backfill_once_the_big_job_waited_past_the_window(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_BACKFILL_WINDOW_SECONDS = 300
    offline_node("n", 4)
    table.refresh("n", ttl=60)
    blocker = table.allocate("someone-else", 2, ttl=60)
    table.withdraw("n")
    big = queue_job(team, owner, gpus=4, priority=90, age_s=301)
    small = queue_job(team, owner, gpus=1, priority=10)
    table.refresh("n", ttl=60)

    # The big job holds a reservation: the free GPUs stay free for it.
    assert dispatch_once(table) == []
    assert Job.objects.get(pk=small).state == JobState.QUEUED
    assert Job.objects.get(pk=big).queue_note.startswith("first in line for 4 GPUs (2 of 4 free")
    assert Job.objects.get(pk=small).queue_note == f"behind job {big}, which waits for 4 GPUs"
    assert blocker is not None and table.release(blocker)
    assert dispatch_once(table) == [big]
    assert Job.objects.get(pk=big).queue_note == ""


def test_it_reserves_nothing_for_a_job_no_live_node_can_hold(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_BACKFILL_WINDOW_SECONDS = 0
    offline_node("big", 8)
    offline_node("small", 2)
    huge = queue_job(team, owner, gpus=8, priority=90, age_s=1000)
    small = queue_job(team, owner, gpus=1, priority=10)
    table.refresh("small", ttl=60)  # the 8-GPU node stays down
    assert dispatch_once(table) == [small]
    assert Job.objects.get(pk=huge).state == JobState.QUEUED
    assert Job.objects.get(pk=huge).queue_note == (
        "needs 8 GPUs: no live node can hold that (live nodes have 2 GPUs)"
    )
    # Only jobs the live nodes could hold keep idle model workers from their blocks.
    assert not table.redis.exists(dispatcher.JOBS_WAITING_KEY)


def test_only_model_workers_whose_gpus_would_place_the_job_are_asked_to_leave(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    offline_node("a", 2)
    offline_node("b", 2)
    offline_node("c", 2)
    # a: a model worker and a job (the worker leaving frees 1 of the 2 the job needs);
    # b: a model worker and a free GPU (its leaving places the job); c: two jobs.
    for node, holders in (("a", ["model-a", str(uuid.uuid4())]), ("b", ["model-b"])):
        table.refresh(node, ttl=60)
        for holder in holders:
            assert table.allocate(holder, 1, ttl=60) is not None
        table.withdraw(node)
    table.refresh("c", ttl=60)
    assert table.allocate(str(uuid.uuid4()), 2, ttl=60) is not None
    for node in ("a", "b"):
        table.refresh(node, ttl=60)
    job = queue_job(team, owner, gpus=2)
    assert dispatch_once(table) == []
    assert json.loads(table.redis.get(dispatcher.JOBS_WAITING_KEY)) == ["b"]
    # A gang of 1 GPU a node would take a's freed GPU as well as b's.
    Job.objects.filter(pk=job).delete()
    queue_job(team, owner, gpus=3, per_node=1)
    assert dispatch_once(table) == []
    assert json.loads(table.redis.get(dispatcher.JOBS_WAITING_KEY)) == ["a", "b"]


def test_model_workers_are_not_asked_to_leave_when_jobs_hold_what_a_job_waits_for(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    offline_node("n", 2)
    table.refresh("n", ttl=60)
    assert table.allocate(str(uuid.uuid4()), 2, ttl=60) is not None  # another job's lease
    job = queue_job(team, owner)
    assert dispatch_once(table) == []
    assert Job.objects.get(pk=job).queue_note == "waiting for 1 GPU (0 of 2 free)"
    assert not table.redis.exists(dispatcher.JOBS_WAITING_KEY)


def test_a_job_with_no_live_node_says_so(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    offline_node("n", 2)
    job = queue_job(team, owner)
    assert dispatch_once(table) == []
    assert Job.objects.get(pk=job).queue_note.startswith("no GPU worker is running")


def test_it_ages_a_low_priority_job_past_newer_high_priority_ones(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_AGING_SECONDS = 10
    offline_node("n", 1)
    starving = queue_job(team, owner, priority=0, age_s=1000)  # +100 for its wait
    queue_job(team, owner, priority=95)
    table.refresh("n", ttl=60)
    assert dispatch_once(table) == [starving]


def test_it_orders_candidates_by_effective_priority() -> None:
    now = timezone.now()

    def cand(name: str, priority: int, age_s: float) -> Candidate:
        return Candidate(name, priority, 1, now - timedelta(seconds=age_s), 1, {})

    order = admission_order(
        [cand("new-high", 60, 0), cand("old-low", 10, 600), cand("mid", 50, 5)],
        now,
        aging_seconds=10,
    )
    assert [c.job_id for c in order] == ["old-low", "new-high", "mid"]
    order = admission_order([cand("a", 50, 5), cand("b", 50, 9)], now, aging_seconds=3600)
    assert [c.job_id for c in order] == ["b", "a"]


def test_it_does_not_run_two_dispatch_passes_at_once(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, clean_control_plane: Any
) -> None:
    offline_node("n", 1)
    job_id = queue_job(team, owner)
    table.refresh("n", ttl=60)
    lock = clean_control_plane.lock(dispatcher.LOCK_KEY, timeout=30)
    assert lock.acquire(blocking=False)
    try:
        # Another dispatcher holds the lock: this call leaves a pending mark and returns.
        assert request_dispatch() == []
        assert clean_control_plane.exists(dispatcher.PENDING_KEY)
        assert Job.objects.get(pk=job_id).state == JobState.QUEUED
    finally:
        lock.release()
    assert request_dispatch() == [job_id]
    assert not clean_control_plane.exists(dispatcher.PENDING_KEY)


def test_it_ends_a_cancelled_job_whose_task_never_started(
    table: GpuLockTable, team: Any, owner: Any, owner_client: Any
) -> None:
    table.announce("ghost", [0, 1], ttl=60)  # a node whose worker never picks up its queue
    # Submission dispatches on commit: the job is placed on the ghost node at once.
    job_id = queue_job(team, owner, gpus=2, expect=JobState.STARTING)

    response = owner_client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200, response.content
    assert Job.objects.get(pk=job_id).state == JobState.CANCELLED
    assert table.lease_of(job_id) is None
    assert table.snapshot()["nodes"]["ghost"]["held"] == {}
    assert GpuLeaseRecord.objects.get(job_id=job_id).outcome == "cancelled"


def test_it_refuses_at_submit_a_job_larger_than_every_node(
    table: GpuLockTable, team: Any, owner: Any
) -> None:
    table.announce("n", [0, 1, 2, 3], ttl=60)
    with pytest.raises(services.GpuRequestTooLarge, match="largest node has 4"):
        services.submit_job(
            team=team, user=owner, spec={"method": "smoke", "gpus": 5}, name="too-big"
        )


def _dispatch_in_child(out: Any) -> None:
    from django.db import connections

    try:
        out.put(request_dispatch())
    finally:
        connections.close_all()


def test_it_admits_each_job_once_when_dispatchers_race(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    import multiprocessing as mp

    from django.db import connections

    offline_node("n", 4)
    jobs = [queue_job(team, owner) for _ in range(6)]
    table.refresh("n", ttl=60)
    connections.close_all()  # children open their own connections
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_dispatch_in_child, args=(out,)) for _ in range(4)]
    for p in procs:
        p.start()
    admitted = [job for _ in procs for job in out.get(timeout=60)]
    for p in procs:
        p.join(timeout=30)
    assert len(admitted) == len(set(admitted)) == 4
    starting = set(Job.objects.filter(state=JobState.STARTING).values_list("id", flat=True))
    assert {str(j) for j in starting} == set(admitted) and set(admitted) <= set(jobs)
    assert len(table.snapshot()["leases"]) == 4


def test_a_gang_is_admitted_across_nodes_and_recorded_with_every_gpu(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any
) -> None:
    for name in ("a", "b", "c"):
        offline_node(name, 2)
    gang = queue_job(team, owner, gpus=4, per_node=2)
    for name in ("a", "b", "c"):
        table.refresh(name, ttl=60)
    assert dispatch_once(table) == [gang]
    lease = table.lease_of(gang)
    assert lease is not None and lease.is_gang and len(lease.blocks) == 2
    job = Job.objects.get(pk=gang)
    assert job.state == JobState.STARTING and sorted(job.gpus_held) == sorted(lease.gpu_ids)
    record = GpuLeaseRecord.objects.get(job_id=gang)
    assert len(record.gpus) == 4 and record.node == lease.node


def test_a_gang_reserves_the_pool_once_it_waited_past_the_window(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    """Small jobs backfill around a waiting gang only inside the window: after it, the gang
    holds a reservation and the GPUs its members need drain to it."""
    settings.OPENTINKER_BACKFILL_WINDOW_SECONDS = 300
    offline_node("a", 2)
    offline_node("b", 2)
    table.refresh("a", ttl=60)
    table.refresh("b", ttl=60)
    blocker = table.allocate("someone-else", 1, ttl=60)
    assert blocker is not None
    table.withdraw("a")
    table.withdraw("b")
    young = queue_job(team, owner, gpus=4, per_node=2, priority=90)
    small = queue_job(team, owner, gpus=1, priority=10)
    table.refresh("a", ttl=60)
    table.refresh("b", ttl=60)
    # Inside the window the small job backfills next to the gang.
    assert dispatch_once(table) == [small]
    Job.objects.filter(pk=young).update(created=timezone.now() - timedelta(seconds=301))
    later = queue_job(team, owner, gpus=1, priority=10)
    assert dispatch_once(table) == []
    assert Job.objects.get(pk=later).state == JobState.QUEUED
    # The GPUs drain: the gang starts, then the small job behind it.
    assert table.release(blocker)
    small_lease = table.lease_of(small)
    assert small_lease is not None and table.release(small_lease)
    assert dispatch_once(table) == [young]
    assert Job.objects.get(pk=later).state == JobState.QUEUED


def test_a_gang_the_live_nodes_could_never_hold_reserves_nothing(
    table: GpuLockTable, offline_node: Any, team: Any, owner: Any, settings: Any
) -> None:
    settings.OPENTINKER_BACKFILL_WINDOW_SECONDS = 0
    for name in ("a", "b", "c"):
        offline_node(name, 2)
    gang = queue_job(team, owner, gpus=6, per_node=2, age_s=1000)
    small = queue_job(team, owner, gpus=1, priority=10)
    table.refresh("a", ttl=60)
    table.refresh("b", ttl=60)  # c stays down: two live nodes of two, the gang wants three
    assert dispatch_once(table) == [small]
    assert Job.objects.get(pk=gang).state == JobState.QUEUED


def test_it_refuses_at_submit_a_gang_no_set_of_nodes_could_hold(
    table: GpuLockTable, team: Any, owner: Any
) -> None:
    table.announce("a", [0, 1], ttl=60)
    table.announce("b", [0, 1, 2, 3], ttl=60)
    spec = {"method": "smoke", "gpus": 6, "gpus_per_node": 2}
    with pytest.raises(services.GpuRequestTooLarge, match="on 3 nodes, but 2 of the 2") as bad:
        services.submit_job(team=team, user=owner, spec=spec, name="gang")
    assert bad.value.field == "gpus_per_node"
    # Two nodes of two or more GPUs hold 4 as 2 + 2.
    job = services.submit_job(team=team, user=owner, spec={**spec, "gpus": 4}, name="gang")
    assert job.state == JobState.QUEUED


def _queued_tasks(client: Any, queue: str) -> list[tuple[str, dict[str, Any]]]:
    """(task name, kwargs) of the messages waiting in a Celery queue (kombu's Redis list)."""
    import base64
    import json

    out = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], body[1]))
    return out


@pytest.mark.parametrize("layout", ["one-node", "gang", "verl-gang"])
def test_a_job_of_two_gpus_gets_a_rank_per_gpu_or_a_ray_node_per_follower_node(
    layout: str,
    table: GpuLockTable,
    team: Any,
    owner: Any,
    tiny_base_model: Any,
    clean_control_plane: Any,
) -> None:
    """Native: rank 0 is the leader's `run_job`, rank 1 a `join_job` on the queue of its GPU's
    node. verl: one `join_job` per follower node (its Ray node), none on one node."""
    if layout == "one-node":
        table.announce("n", [0, 1], ttl=60)
        extra: dict[str, Any] = {}
    else:
        table.announce("a", [0], ttl=60)
        table.announce("b", [0], ttl=60)
        extra = {"gpus_per_node": 1}
    if layout == "verl-gang":
        extra["runner"] = "verl"
    spec = {
        "method": "rl",
        "env": "math",
        "dataset": "builtin:arith_train",
        "gpus": 2,
        "rollout": {"prompts_per_step": 2, "group_size": 2},
        **extra,
    }
    job = services.submit_job(team=team, user=owner, spec=spec, name="ranks")
    assert Job.objects.get(pk=job.pk).state == JobState.STARTING
    lease = table.lease_of(str(job.pk))
    assert lease is not None
    (leader_node, _), *rest = lease.blocks
    follower_node = rest[0][0] if rest else leader_node
    sent = {
        queue: _queued_tasks(clean_control_plane, f"gpu.{queue}")
        for queue in {leader_node, follower_node}
    }
    tasks = [(name, kw) for queue in sent.values() for name, kw in queue]
    assert sorted(name for name, _ in tasks) == ["workers.tasks.join_job", "workers.tasks.run_job"]
    (joined,) = [kw for name, kw in tasks if name == "workers.tasks.join_job"]
    assert (joined["rank"], joined["world"], joined["lease_token"]) == (1, 2, lease.token)
    assert joined["node"] == follower_node
    assert ("workers.tasks.join_job", joined) in sent[follower_node]
