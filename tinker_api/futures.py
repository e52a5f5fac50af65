"""Futures, request streams and the model-worker registry, all in Redis.

Keys (prefix ``ot:tinker:``):

- ``fut:<request_id>``      HASH ``team``, ``kind``, ``base``, ``status`` (queued | claimed |
                            done | failed), ``worker`` (who claimed it), ``json``/``proto``
                            (result bodies), ``error``/``category``; expires after the future TTL
- ``done:<request_id>``     LIST pushed once when the future ends: long polls BLPOP on it
- ``dedupe:<scope>``        STRING request id of the first request with a protocol id
                            (``model_id:seq_id`` ...): a resubmission answers the same future
- ``stream:<base>``         STREAM of requests for one base model, consumer group ``workers``
- ``worker:<base>``         STRING id of the worker serving that base model (TTL: one lease)
- ``alive:<worker_id>``     STRING refreshed by a worker's heartbeat (TTL: one lease)
- ``starting:<base>``       STRING set while a worker is being started (no second start)
- ``next:<model_id>``       STRING the next seq_id a model executes (survives its worker)
- ``epoch:<worker_id>``     STRING set by a worker when it starts: its absence tells the worker
                            that Redis lost its data (an empty restart) while it ran
- ``samples:<base>``        STRING sample and OpenAI-style requests queued or running and not
                            yet answered (backpressure)
- ``stab:<team>:<seq>``     STRING JSON ``{"tokens", "logprobs"}`` of a sequence sampled with
                            ``record_stability_info`` (StableReinforce); one day, renewed by use
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from workers import conf

PREFIX = "ot:tinker:"
GROUP = "workers"

QUEUED, CLAIMED, DONE, FAILED = "queued", "claimed", "done", "failed"
FINAL = frozenset({DONE, FAILED})


def _r() -> Any:
    return conf.get_redis()


def future_ttl() -> int:
    """How long a future's result stays retrievable (and its dedupe key valid)."""
    return conf.int_setting("OPENTINKER_TINKER_FUTURE_TTL_SECONDS", minimum=10)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------- futures


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def create(request_id: str, *, team_id: int, kind: str, base: str = "") -> None:
    key = f"{PREFIX}fut:{request_id}"
    pipe = _r().pipeline()
    pipe.hset(
        key,
        mapping={
            "team": str(team_id),
            "kind": kind,
            "base": base,
            "status": QUEUED,
            "created": f"{time.time():.3f}",
        },
    )
    pipe.expire(key, future_ttl())
    pipe.execute()


def get(request_id: str) -> dict[str, Any] | None:
    raw = _r().hgetall(f"{PREFIX}fut:{request_id}")
    if not raw:
        return None
    out: dict[str, Any] = {}
    for k, v in raw.items():
        name = _text(k)
        # Result bodies stay bytes (protobuf); everything else is text.
        out[name] = v if name in ("json", "proto") else _text(v)
    return out


# Only a queued future moves to claimed; a finished one keeps its outcome.
_CLAIM = (
    "if redis.call('HGET', KEYS[1], 'status') == 'queued' then "
    "redis.call('HSET', KEYS[1], 'status', 'claimed', 'worker', ARGV[1]) return 1 end return 0"
)


def claim_entries(base: str, worker_id: str, entries: list[tuple[Any, str]]) -> list[bool]:
    """Claim the futures of stream entries ``(entry_id, request_id)`` and acknowledge the
    entries, all in one round trip; whether each future moved from queued to claimed."""
    if not entries:
        return []
    pipe = _r().pipeline(transaction=False)
    for _entry_id, request_id in entries:
        pipe.eval(_CLAIM, 1, f"{PREFIX}fut:{request_id}", worker_id)
    pipe.xack(stream_key(base), GROUP, *(entry_id for entry_id, _rid in entries))
    return [bool(claimed) for claimed in pipe.execute()[:-1]]


def teams_of(request_ids: list[str]) -> list[int | None]:
    """The team of each of these futures (None: unknown), in one round trip."""
    pipe = _r().pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hget(f"{PREFIX}fut:{request_id}", "team")
    return [int(_text(team)) if team else None for team in pipe.execute()]


# Conditional: a future ends once (a worker and a poll that declares it lost may race). The
# done marker is pushed in the same script, so a long poll wakes one round trip after the end.
_FINISH = (
    "local s = redis.call('HGET', KEYS[1], 'status') "
    "if s == false or s == 'done' or s == 'failed' then return 0 end "
    "redis.call('HSET', KEYS[1], unpack(ARGV)) "
    "redis.call('RPUSH', KEYS[2], '1') redis.call('EXPIRE', KEYS[2], 60) return 1"
)


def _finish(request_id: str, fields: dict[str, Any]) -> bool:
    flat: list[Any] = []
    for k, v in fields.items():
        flat.extend([k, v])
    keys = (f"{PREFIX}fut:{request_id}", f"{PREFIX}done:{request_id}")
    return bool(_r().eval(_FINISH, 2, *keys, *flat))


