"""Per-request event streams of the OpenAI-style endpoints, in Redis.

The model worker publishes what a request produced as it decodes (its start, token deltas,
the end of each choice, a final summary or an error) on a stream of the request's own; the
web view reads that stream and answers the client from it (server-sent events, or one JSON
body once the summary arrives). A client that goes away sets the request's cancel key, and
the worker, which reads the keys of its running requests after every decode step, drops
that request's rows from the batch.

Keys (prefix ``ot:tinker:``):

- ``ev:<request_id>``      STREAM of events, field ``e`` holds the JSON event; expires
- ``cancel:<request_id>``  STRING set when the client is gone; expires
- ``inflight:<team_id>``   ZSET of the team's requests being answered, scored by when each
                           stops counting even if its release never comes (a web process
                           killed mid-request)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tinker_api.futures import PREFIX
from workers import conf

# Ops whose queueing counts towards the per-base-model backpressure limit (``samples:``).
QUEUE_COUNTED = frozenset({"sample", "chat"})

# A stream outlives its request long enough for a slow reader, and no more.
EVENTS_TTL = 600
CANCEL_TTL = 600


def events_key(request_id: str) -> str:
    return f"{PREFIX}ev:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}cancel:{request_id}"


def publish(events: Iterable[tuple[str, Mapping[str, Any]]], watch: Iterable[str] = ()) -> set[str]:
    """Append ``(request_id, event)`` pairs to their streams and read the cancel keys of
    ``watch``, in one round trip; returns the watched request ids whose client is gone."""
    watched = list(watch)
    pipe = conf.get_redis().pipeline(transaction=False)
    touched: set[str] = set()
    for request_id, event in events:
        pipe.xadd(events_key(request_id), {"e": json.dumps(event, separators=(",", ":"))})
        touched.add(request_id)
    for request_id in touched:
        pipe.expire(events_key(request_id), EVENTS_TTL)
    if watched:
        pipe.mget([cancel_key(rid) for rid in watched])
    if not touched and not watched:
        return set()
    results = pipe.execute()
    if not watched:
        return set()
    flags = results[-1]
    return {rid for rid, flag in zip(watched, flags, strict=True) if flag is not None}


def read(request_id: str, after: str, block_ms: int) -> list[tuple[str, dict[str, Any]]]:
    """Events of ``request_id`` after the entry id ``after`` ("0": from the start), waiting up
    to ``block_ms`` for the first one."""
    got = conf.get_redis().xread({events_key(request_id): after}, block=block_ms, count=512)
    out: list[tuple[str, dict[str, Any]]] = []
    for _key, entries in got or []:
        for entry_id, fields in entries:
            raw = fields.get(b"e") or fields.get("e")
            ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            out.append((ident, json.loads(raw)))
    return out


def coalesce(got: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``read``'s events with each run of consecutive ``delta`` events merged into one (per
    choice, its texts joined and its logprob entries in order): a reader that fell behind
    answers with one chunk per choice for all it missed, not one per decode step. The merged
    event keeps the id of the last one it holds."""
    out: list[tuple[str, dict[str, Any]]] = []
    for ident, event in got:
        if event.get("t") != "delta" or not out or out[-1][1].get("t") != "delta":
            out.append((ident, event))
            continue
        # A copy: the caller's events stay as they were read.
        merged = {"t": "delta", "c": [dict(c) for c in out[-1][1]["c"]]}
        by_choice = {c["i"]: c for c in merged["c"]}
        for c in event["c"]:
            before = by_choice.get(c["i"])
            if before is None:
                merged["c"].append(c)
                by_choice[c["i"]] = c
            else:
                before["text"] += c["text"]
                before["lp"] = before["lp"] + c["lp"]
        out[-1] = (ident, merged)
    return out


def cancel(request_id: str) -> None:
    conf.get_redis().set(cancel_key(request_id), "1", ex=CANCEL_TTL)


def cancelled(request_ids: Iterable[str]) -> set[str]:
    ids = list(request_ids)
    if not ids:
        return set()
    flags = conf.get_redis().mget([cancel_key(rid) for rid in ids])
    return {rid for rid, flag in zip(ids, flags, strict=True) if flag is not None}


def discard(request_id: str) -> None:
    """The reader is done with the stream: free it now rather than at its expiry."""
    conf.get_redis().delete(events_key(request_id))


# A slot is taken only while the team has fewer than ARGV[1] live ones; stale ones go first.
_TAKE = (
    "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3]) "
    "if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end "
    "redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2]) "
    "redis.call('EXPIRE', KEYS[1], ARGV[5]) return 1"
)


def inflight_key(team_id: int) -> str:
    return f"{PREFIX}inflight:{team_id}"


def take_slot(team_id: int, request_id: str, limit: int, hold_seconds: float) -> bool:
    """Count ``request_id`` against its team's concurrency limit; False when the team has
    ``limit`` requests in flight already."""
    now = time.time()
    return bool(
        conf.get_redis().eval(
            _TAKE,
            1,
            inflight_key(team_id),
            str(limit),
            request_id,
            f"{now:.3f}",
            f"{now + hold_seconds:.3f}",
            str(int(hold_seconds) + 60),
        )
    )


def release_slot(team_id: int, request_id: str) -> None:
    conf.get_redis().zrem(inflight_key(team_id), request_id)


# Per-minute windows of a team's /v1 traffic: a request is admitted while the window's
# requests are under ARGV[1] and its tokens under ARGV[2] (0: no limit); it then counts one
# request. Tokens are charged when an answer ends (`charge_tokens`): usage is known then.
_RATE = (
    "local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]) "
    "local used = tonumber(redis.call('GET', KEYS[2]) or '0') "
    "local asked = tonumber(redis.call('GET', KEYS[1]) or '0') "
    "if tpm > 0 and used >= tpm then return {0, asked, used} end "
    "local n = redis.call('INCR', KEYS[1]) "
    "redis.call('EXPIRE', KEYS[1], 120) "
    "if rpm > 0 and n > rpm then redis.call('DECR', KEYS[1]) return {0, n - 1, used} end "
    "return {1, n, used}"
)
RATE_WINDOW_SECONDS = 60


def _rate_keys(team_id: int, now: float) -> tuple[str, str]:
    window = int(now // RATE_WINDOW_SECONDS)
    return f"{PREFIX}rate:{team_id}:{window}:requests", f"{PREFIX}rate:{team_id}:{window}:tokens"


def take_rate(team_id: int, rpm: int, tpm: int) -> tuple[bool, int, int, float]:
    """Admit one request under the team's per-minute limits: (admitted, requests and tokens
    counted in this minute, seconds until the next minute)."""
    now = time.time()
    ok, requests, tokens = conf.get_redis().eval(
        _RATE, 2, *_rate_keys(team_id, now), str(rpm), str(tpm)
    )
    left = RATE_WINDOW_SECONDS - now % RATE_WINDOW_SECONDS
    return bool(ok), int(requests), int(tokens), left


def charge_tokens(team_id: int, tokens: int) -> None:
    if tokens <= 0:
        return
    _, key = _rate_keys(team_id, time.time())
    pipe = conf.get_redis().pipeline()
    pipe.incrby(key, int(tokens))
    pipe.expire(key, 2 * RATE_WINDOW_SECONDS)
    pipe.execute()
