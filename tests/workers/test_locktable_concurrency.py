"""16 processes hammer one lock table; an independent monitor proves no GPU is held twice.

The monitor does not trust the lock table: after each successful allocation the holder SETNXes
a marker per GPU in a separate key space, and deletes it before releasing. A SETNX that finds
a marker already there means two holders at once, counted as a conflict.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import uuid

PROCESSES = 16
TOTAL_OPERATIONS = 2000
NODES = {"n0": ([0, 1, 2, 3], [[0, 1], [2, 3]]), "n1": ([0, 1, 2, 3], [])}


class _IgnoresHolders:
    """A deliberately wrong allocator (GPU 0.. of n0 for everyone): the monitor's control."""

    def __init__(self, table) -> None:
        self.table = table

    def allocate(self, job_id: str, n: int, ttl: float):
        from workers.locktable import Lease

        return Lease(job_id=job_id, node="n0", gpus=tuple(range(n)), token=uuid.uuid4().hex)

    def release(self, lease) -> bool:
        return True


def _hammer(
    url: str,
    prefix: str,
    monitor: str,
    seed: int,
    operations: int,
    out: mp.Queue,
    start: object,
    broken: bool = False,
) -> None:
    import redis

    from workers.locktable import GpuLockTable

    client = redis.Redis.from_url(url)
    table = GpuLockTable(client, prefix=prefix)
    if broken:
        table = _IgnoresHolders(table)
    rng = random.Random(seed)
    held = []
    allocated = refused = conflicts = 0
    # Forked one after another on a busy machine, the first processes could finish before the
    # last start; the barrier makes all 16 contend for the pool at the same time.
    start.wait(timeout=60)
    for i in range(operations):
        if held and (rng.random() < 0.5 or len(held) >= 2):
            lease = held.pop(rng.randrange(len(held)))
            for g in lease.gpus:
                marker = f"{monitor}{lease.node}:{g}"
                if client.get(marker) == lease.token.encode():
                    client.delete(marker)
            assert table.release(lease)
            continue
        lease = table.allocate(f"p{seed}-{i}", rng.randint(1, 3), ttl=60)
        if lease is None:
            refused += 1
            continue
        allocated += 1
        for g in lease.gpus:
            if not client.set(f"{monitor}{lease.node}:{g}", lease.token, nx=True):
                conflicts += 1
                client.incr(f"{monitor}conflicts")
        held.append(lease)
    for lease in held:
        for g in lease.gpus:
            marker = f"{monitor}{lease.node}:{g}"
            if client.get(marker) == lease.token.encode():
                client.delete(marker)
        table.release(lease)
    out.put((allocated, refused, conflicts))


def _run(redis_url: str, redis_client, broken: bool) -> tuple[int, int, int, object, str]:
    tag = uuid.uuid4().hex[:10]
    prefix, monitor = f"test:{tag}:gpu:", f"test:{tag}:monitor:"
    from workers.locktable import GpuLockTable

    table = GpuLockTable(redis_client, prefix=prefix)
    for node, (gpus, groups) in NODES.items():
        table.announce(node, gpus, groups, ttl=120)

    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    per_process = TOTAL_OPERATIONS // PROCESSES
    start = ctx.Barrier(PROCESSES)
    procs = [
        ctx.Process(
            target=_hammer,
            args=(redis_url, prefix, monitor, seed, per_process, out, start, broken),
        )
        for seed in range(PROCESSES)
    ]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        conflicts = int(redis_client.get(f"{monitor}conflicts") or 0)
        assert conflicts == sum(r[2] for r in results)
        return (
            sum(r[0] for r in results),
            sum(r[1] for r in results),
            conflicts,
            table.snapshot(),
            tag,
        )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        keys = list(redis_client.scan_iter(match=f"test:{tag}:*", count=1000))
        if keys:
            redis_client.delete(*keys)


def test_it_never_hands_one_gpu_to_two_holders(redis_url: str, redis_client) -> None:
    allocated, refused, conflicts, snapshot, _ = _run(redis_url, redis_client, broken=False)
    assert conflicts == 0
    # The pool was really contended, or the test would prove nothing.
    assert allocated > 100 and refused > 100
    assert snapshot["leases"] == []
    assert all(info["held"] == {} for info in snapshot["nodes"].values())


def test_it_has_a_monitor_that_catches_double_holding(redis_url: str, redis_client) -> None:
    _, _, conflicts, _, _ = _run(redis_url, redis_client, broken=True)
    assert conflicts > 0