def complete(request_id: str, *, json_body: bytes, proto_body: bytes | None = None) -> bool:
    fields: dict[str, Any] = {"status": DONE, "json": json_body}
    if proto_body is not None:
        fields["proto"] = proto_body
    return _finish(request_id, fields)


def fail(request_id: str, error: str, category: str = "server") -> bool:
    return _finish(request_id, {"status": FAILED, "error": error[:4000], "category": category})


def wait(request_id: str, timeout: float) -> None:
    """Block until the future ends or ``timeout`` passes (a long poll)."""
    if timeout <= 0:
        return
    _r().blpop([f"{PREFIX}done:{request_id}"], timeout=timeout)


def dedupe(scope: str, request_id: str) -> str | None:
    """Register ``request_id`` for a protocol id; returns the earlier request id if any."""
    key = f"{PREFIX}dedupe:{scope}"
    r = _r()
    if r.set(key, request_id, nx=True, ex=future_ttl()):
        return None
    existing = r.get(key)
    return _text(existing) if existing is not None else None


_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end"


def release_dedupe(scope: str, request_id: str) -> None:
    """Undo ``dedupe`` for a request that failed before it was queued, unless another
    request holds the protocol id by now."""
    _r().eval(_RELEASE, 1, f"{PREFIX}dedupe:{scope}", request_id)


# --------------------------------------------------------------------------- streams


def stream_key(base: str) -> str:
    return f"{PREFIX}stream:{base}"


def ensure_group(base: str) -> None:
    """Create ``base``'s stream and consumer group unless they exist (a Redis that restarted
    empty has neither)."""
    try:
        # From the stream's start, so that what was queued before the group is read too.
        _r().xgroup_create(stream_key(base), GROUP, id="0", mkstream=True)
    except Exception as exc:  # BUSYGROUP: already there
        if "BUSYGROUP" not in str(exc):
            raise


def is_nogroup(exc: Exception) -> bool:
    """Whether a Redis error says the stream or its consumer group is gone."""
    return str(exc).startswith("NOGROUP")


def enqueue(base: str, op: dict[str, Any], *, body: bytes | None = None) -> None:
    r = _r()
    key = stream_key(base)
    # The group exists before the first message, so a worker started later reads it all.
    ensure_group(base)
    if op.get("op") == "sample":
        r.incr(f"{PREFIX}samples:{base}")
    fields: dict[str, Any] = {"op": json.dumps(op)}
    if body is not None:
        fields["body"] = body
    r.xadd(key, fields)


# One round trip for a new request: the dedupe check (a protocol id seen before answers the
# earlier request id and queues nothing, unless this very request claimed it with ``dedupe``
# before writing its rows), the future, the consumer group (created with the stream, before
# the first message, so a worker started later reads it all) and the message.
_SUBMIT = (
    "if ARGV[1] ~= '' then "
    "  local earlier = redis.call('GET', KEYS[3]) "
    "  if earlier and earlier ~= ARGV[2] then return earlier end "
    "  redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[3]) "
    "end "
    "redis.call('HSET', KEYS[1], 'team', ARGV[4], 'kind', ARGV[5], 'base', ARGV[6], "
    "  'status', 'queued', 'created', ARGV[7]) "
    "redis.call('EXPIRE', KEYS[1], ARGV[3]) "
    "if redis.call('EXISTS', KEYS[2]) == 0 then "
    "  redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[10], '0', 'MKSTREAM') "
    "end "
    "if ARGV[5] == 'sample' or ARGV[5] == 'chat' then redis.call('INCR', KEYS[4]) end "
    "if ARGV[9] == '1' then redis.call('XADD', KEYS[2], '*', 'op', ARGV[8], 'body', ARGV[11]) "
    "else redis.call('XADD', KEYS[2], '*', 'op', ARGV[8]) end "
    "return ARGV[2]"
)


def submit(
    request_id: str,
    op: dict[str, Any],
    *,
    team_id: int,
    base: str,
    body: bytes | None = None,
    dedupe_scope: str | None = None,
) -> str:
    """Create the future of ``op`` and queue it on ``base``'s stream, atomically; with a
    ``dedupe_scope`` (``seq:<model>:<seq_id>``) a resubmission queues nothing and answers the
    request id of the first submission. Returns the request id that answers."""
    keys = (
        f"{PREFIX}fut:{request_id}",
        stream_key(base),
        f"{PREFIX}dedupe:{dedupe_scope or ''}",
        f"{PREFIX}samples:{base}",
    )
    args = (
        "1" if dedupe_scope else "",
        request_id,
        str(future_ttl()),
        str(team_id),
        str(op["op"]),
        base,
        f"{time.time():.3f}",
        # The worker charges the request's GPU time to its team.
        json.dumps({**op, "team": team_id}),
        "1" if body is not None else "0",
        GROUP,
        body if body is not None else b"",
    )
    return _text(_r().eval(_SUBMIT, len(keys), *keys, *args))


