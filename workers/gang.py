"""The members of a job across nodes: their ranks, their rendezvous and their heartbeats.

A gang lease (``GpuLockTable.allocate(..., per_node=M)``) names its members, the leader first.
The dispatcher sends ``run_job`` to the leader's node and ``join_job`` to every other member's
node; each member trains one rank per leased GPU (`ranks`). In Redis, per attempt:

- ``ot:gang:<job>:<attempt>:rendezvous`` = "host:port" of rank 0's torch.distributed store,
  written by the leader once the store listens, read by the followers;
- ``ot:gang:<job>:<attempt>:member:<rank>``: a follower's heartbeat (its pid), renewed every
  heartbeat interval with the lease's TTL, and "done" once its part ended as it should. The
  leader's `GangKeeper` renews the lease only while every follower that has joined still
  beats or is done: a member that stops otherwise loses the attempt, and the GPUs of the
  whole gang go back with the one lease;
- ``ot:gang:<job>:<attempt>:ended``: set by a verl leader before it stops the job's Ray head,
  so that a follower whose Ray node then stops knows it ended as it should.
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
    "ended",
    "followers",
    "launches_followers",
    "mark_ended",
    "publish_rendezvous",
    "ranks",
    "wait_rendezvous",
]

PREFIX = "ot:gang:"
# A member key's value once the member's part ended as it should.
DONE = "done"


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str
    gpus: tuple[int, ...]


def ranks(blocks: Sequence[tuple[str, Sequence[int]]]) -> list[Rank]:
    """One rank per GPU of the lease, the leader's first: rank 0 is the leader's first GPU."""
    out: list[Rank] = []
    for node, gpus in blocks:
        for gpu in gpus:
            out.append(Rank(len(out), node, (int(gpu),)))
    return out


def launches_followers(spec: dict[str, Any]) -> bool:
    """True for jobs whose other members run part of the job: native rl and sft (a rank per
    GPU), verl rl (a Ray node per follower node). A smoke gang exercises the lease alone and
    runs on its leader."""
    if spec.get("eval") or spec.get("method") not in ("rl", "sft"):
        return False
    return spec.get("runner", "native") in ("native", "verl")


def followers(spec: dict[str, Any], blocks: Sequence[tuple[str, Sequence[int]]]) -> list[Rank]:
    """The ``join_job`` tasks a job's lease calls for, each with its rank, node and GPUs.

    Native: one rank per GPU but rank 0 (the leader's first GPU). verl: one Ray node per
    follower node, numbered by its place among the lease's members (verl places its own
    processes on the GPUs of each Ray node)."""
    if not launches_followers(spec):
        return []
    if spec.get("runner", "native") == "verl":
        return [Rank(i, node, tuple(gpus)) for i, (node, gpus) in enumerate(blocks) if i > 0]
    return ranks(blocks)[1:]


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

    def beat(self, *, renew: bool = False) -> None:
        # The value names the rank's process, for an operator (and a test) looking for it.
        # A renewal only touches a key that is still there: once it is gone the leader has
        # cleared the gang's keys or counted this member lost, and it must not come back.
        conf.get_redis().set(self.key, str(os.getpid()), px=_ttl_ms(), xx=renew)

    def run(self) -> None:
        while not self.stopping.wait(conf.heartbeat_interval()):
            try:
                self.beat(renew=True)
            except Exception:
                log.exception("could not write the heartbeat %s", self.key)

    def stop(self, *, done: bool) -> None:
        """Stop beating. ``done``: this member's part of the attempt ended as it should (the
        leader may still be exporting): its key says so until the leader clears the gang's
        keys. Otherwise the key goes, and the leader sees the member stop."""
        self.stopping.set()
        self.join(timeout=5)
        client = conf.get_redis()
        try:
            if done:
                client.set(self.key, DONE, px=int(conf.gang_timeout() * 2000), xx=True)
            else:
                client.delete(self.key)
        except Exception:
            log.exception("could not update the heartbeat %s", self.key)


def mark_ended(job_id: str, attempt: int) -> None:
    """The leader ends the attempt's distributed part (verl: before it stops the Ray head):
    a follower whose part stops now has ended as it should."""
    conf.get_redis().set(_key(job_id, attempt, "ended"), "1", px=int(conf.gang_timeout() * 2000))


def ended(job_id: str, attempt: int) -> bool:
    return bool(conf.get_redis().exists(_key(job_id, attempt, "ended")))


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
            alive = client.get(_key(job, attempt, "member", rank)) is not None
            if alive:
                self.joined.add(rank)
            elif rank in self.joined:
                log.warning("job %s: rank %s stopped beating", job, rank)
                self.lost_rank = rank
                return False
        return super().still_held()
