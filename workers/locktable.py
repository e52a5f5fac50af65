"""The GPU lock table: Redis is the single authority on which job holds which GPU.

Layout (every key under one prefix, ``ot:gpu:`` by default):

- ``nodes``                SET of node names ever announced
- ``node:<node>``          HASH ``gpus`` (JSON list of indices), ``groups`` (JSON list of lists:
                           GPUs sharing a NUMA node / PCIe switch), ``kind`` (``gpu`` or ``cpu``),
                           optional ``max_jobs`` (jobs its worker can run at once)
- ``alive:<node>``         STRING with a TTL, refreshed by the node's worker; a node without it
                           gets no new allocations (its inventory stays known for sizing)
- ``held:<node>``          HASH gpu index -> job id
- ``lease:<job>``          HASH ``node``, ``gpus`` (JSON), ``token``, ``expires_ms``, and for a
                           gang ``members`` (JSON list of ``[node, [gpus]]``, the leader first;
                           ``node``/``gpus`` are the leader's)
- ``leases``               ZSET job id scored by lease expiry (ms, Redis server clock)

Each mutation is one Lua script, so allocation is all-or-nothing and two allocators can never
take the same GPU. A *gang* (a job across nodes: ``allocate(..., per_node=M)``) takes all its
GPUs on ``ceil(N/M)`` distinct live nodes in one script or none, under one lease that renews,
expires and is released as a whole. Expiry uses the Redis server's clock (``TIME``) only, so
workers with skewed clocks agree. The scripts build key names from the prefix, which ties the
table to a single Redis (not a cluster); a control plane of one Redis is the design.
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_PREFIX", "GpuLockTable", "Lease", "is_job_id"]

DEFAULT_PREFIX = "ot:gpu:"

# Chooses GPUs for one job: N GPUs on ceil(N/M) distinct nodes, M on each but the last (which
# takes the rest); M = N is one node. Members are chosen one after the other, each on the best
# node left. Node preference, in order: the member's block fits inside one topology group; the
# node has the fewest free GPUs that still fit (best fit keeps large free nodes for large
# jobs); then the name, for determinism. Inside a node: the smallest group that fits, else the
# groups with the most free GPUs first (span as few groups as possible).
_ALLOCATE = r"""
local P, job, total, per, ttl, token = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]),
                                       tonumber(ARGV[5]), ARGV[6]
