"""Gangs in the GPU lock table against a real Valkey: jobs whose GPUs span nodes.

A property test drives random sequences of gang and single-node allocations, releases, renewals,
lease expiries and nodes going away across 4 nodes, and checks after every operation that no GPU
is held twice, that every lease holds all of its members (never part of a gang), that the
members' shape is what was asked for, and that an allocation is refused only when no set of live
nodes had room for it.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.locktable import GpuLockTable

NODES = {
    "n0": (list(range(4)), [[0, 1], [2, 3]]),
    "n1": (list(range(4)), []),
    "n2": (list(range(2)), []),
    "n3": (list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]]),
}


def test_a_gang_takes_its_gpus_on_distinct_nodes_under_one_lease(
    lock_table: GpuLockTable,
) -> None:
    for node, (gpus, groups) in NODES.items():
        lock_table.announce(node, gpus, groups, ttl=30)
    lease = lock_table.allocate("gang", 6, ttl=30, per_node=2)
    assert lease is not None and lease.is_gang
    assert [len(g) for _, g in lease.blocks] == [2, 2, 2]
    assert len({node for node, _ in lease.blocks}) == 3
    # The tightest nodes first: n2 has exactly two; the leader is the first member.
    assert lease.node == "n2" and lease.blocks[0] == ("n2", (0, 1))
    # Inside a node, topology as for one block: a pair of n0 stays inside one group.
    n0 = dict(lease.blocks).get("n0")
    assert n0 is None or set(n0) in ({0, 1}, {2, 3})
    assert sorted(lease.gpu_ids) == sorted(f"{n}:{g}" for n, gs in lease.blocks for g in gs)
    stored = lock_table.lease_of("gang")
    assert stored is not None and stored.blocks == lease.blocks
    assert lock_table.snapshot()["leases"][0]["members"] == [[n, list(g)] for n, g in lease.blocks]
    # Renewed and released as a whole.
    assert lock_table.renew(lease, ttl=30) is not None
    assert lock_table.release(lease)
    snapshot = lock_table.snapshot()
    assert snapshot["leases"] == [] and all(not i["held"] for i in snapshot["nodes"].values())


def test_a_gang_is_all_or_nothing(lock_table: GpuLockTable) -> None:
    lock_table.announce("a", [0, 1], ttl=30)
    lock_table.announce("b", [0, 1], ttl=30)
    # Three nodes of two: only two nodes are there; nothing is taken.
    assert lock_table.allocate("g", 6, ttl=30, per_node=2) is None
    assert lock_table.snapshot()["leases"] == []
    assert all(not i["held"] for i in lock_table.snapshot()["nodes"].values())
    # A remainder: 3 GPUs, 2 per node -> 2 on one node, 1 on the other.
    lease = lock_table.allocate("g", 3, ttl=30, per_node=2)
    assert lease is not None and sorted(len(g) for _, g in lease.blocks) == [1, 2]
    assert [len(g) for _, g in lease.blocks] == [2, 1]
    with pytest.raises(ValueError, match="per node"):
        lock_table.allocate("h", 2, ttl=30, per_node=0)


def test_an_expired_gang_is_reclaimed_whole(lock_table: GpuLockTable) -> None:
    lock_table.announce("a", [0, 1], ttl=30)
    lock_table.announce("b", [0, 1], ttl=30)
    lease = lock_table.allocate("g", 4, ttl=0.05, per_node=2)
    assert lease is not None
    time.sleep(0.1)
    (expired,) = lock_table.expired()
    assert expired.blocks == lease.blocks
    assert lock_table.reclaim(expired)
    assert all(not i["held"] for i in lock_table.snapshot()["nodes"].values())


# --- the property ---------------------------------------------------------------------------

jobs = st.sampled_from([f"j{i}" for i in range(8)])
operation = st.one_of(
    st.tuples(st.just("allocate"), jobs, st.integers(1, 10), st.none() | st.integers(1, 5)),
    st.tuples(st.just("expire"), jobs, st.integers(1, 10), st.none() | st.integers(1, 5)),
    st.tuples(st.just("release"), jobs),
    st.tuples(st.just("renew"), jobs),
    st.tuples(st.just("withdraw"), st.sampled_from(sorted(NODES))),
    st.tuples(st.just("announce"), st.sampled_from(sorted(NODES))),
)


def _free(table: GpuLockTable) -> dict[str, int]:
    """Free GPUs of each live node."""
    return {
        name: len(info["free"]) for name, info in table.snapshot()["nodes"].items() if info["alive"]
    }


def _feasible(free: dict[str, int], n: int, per: int | None) -> bool:
    per = n if per is None else min(per, n)
    k = math.ceil(n / per)
    rest = n - (k - 1) * per
    return (
        sum(1 for f in free.values() if f >= per) >= k - 1
        and sum(1 for f in free.values() if f >= rest) >= k
    )


def _check(table: GpuLockTable, asked: dict[str, tuple[int, int | None]]) -> None:
    snapshot = table.snapshot()
    leases = {le.job_id: le for le in table.leases()}
    owner: dict[tuple[str, int], str] = {}
    for job, lease in leases.items():
        n, per = asked[job]
        per = n if per is None else min(per, n)
        sizes = [len(gpus) for _, gpus in lease.blocks]
        k = math.ceil(n / per)
        assert sum(sizes) == n and len(sizes) == k, (job, lease.blocks, n, per)
        assert sizes == [per] * (k - 1) + [n - (k - 1) * per]
        assert len({node for node, _ in lease.blocks}) == k, "a gang member twice on a node"
        for node, gpus in lease.blocks:
            for g in gpus:
                assert (node, g) not in owner, f"GPU {node}:{g} held twice"
                owner[(node, g)] = job
    # The held table is exactly the union of the leases: no partial gang, no stray GPU.
    held = {
        (node, g): job
        for node, info in snapshot["nodes"].items()
        for g, job in info["held"].items()
    }
    assert held == owner


@pytest.mark.timeout(300)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(operation, min_size=1, max_size=25))
def test_random_gangs_never_double_hold_a_gpu_or_leave_a_partial_gang(
    redis_client: Any, ops: list[tuple[Any, ...]]
) -> None:
    table = GpuLockTable(redis_client, prefix=f"test:{uuid.uuid4().hex[:10]}:gpu:")
    try:
        for node, (gpus, groups) in NODES.items():
            table.announce(node, gpus, groups, ttl=60)
        asked: dict[str, tuple[int, int | None]] = {}
        for op in ops:
            kind = op[0]
            if kind in ("allocate", "expire"):
                _, job, n, per = op
                holds = table.lease_of(job) is not None
                feasible = _feasible(_free(table), n, per)
                ttl = 0.002 if kind == "expire" else 60.0
                lease = table.allocate(job, n, ttl, per_node=per)
                if holds:
                    assert lease is None, "a second lease for one job"
                else:
                    # Refused exactly when no set of live nodes had room.
                    assert (lease is not None) == feasible, (op, _free(table))
                if lease is not None:
                    asked[job] = (n, per)
                if kind == "expire" and lease is not None:
                    time.sleep(0.005)
                    expired = {le.job_id: le for le in table.expired()}
                    assert job in expired and expired[job].blocks == lease.blocks
                    assert table.reclaim(expired[job])
            elif kind == "release":
                lease = table.lease_of(op[1])
                if lease is not None:
                    assert table.release(lease)
                    assert table.lease_of(op[1]) is None
            elif kind == "renew":
                lease = table.lease_of(op[1])
                if lease is not None:
                    assert table.renew(lease, 60.0) is not None
            elif kind == "withdraw":
                table.withdraw(op[1])
            else:
                gpus, groups = NODES[op[1]]
                table.announce(op[1], gpus, groups, ttl=60)
            _check(table, asked)
    finally:
        keys = list(redis_client.scan_iter(match=f"{table.prefix}*"))
        if keys:
            redis_client.delete(*keys)
