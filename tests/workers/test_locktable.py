"""The GPU lock table against a real Valkey: allocation, topology, renew, release, expiry."""

from __future__ import annotations

import time

import pytest

from workers.locktable import GpuLockTable, Lease


def test_it_allocates_all_or_nothing_on_one_node(lock_table: GpuLockTable) -> None:
    lock_table.announce("a", [0, 1, 2], ttl=30)
    lock_table.announce("b", [0, 1], ttl=30)

    # Five GPUs exist in total but no single node has four: nothing is taken.
    assert lock_table.allocate("big", 4, ttl=30) is None
    assert lock_table.snapshot()["leases"] == []

    lease = lock_table.allocate("j1", 3, ttl=30)
    assert lease is not None and lease.node == "a" and lease.gpus == (0, 1, 2)
    assert lease.gpu_ids == ["a:0", "a:1", "a:2"]
    assert lock_table.allocate("j2", 3, ttl=30) is None
    second = lock_table.allocate("j2", 2, ttl=30)
    assert second is not None and second.node == "b"


def test_it_prefers_the_tightest_node_that_fits(lock_table: GpuLockTable) -> None:
    lock_table.announce("big", list(range(8)), ttl=30)
    lock_table.announce("small", [0, 1], ttl=30)
    # A one-GPU job goes to the small node and keeps the 8-GPU node whole for a big job.
    lease = lock_table.allocate("one", 1, ttl=30)
    assert lease is not None and lease.node == "small"
    assert lock_table.allocate("eight", 8, ttl=30) is not None


def test_it_keeps_a_block_inside_one_topology_group(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]], ttl=30)
    first = lock_table.allocate("a", 1, ttl=30)
    assert first is not None and first.gpus == (0,)
    # Three GPUs of group 0 are left: a 3-GPU job fits there, not across the groups.
    second = lock_table.allocate("b", 3, ttl=30)
    assert second is not None and second.gpus == (1, 2, 3)
    third = lock_table.allocate("c", 2, ttl=30)
    assert third is not None and set(third.gpus) <= {4, 5, 6, 7}
    assert lock_table.release(first)
    # Two GPUs free in group 1 plus GPU 0: a 3-GPU job must span, taking the fuller group first.
    fourth = lock_table.allocate("d", 3, ttl=30)
    assert fourth is not None and len(set(fourth.gpus) & {4, 5, 6, 7}) == 2 and 0 in fourth.gpus


def test_it_picks_the_smallest_group_that_fits(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1, 2, 3, 4, 5], [[0, 1, 2, 3], [4, 5]], ttl=30)
    lease = lock_table.allocate("pair", 2, ttl=30)
    assert lease is not None and lease.gpus == (4, 5)


def test_it_renews_and_releases_only_with_the_right_token(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1], ttl=30)
    lease = lock_table.allocate("job", 2, ttl=5)
    assert lease is not None
    forged = Lease(job_id="job", node="n", gpus=(0, 1), token="not-the-token")
    assert lock_table.renew(forged, ttl=60) is None
    assert lock_table.release(forged) is False
    assert lock_table.allocate("other", 1, ttl=5) is None

    new_expiry = lock_table.renew(lease, ttl=60)
    assert new_expiry is not None and new_expiry > lease.expires_at
    assert lock_table.release(lease) is True
    assert lock_table.release(lease) is False  # idempotent
    assert lock_table.renew(lease, ttl=60) is None
    assert lock_table.snapshot()["nodes"]["n"]["free"] == [0, 1]


def test_it_gives_a_job_one_lease_at_a_time(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1, 2, 3], ttl=30)
    assert lock_table.allocate("job", 1, ttl=30) is not None
    assert lock_table.allocate("job", 1, ttl=30) is None


def test_it_lists_and_reclaims_expired_leases(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1, 2], ttl=30)
    short = lock_table.allocate("short", 1, ttl=0.2)
    long = lock_table.allocate("long", 1, ttl=30)
    assert short is not None and long is not None
    time.sleep(0.3)
    expired = lock_table.expired()
    assert [le.job_id for le in expired] == ["short"]
    assert lock_table.reclaim(long) is False  # not expired: the reaper must not take it
    assert lock_table.reclaim(expired[0]) is True
    assert lock_table.expired() == []
    assert lock_table.snapshot()["nodes"]["n"]["free"] == [0, 2]