if redis.call('EXISTS', P .. 'lease:' .. job) == 1 then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function pick(free_set, gpus, groups, n)
  -- Returns chosen GPU list and whether it lies inside one group.
  local grouped, buckets = {}, {}
  for _, grp in ipairs(groups) do
    local b = {}
    for _, g in ipairs(grp) do
      grouped[g] = true
      if free_set[g] then b[#b + 1] = g end
    end
    buckets[#buckets + 1] = b
  end
  local rest = {}
  for _, g in ipairs(gpus) do
    if free_set[g] and not grouped[g] then rest[#rest + 1] = g end
  end
  if #rest > 0 then buckets[#buckets + 1] = rest end
  local best = nil
  for _, b in ipairs(buckets) do
    if #b >= n and (best == nil or #b < #best) then best = b end
  end
  if best ~= nil then
    table.sort(best)
    local chosen = {}
    for i = 1, n do chosen[i] = best[i] end
    return chosen, true, #best
  end
  table.sort(buckets, function(a, b) return #a > #b end)
  local chosen = {}
  for _, b in ipairs(buckets) do
    table.sort(b)
    for _, g in ipairs(b) do
      if #chosen < n then chosen[#chosen + 1] = g end
    end
  end
  return chosen, false, 0
end

local nodes = redis.call('SMEMBERS', P .. 'nodes')
table.sort(nodes)
local infos = {}
for _, node in ipairs(nodes) do
  if redis.call('EXISTS', P .. 'alive:' .. node) == 1 then
    local inv = redis.call('HMGET', P .. 'node:' .. node, 'gpus', 'groups', 'max_jobs')
    if inv[1] then
      local gpus = cjson.decode(inv[1])
      local groups = {}
      if inv[2] then groups = cjson.decode(inv[2]) end
      local held = redis.call('HGETALL', P .. 'held:' .. node)
      local held_set, jobs, njobs = {}, {}, 0
      for i = 1, #held, 2 do
        held_set[tonumber(held[i])] = true
        if not jobs[held[i + 1]] then jobs[held[i + 1]] = true; njobs = njobs + 1 end
      end
      local free_set, nfree = {}, 0
      for _, g in ipairs(gpus) do
        if not held_set[g] then free_set[g] = true; nfree = nfree + 1 end
      end
      -- A node runs at most max_jobs jobs at once (its worker's pool size).
      local room = (not inv[3]) or njobs < tonumber(inv[3])
      if room then
        infos[#infos + 1] = {name = node, gpus = gpus, groups = groups, free = free_set,
                             nfree = nfree}
      end
    end
  end
end

local k = math.ceil(total / per)
local members, used = {}, {}
for m = 1, k do
  local need = per
  if m == k then need = total - (k - 1) * per end
  local best_i, best_chosen, best_key = nil, nil, nil
  for i, info in ipairs(infos) do
    if not used[i] and info.nfree >= need then
      local chosen, in_group, group_free = pick(info.free, info.gpus, info.groups, need)
      local key = {in_group and 0 or 1, info.nfree, group_free}
      local better = best_key == nil
      if not better then
        for j = 1, 3 do
          if key[j] ~= best_key[j] then better = key[j] < best_key[j]; break end
        end
      end
      if better then best_i, best_chosen, best_key = i, chosen, key end
    end
  end
  if best_i == nil then return {0} end
  used[best_i] = true
  members[m] = {infos[best_i].name, best_chosen}
end

for _, member in ipairs(members) do
  for _, g in ipairs(member[2]) do
    redis.call('HSET', P .. 'held:' .. member[1], tostring(g), job)
  end
end
local expires = now + ttl
local members_json = cjson.encode(members)
redis.call('HSET', P .. 'lease:' .. job, 'node', members[1][1],
           'gpus', cjson.encode(members[1][2]), 'token', token,
           'expires_ms', tostring(expires))
if k > 1 then redis.call('HSET', P .. 'lease:' .. job, 'members', members_json) end
redis.call('ZADD', P .. 'leases', expires, job)
return {1, members_json, tostring(expires)}
"""

# With start = '1' the holder also marks the lease as started: from then on a cancel can no
# longer take the lease away (see mode 'unstarted' below) and must wait for the runner.
_RENEW = r"""
local P, job, token, ttl, start = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
if redis.call('HGET', P .. 'lease:' .. job, 'token') ~= token then return 0 end
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
redis.call('HSET', P .. 'lease:' .. job, 'expires_ms', tostring(expires))
if start == '1' then redis.call('HSET', P .. 'lease:' .. job, 'started', '1') end
redis.call('ZADD', P .. 'leases', expires, job)
return expires
"""

# Puts back a lease that is gone from the table (a Redis that restarted empty lost it) for a
# holder still running on its GPUs, unless another lease took one of them meanwhile.
_REINSTATE = r"""
local P, job, token, ttl, members_json = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
if redis.call('EXISTS', P .. 'lease:' .. job) == 1 then return 0 end
local members = cjson.decode(members_json)
for _, member in ipairs(members) do
  for _, g in ipairs(member[2]) do
    local holder = redis.call('HGET', P .. 'held:' .. member[1], tostring(g))
    if holder and holder ~= job then return 0 end
  end
end
for _, member in ipairs(members) do
  for _, g in ipairs(member[2]) do
    redis.call('HSET', P .. 'held:' .. member[1], tostring(g), job)
  end
end
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
redis.call('HSET', P .. 'lease:' .. job, 'node', members[1][1],
           'gpus', cjson.encode(members[1][2]), 'token', token,
           'expires_ms', tostring(expires), 'started', '1')
if #members > 1 then redis.call('HSET', P .. 'lease:' .. job, 'members', members_json) end
redis.call('ZADD', P .. 'leases', expires, job)
return expires
"""

# mode "token": the holder releases; "expired": the reaper reclaims only a lease that is still
# expired with the token it saw (a renewal in between wins); "force": the control plane;
# "unstarted": a cancel takes the lease only while no runner has started on it.
_RELEASE = r"""
local P, job, token, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease = redis.call('HMGET', P .. 'lease:' .. job, 'token', 'node', 'gpus', 'expires_ms',
                         'started', 'members')
if not lease[1] then return 0 end
if (mode == 'token' or mode == 'expired') and lease[1] ~= token then return 0 end
if mode == 'unstarted' and lease[5] == '1' then return 0 end
if mode == 'expired' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if tonumber(lease[4]) > now then return 0 end
end
local members = {{lease[2], cjson.decode(lease[3])}}
if lease[6] then members = cjson.decode(lease[6]) end
for _, member in ipairs(members) do
  local key = P .. 'held:' .. member[1]
  for _, g in ipairs(member[2]) do
    if redis.call('HGET', key, tostring(g)) == job then redis.call('HDEL', key, tostring(g)) end
  end
end
redis.call('DEL', P .. 'lease:' .. job)
redis.call('ZREM', P .. 'leases', job)
return 1
"""


@dataclass(frozen=True)
class Lease:
    """A job's hold on a block of GPUs of one node, or of several (a gang). ``token`` proves
    ownership."""

    job_id: str
    node: str
    gpus: tuple[int, ...]
    token: str
    expires_at: float = 0.0  # seconds since the epoch, Redis server clock
    started: bool = False
    members: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """A gang's ``(node, gpus)`` per node, the leader (``node``, ``gpus``) first; empty for
    a job on one node."""

    @property
    def blocks(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(node, gpus)`` of every node the lease holds GPUs on, the leader first."""
        return self.members or ((self.node, self.gpus),)

    @property
    def is_gang(self) -> bool:
        return len(self.blocks) > 1

    @property
    def is_job(self) -> bool:
        """Whether the holder is a job (its id is the job's UUID). Services hold blocks too,
        under names of their own (a Tinker model worker is ``tinker:<base>:<suffix>``), and
        have no job row to requeue or audit."""
        return is_job_id(self.job_id)

    @property
    def gpu_ids(self) -> list[str]:
        """The ``"node:index"`` names the job records store (every member's)."""
        return [f"{node}:{g}" for node, gpus in self.blocks for g in gpus]


def is_job_id(holder: str) -> bool:
    try:
        uuid.UUID(holder)
    except ValueError:
        return False
    return True


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _members(raw: list[Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(node), tuple(int(g) for g in gpus)) for node, gpus in raw)


def _validate_inventory(
    gpus: list[int], groups: list[list[int]]
) -> tuple[list[int], list[list[int]]]:
    if not isinstance(gpus, (list, tuple)) or not gpus:
        raise ValueError("a node must announce at least one GPU (or CPU slot)")
    clean = []
    for g in gpus:
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"GPU indices must be non-negative integers, got {g!r}")
        clean.append(int(g))
    if len(set(clean)) != len(clean):
        raise ValueError(f"GPU indices must be distinct, got {clean}")
    seen: set[int] = set()
    clean_groups = []
    for grp in groups or []:
        members = [int(g) for g in grp]
        unknown = set(members) - set(clean)
        if unknown:
            raise ValueError(
                f"topology group {members} names GPUs not announced: {sorted(unknown)}"
            )
        if seen & set(members):
            raise ValueError(f"topology groups overlap on GPUs {sorted(seen & set(members))}")
        seen |= set(members)
        if members:
            clean_groups.append(sorted(members))
    return sorted(clean), clean_groups


class GpuLockTable:
    """All-or-nothing GPU allocation with leases, on one Redis."""

    def __init__(self, redis: Any, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix.endswith(":"):
            raise ValueError("the key prefix must end with ':'")
        self.redis = redis
        self.prefix = prefix
        self._allocate = redis.register_script(_ALLOCATE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._reinstate = redis.register_script(_REINSTATE)

    # --- inventory ------------------------------------------------------------------------

    def announce(
        self,
        node: str,
        gpus: list[int],
        groups: list[list[int]] | None = None,
        *,
        kind: str = "gpu",
        ttl: float = 30.0,
        max_jobs: int | None = None,
    ) -> None:
        """Publish (or replace) a node's inventory and mark it alive for ``ttl`` seconds.

        ``max_jobs`` caps how many jobs the node runs at once (its worker's pool size): a job
        placed beyond it would wait in the node's queue while its lease ran out.
        """
        if not node or ":" in node:
            raise ValueError(f"node name {node!r} must be non-empty and contain no ':'")
        if kind not in ("gpu", "cpu"):
            raise ValueError(f"kind must be 'gpu' or 'cpu', got {kind!r}")
        if max_jobs is not None and (isinstance(max_jobs, bool) or max_jobs < 1):
            raise ValueError(f"max_jobs must be a positive integer, got {max_jobs!r}")
        gpus, groups = _validate_inventory(list(gpus), list(groups or []))
        p = self.prefix
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(
            f"{p}node:{node}",
            mapping={"gpus": json.dumps(gpus), "groups": json.dumps(groups), "kind": kind},
        )
        if max_jobs is None:
            pipe.hdel(f"{p}node:{node}", "max_jobs")
        else:
            pipe.hset(f"{p}node:{node}", "max_jobs", int(max_jobs))
        pipe.sadd(f"{p}nodes", node)
        pipe.set(f"{p}alive:{node}", "1", px=max(1, int(ttl * 1000)))
        pipe.execute()

    def refresh(self, node: str, ttl: float) -> bool:
        """Keep a node alive; False if its inventory is unknown (announce it again)."""
        if not self.redis.exists(f"{self.prefix}node:{node}"):
            return False
        self.redis.set(f"{self.prefix}alive:{node}", "1", px=max(1, int(ttl * 1000)))
        return True

    def withdraw(self, node: str) -> None:
        """Stop new allocations on a node (its worker is shutting down). Leases stay."""
        self.redis.delete(f"{self.prefix}alive:{node}")

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Every known node: its gpus, groups, kind and whether it is alive."""
        p = self.prefix
        names = sorted(_decode(n) for n in self.redis.smembers(f"{p}nodes"))
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            raw = self.redis.hgetall(f"{p}node:{name}")
            if not raw:
                continue
            inv = {_decode(k): _decode(v) for k, v in raw.items()}
            out[name] = {
                "gpus": json.loads(inv.get("gpus", "[]")),
                "groups": json.loads(inv.get("groups", "[]")),
                "kind": inv.get("kind", "gpu"),
                "max_jobs": int(inv["max_jobs"]) if "max_jobs" in inv else None,
                "alive": bool(self.redis.exists(f"{p}alive:{name}")),
            }
        return out

    # --- leases ---------------------------------------------------------------------------

    def allocate(
        self, job_id: str, n: int, ttl: float, *, per_node: int | None = None
    ) -> Lease | None:
        """Take ``n`` GPUs for ``job_id``, or nothing: on one live node, or with ``per_node``
        (a gang) ``per_node`` on each of ``ceil(n / per_node)`` distinct live nodes, the last
        taking the rest.

        None when no set of live nodes has them free right now, or when the job already
        holds a lease (one lease per job: a requeued job gets a new one only after the old
        is gone).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"number of GPUs must be a positive integer, got {n!r}")
        per = n if per_node is None else per_node
        if isinstance(per, bool) or not isinstance(per, int) or per < 1:
            raise ValueError(f"GPUs per node must be a positive integer, got {per_node!r}")
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl!r}")
        token = secrets.token_hex(16)
        result = self._allocate(
            keys=[], args=[self.prefix, str(job_id), n, min(per, n), int(ttl * 1000), token]
        )
        if int(result[0]) != 1:
            return None
        members = _members(json.loads(_decode(result[1])))
        return Lease(
            job_id=str(job_id),
            node=members[0][0],
            gpus=members[0][1],
            token=token,
            expires_at=int(_decode(result[2])) / 1000.0,
            members=members if len(members) > 1 else (),
        )

    def renew(self, lease: Lease, ttl: float, *, start: bool = False) -> float | None:
        """Extend a lease held with ``lease.token``; the new expiry, or None if it was lost.

        ``start=True`` (the runner's first renewal) also marks the lease as started.
        """
        expires = self._renew(
            keys=[],
            args=[self.prefix, lease.job_id, lease.token, int(ttl * 1000), "1" if start else "0"],
        )
        return int(expires) / 1000.0 if int(expires) else None

    def reinstate(self, lease: Lease, ttl: float) -> float | None:
        """Put back ``lease`` (as started) when the table no longer has it, as after a Redis
        restart that lost its data, for a holder that still runs on its GPUs; the new expiry,
        or None when the lease is still there (``renew`` it) or another lease holds one of
        its GPUs by now."""
        members = lease.members or ((lease.node, lease.gpus),)
        expires = self._reinstate(
            keys=[],
            args=[
                self.prefix,
                lease.job_id,
                lease.token,
                int(ttl * 1000),
                json.dumps([[node, list(gpus)] for node, gpus in members]),
            ],
        )
        return int(expires) / 1000.0 if int(expires) else None

    def release(self, lease: Lease) -> bool:
        """Give the GPUs back. Idempotent; True only for the call that actually released."""
        return bool(self._release(keys=[], args=[self.prefix, lease.job_id, lease.token, "token"]))

    def reclaim(self, lease: Lease) -> bool:
        """Release ``lease`` only if it is still expired and unchanged (the reaper's release)."""
        return bool(
            self._release(keys=[], args=[self.prefix, lease.job_id, lease.token, "expired"])
        )

    def release_job(self, job_id: str) -> bool:
        """Release whatever lease ``job_id`` holds, without its token (cancel of a queued task)."""
        return bool(self._release(keys=[], args=[self.prefix, str(job_id), "", "force"]))

    def release_unstarted(self, job_id: str) -> bool:
        """Release ``job_id``'s lease only if no runner has started on it (cancel of a job
        whose task still waits in the queue). False once the runner has started."""
        return bool(self._release(keys=[], args=[self.prefix, str(job_id), "", "unstarted"]))

    def lease_of(self, job_id: str) -> Lease | None:
        raw = self.redis.hgetall(f"{self.prefix}lease:{job_id}")
        return self._lease_from(str(job_id), raw)

    def leases(self) -> list[Lease]:
        jobs = [_decode(j) for j in self.redis.zrange(f"{self.prefix}leases", 0, -1)]
        return self._load(jobs)

    def expired(self, now: float | None = None) -> list[Lease]:
        """Leases whose expiry is at or before ``now`` (default: the Redis server clock)."""
        if now is None:
            secs, micros = self.redis.time()
            now = secs + micros / 1e6
        jobs = self.redis.zrangebyscore(f"{self.prefix}leases", "-inf", int(now * 1000))
        return self._load([_decode(j) for j in jobs])

    def snapshot(self) -> dict[str, Any]:
        """Nodes with their free and held GPUs, and every lease: for admin pages and tests."""
        nodes = self.nodes()
        for name, info in nodes.items():
            held = self.redis.hgetall(f"{self.prefix}held:{name}")
            info["held"] = {int(_decode(k)): _decode(v) for k, v in held.items()}
            info["free"] = [g for g in info["gpus"] if g not in info["held"]]
        return {
            "nodes": nodes,
            "leases": [
                {
                    "job_id": le.job_id,
                    "node": le.node,
                    "gpus": list(le.gpus),
                    "members": [[node, list(gpus)] for node, gpus in le.blocks],
                    "expires_at": le.expires_at,
                }
                for le in self.leases()
            ],
        }

    def _load(self, jobs: list[str]) -> list[Lease]:
        if not jobs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hgetall(f"{self.prefix}lease:{job}")
        out = []
        for job, raw in zip(jobs, pipe.execute()):
            lease = self._lease_from(job, raw)
            if lease is not None:
                out.append(lease)
        return out

    @staticmethod
    def _lease_from(job_id: str, raw: dict[Any, Any]) -> Lease | None:
        if not raw:
            return None
        data = {_decode(k): _decode(v) for k, v in raw.items()}
        return Lease(
            job_id=job_id,
            node=data["node"],
            gpus=tuple(int(g) for g in json.loads(data["gpus"])),
            token=data["token"],
            expires_at=int(data["expires_ms"]) / 1000.0,
            started=data.get("started") == "1",
            members=_members(json.loads(data["members"])) if "members" in data else (),
        )
