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
- ``samples:<base>``        STRING sample requests queued and not yet answered (backpressure)
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
    return conf._int_setting("OPENTINKER_TINKER_FUTURE_TTL_SECONDS", 3600, minimum=10)


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


def claim(request_id: str, worker_id: str) -> None:
    key = f"{PREFIX}fut:{request_id}"
    # Only a queued future moves to claimed; a finished one keeps its outcome.
    script = (
        "if redis.call('HGET', KEYS[1], 'status') == 'queued' then "
        "redis.call('HSET', KEYS[1], 'status', 'claimed', 'worker', ARGV[1]) return 1 end return 0"
    )
    _r().eval(script, 1, key, worker_id)


def _finish(request_id: str, fields: dict[str, Any]) -> bool:
    key = f"{PREFIX}fut:{request_id}"
    r = _r()
    # Conditional: a future ends once (a worker and a poll that declares it lost may race).
    script = (
        "local s = redis.call('HGET', KEYS[1], 'status') "
        "if s == false or s == 'done' or s == 'failed' then return 0 end "
        "redis.call('HSET', KEYS[1], unpack(ARGV)) return 1"
    )
    flat: list[Any] = []
    for k, v in fields.items():
        flat.extend([k, v])
    if not r.eval(script, 1, key, *flat):
        return False
    done = f"{PREFIX}done:{request_id}"
    pipe = r.pipeline()
    pipe.rpush(done, "1")
    pipe.expire(done, 60)
    pipe.execute()
    return True


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


# --------------------------------------------------------------------------- streams


def stream_key(base: str) -> str:
    return f"{PREFIX}stream:{base}"


def enqueue(base: str, op: dict[str, Any], *, body: bytes | None = None) -> None:
    r = _r()
    key = stream_key(base)
    try:
        # The group exists before the first message, so a worker started later reads it all.
        r.xgroup_create(key, GROUP, id="0", mkstream=True)
    except Exception as exc:  # BUSYGROUP: already there
        if "BUSYGROUP" not in str(exc):
            raise
    if op.get("op") == "sample":
        r.incr(f"{PREFIX}samples:{base}")
    fields: dict[str, Any] = {"op": json.dumps(op)}
    if body is not None:
        fields["body"] = body
    r.xadd(key, fields)


def queued_samples(base: str) -> int:
    value = _r().get(f"{PREFIX}samples:{base}")
    return int(value) if value else 0


def samples_answered(base: str, n: int) -> None:
    if n:
        r = _r()
        if r.decrby(f"{PREFIX}samples:{base}", n) < 0:
            r.set(f"{PREFIX}samples:{base}", 0)


def next_seq(model_id: str) -> int:
    value = _r().get(f"{PREFIX}next:{model_id}")
    return int(value) if value else 0


def set_next_seq(model_id: str, seq: int) -> None:
    _r().set(f"{PREFIX}next:{model_id}", seq, ex=30 * 24 * 3600)


# --------------------------------------------------------------------------- worker registry


def worker_of(base: str) -> str | None:
    value = _r().get(f"{PREFIX}worker:{base}")
    return _text(value) if value else None


def worker_alive(worker_id: str) -> bool:
    return bool(_r().exists(f"{PREFIX}alive:{worker_id}"))


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
