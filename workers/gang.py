"""The members of a job across nodes: their ranks, their rendezvous and their heartbeats.

A gang lease (``GpuLockTable.allocate(..., per_node=M)``) names its members, the leader first.
The dispatcher sends ``run_job`` to the leader's node and ``join_job`` to every other member's
node; each member trains one rank per leased GPU (`ranks`). In Redis, per attempt:

- ``ot:gang:<job>:<attempt>:rendezvous`` = "host:port" of rank 0's torch.distributed store,
  written by the leader once the store listens, read by the followers;
- ``ot:gang:<job>:<attempt>:member:<rank>``: a follower's heartbeat, renewed every heartbeat
  interval with the lease's TTL. The leader's `GangKeeper` renews the lease only while every
  follower that has joined still beats: a member that stops loses the attempt, and the GPUs
  of the whole gang go back with the one lease.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers import conf
from workers.leases import LeaseKeeper
from workers.locktable import GpuLockTable, Lease

log = logging.getLogger(__name__)

__all__ = [
    "GangKeeper",
    "MemberBeat",
    "Rank",
    "launches_followers",
    "publish_rendezvous",
    "ranks",
    "wait_rendezvous",
]

PREFIX = "ot:gang:"


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str
    gpu: int


def ranks(blocks: Sequence[tuple[str, Sequence[int]]]) -> list[Rank]:
    """One rank per GPU of the lease, the leader's first: rank 0 is the leader's first GPU."""
    out: list[Rank] = []
    for node, gpus in blocks:
        for gpu in gpus:
            out.append(Rank(len(out), node, int(gpu)))
    return out


def launches_followers(spec: dict[str, Any]) -> bool:
    """True for jobs whose followers train ranks (native rl and sft); a smoke gang exercises
    the lease alone and runs on its leader."""
    return (
        spec.get("method") in ("rl", "sft")
        and spec.get("runner", "native") == "native"
        and not spec.get("eval")
    )


def _key(job_id: str, attempt: int, *parts: object) -> str:
    return ":".join([f"{PREFIX}{job_id}", str(attempt), *map(str, parts)])


def _ttl_ms() -> int:
    return int(conf.lease_seconds() * 1000)


def publish_rendezvous(job_id: str, attempt: int, address: str) -> None:
    # Outlives the rendezvous wait of every follower; gone with the attempt's keys at the end.
    conf.get_redis().set(
        _key(job_id, attempt, "rendezvous"), address, px=int(conf.gang_timeout() * 2000)
    )


def wait_rendezvous(
    job_id: str, attempt: int, *, timeout_s: float, still_wanted: Callable[[], bool]
) -> str | None:
    """Rank 0's "host:port", once the leader has published it; None if it never does within
    ``timeout_s`` or ``still_wanted()`` turns False (the attempt is over)."""
    client = conf.get_redis()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = client.get(_key(job_id, attempt, "rendezvous"))
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        if not still_wanted():
            return None
        time.sleep(0.2)
    return None


def clear(job_id: str, attempt: int) -> None:
    client = conf.get_redis()
    keys = list(client.scan_iter(match=_key(job_id, attempt, "*"), count=100))
    if keys:
        client.delete(*keys)


class MemberBeat(threading.Thread):
    """A follower's heartbeat: its member key, renewed until `stop`."""

    def __init__(self, job_id: str, attempt: int, rank: int) -> None:
        super().__init__(name=f"gang-{job_id}-{rank}", daemon=True)
        self.key = _key(job_id, attempt, "member", rank)
        self.stopping = threading.Event()

    def beat(self) -> None:
        # The value names the rank's process, for an operator (and a test) looking for it.
        conf.get_redis().set(self.key, str(os.getpid()), px=_ttl_ms())

    def run(self) -> None:
        while not self.stopping.wait(conf.heartbeat_interval()):
            try:
                self.beat()
            except Exception:
                log.exception("could not write the heartbeat %s", self.key)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)
        try:
            conf.get_redis().delete(self.key)
        except Exception:
            log.exception("could not remove the heartbeat %s", self.key)


class GangKeeper(LeaseKeeper):
    """The leader's lease keeper: renews the gang's lease while every follower that joined
    still beats; one that stopped loses the attempt (``on_lost``)."""

    def __init__(
        self,
        table: GpuLockTable,
        lease: Lease,
        on_lost: Callable[[], object],
        *,
        attempt: int,
        follower_ranks: Sequence[int],
    ) -> None:
        super().__init__(table, lease, on_lost)
        self.attempt = attempt
        self.follower_ranks = list(follower_ranks)
        self.joined: set[int] = set()
        self.lost_rank: int | None = None

    def still_held(self) -> bool:
        client = conf.get_redis()
        job, attempt = self.lease.job_id, self.attempt
        for rank in self.follower_ranks:
            alive = bool(client.exists(_key(job, attempt, "member", rank)))
            if alive:
                self.joined.add(rank)
            elif rank in self.joined:
                log.warning("job %s: rank %s stopped beating", job, rank)
                self.lost_rank = rank
                return False
        return super().still_held()