def test_it_tells_job_leases_from_service_leases(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1], ttl=30)
    job = lock_table.allocate("0b6f3c1e-54a8-4a8e-9d3e-2f0c9a4d7e11", 1, ttl=0.1)
    worker = lock_table.allocate("tinker:tiny:e88948c5", 1, ttl=0.1)
    assert job is not None and worker is not None
    time.sleep(0.2)
    # The reaper reads the holders back from Redis: the kind must survive the round trip.
    kinds = {le.job_id: le.is_job for le in lock_table.expired()}
    assert kinds == {job.job_id: True, "tinker:tiny:e88948c5": False}


def test_it_lets_a_renewal_beat_the_reaper(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0], ttl=30)
    lease = lock_table.allocate("job", 1, ttl=0.1)
    assert lease is not None
    time.sleep(0.2)
    seen = lock_table.expired()
    assert [le.job_id for le in seen] == ["job"]
    assert lock_table.renew(lease, ttl=30) is not None
    assert lock_table.reclaim(seen[0]) is False
    assert lock_table.lease_of("job") is not None


def test_it_allocates_nothing_on_a_dead_node(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1], ttl=0.2)
    time.sleep(0.3)
    assert lock_table.allocate("job", 1, ttl=30) is None
    assert lock_table.nodes()["n"]["alive"] is False
    assert lock_table.refresh("n", ttl=30) is True
    assert lock_table.allocate("job", 1, ttl=30) is not None
    lock_table.withdraw("n")
    assert lock_table.allocate("job2", 1, ttl=30) is None
    assert lock_table.refresh("never-announced", ttl=30) is False


def test_it_force_releases_a_job_without_its_token(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1], ttl=30)
    lease = lock_table.allocate("job", 2, ttl=30)
    assert lease is not None
    assert lock_table.release_job("job") is True
    assert lock_table.release_job("job") is False
    assert lock_table.release(lease) is False
    assert lock_table.lease_of("job") is None


@pytest.mark.parametrize(
    ("gpus", "groups", "message"),
    [
        ([], [], "at least one"),
        ([0, 0], [], "distinct"),
        ([-1], [], "non-negative"),
        ([0, 1], [[0, 2]], "not announced"),
        ([0, 1, 2], [[0, 1], [1, 2]], "overlap"),
    ],
)
def test_it_rejects_a_bad_inventory(
    lock_table: GpuLockTable, gpus: list[int], groups: list[list[int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        lock_table.announce("n", gpus, groups, ttl=30)


def test_it_rejects_bad_allocation_arguments(lock_table: GpuLockTable) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        lock_table.allocate("job", 0, ttl=30)
    with pytest.raises(ValueError, match="TTL"):
        lock_table.allocate("job", 1, ttl=0)
    with pytest.raises(ValueError, match="':'"):
        lock_table.announce("a:b", [0], ttl=30)


def test_it_lets_a_cancel_take_only_an_unstarted_lease(lock_table: GpuLockTable) -> None:
    lock_table.announce("n", [0, 1], ttl=30)
    waiting = lock_table.allocate("waiting", 1, ttl=30)
    running = lock_table.allocate("running", 1, ttl=30)
    assert waiting is not None and running is not None
    assert lock_table.renew(running, ttl=30, start=True) is not None
    assert lock_table.lease_of("running").started is True

    assert lock_table.release_unstarted("running") is False
    assert lock_table.release_unstarted("waiting") is True
    # The runner that arrives late finds its lease gone and must not start.
    assert lock_table.renew(waiting, ttl=30, start=True) is None
    assert lock_table.release(running) is True


def test_it_places_no_more_jobs_on_a_node_than_its_worker_can_run(
    lock_table: GpuLockTable,
) -> None:
    lock_table.announce("n", [0, 1, 2, 3], ttl=30, max_jobs=2)
    assert lock_table.nodes()["n"]["max_jobs"] == 2
    first = lock_table.allocate("a", 1, ttl=30)
    assert first is not None and lock_table.allocate("b", 2, ttl=30) is not None
    assert lock_table.allocate("c", 1, ttl=30) is None  # GPUs free, but no process to run it
    assert lock_table.release(first)
    assert lock_table.allocate("c", 1, ttl=30) is not None