def queued_samples(base: str) -> int:
    value = _r().get(f"{PREFIX}samples:{base}")
    return int(value) if value else 0


def samples_answered(base: str, n: int) -> None:
    if n:
        r = _r()
        if r.decrby(f"{PREFIX}samples:{base}", n) < 0:
            r.set(f"{PREFIX}samples:{base}", 0)


def next_seq(model_id: str) -> int | None:
    """The next seq_id ``model_id`` executes; None when Redis has no record of it (a model not
    created yet, or one whose record a Redis restarted empty lost)."""
    value = _r().get(f"{PREFIX}next:{model_id}")
    return int(value) if value else None


def set_next_seq(model_id: str, seq: int) -> None:
    _r().set(f"{PREFIX}next:{model_id}", seq, ex=30 * 24 * 3600)


def submitted_seqs(model_id: str, seqs: range) -> list[int]:
    """Which of these seq_ids of ``model_id`` a request was submitted for (within the future
    TTL, as its dedupe key tells)."""
    if not seqs:
        return []
    values = _r().mget([f"{PREFIX}dedupe:seq:{model_id}:{seq}" for seq in seqs])
    return [seq for seq, value in zip(seqs, values, strict=True) if value is not None]


# --------------------------------------------------------------------------- worker registry

EPOCH_TTL = 7 * 86400


def mark_epoch(worker_id: str) -> None:
    _r().set(f"{PREFIX}epoch:{worker_id}", "1", ex=EPOCH_TTL)


def epoch_kept(worker_id: str) -> bool:
    """Whether Redis still holds what it held when ``mark_epoch`` ran (False after a restart
    that lost the data); renews the mark."""
    return bool(_r().expire(f"{PREFIX}epoch:{worker_id}", EPOCH_TTL))


def clear_epoch(worker_id: str) -> None:
    _r().delete(f"{PREFIX}epoch:{worker_id}")


def worker_of(base: str) -> str | None:
    value = _r().get(f"{PREFIX}worker:{base}")
    return _text(value) if value else None


def worker_alive(worker_id: str) -> bool:
    return bool(_r().exists(f"{PREFIX}alive:{worker_id}"))


_ACTIVE = (
    "local cur = redis.call('GET', KEYS[1]) "
    "if cur and redis.call('EXISTS', KEYS[2] .. cur) == 1 then return 1 end return 0"
)


def worker_active(base: str) -> bool:
    """Whether a live worker serves ``base`` (``worker_of`` + ``worker_alive``, one round
    trip: every submission asks)."""
    return bool(_r().eval(_ACTIVE, 2, f"{PREFIX}worker:{base}", f"{PREFIX}alive:"))


def register_worker(base: str, worker_id: str, ttl: int) -> bool:
    """Become the worker of ``base`` (or stay it); False when another live worker is."""
    script = (
        "local cur = redis.call('GET', KEYS[1]) "
        "if cur == false or cur == ARGV[1] or redis.call('EXISTS', KEYS[2] .. cur) == 0 then "
        "redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) "
        "redis.call('SET', KEYS[2] .. ARGV[1], '1', 'EX', ARGV[2]) return 1 end return 0"
    )
    return bool(
        _r().eval(script, 2, f"{PREFIX}worker:{base}", f"{PREFIX}alive:", worker_id, str(ttl))
    )


def unregister_worker(base: str, worker_id: str) -> None:
    script = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end "
        "redis.call('DEL', KEYS[2])"
    )
    _r().eval(script, 2, f"{PREFIX}worker:{base}", f"{PREFIX}alive:{worker_id}", worker_id)


def mark_starting(base: str, ttl: int) -> bool:
    return bool(_r().set(f"{PREFIX}starting:{base}", "1", nx=True, ex=ttl))


def clear_starting(base: str) -> None:
    _r().delete(f"{PREFIX}starting:{base}")


# --------------------------------------------------------------------------- stability info


STABILITY_TTL = 86400  # "can be trained on for one day after sampling", renewed by each use


def record_stability(team: str, sequence_id: str, tokens: list[int], logprobs: list[float]) -> None:
    _r().set(
        f"{PREFIX}stab:{team}:{sequence_id}",
        json.dumps({"tokens": tokens, "logprobs": logprobs}),
        ex=STABILITY_TTL,
    )


def stability(team: str, sequence_id: str) -> dict[str, list] | None:
    """What sampling recorded for a sequence of this team (None: unknown, expired or another
    team's); reading it restarts its day."""
    key = f"{PREFIX}stab:{team}:{sequence_id}"
    raw = _r().get(key)
    if raw is None:
        return None
    _r().expire(key, STABILITY_TTL)
    return json.loads(raw)
