"""Futures in Redis: one-round-trip submission with seq_id dedupe, claims, and long polls that
wake when the future ends."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tinker_api import futures

BASE = "futures-test"


pytestmark = pytest.mark.usefixtures("clean_tinker_keys")


def queued(redis_client: Any) -> list[dict[str, Any]]:
    entries = redis_client.xrange(futures.stream_key(BASE))
    return [{k.decode(): v for k, v in fields.items()} for _id, fields in entries]


def test_it_queues_a_resubmitted_seq_id_once_and_answers_the_first_future(
    redis_client: Any,
) -> None:
    first, retry = futures.new_request_id(), futures.new_request_id()
    op = {"op": "fwdbwd", "model": "m", "seq": 3}
    scope = "seq:m:3"
    for rid in (first, retry):
        answer = futures.submit(
            rid, {**op, "rid": rid}, team_id=7, base=BASE, body=b"\x00x", dedupe_scope=scope
        )
        assert answer == first
    (entry,) = queued(redis_client)
    assert json.loads(entry["op"])["rid"] == first and entry["body"] == b"\x00x"
    fut = futures.get(first)
    assert fut is not None and fut["status"] == futures.QUEUED
    assert (fut["team"], fut["kind"], fut["base"]) == ("7", "fwdbwd", BASE)
    assert futures.get(retry) is None
    # The stream was created with its consumer group: a worker started later reads it all.
    groups = redis_client.xinfo_groups(futures.stream_key(BASE))
    assert [g["name"] for g in groups] == [futures.GROUP.encode()]


def test_it_counts_queued_samples_and_queues_bodyless_requests(redis_client: Any) -> None:
    for _ in range(2):
        rid = futures.new_request_id()
        futures.submit(rid, {"op": "sample", "rid": rid}, team_id=1, base=BASE)
    assert futures.queued_samples(BASE) == 2
    assert all("body" not in entry for entry in queued(redis_client))


def test_it_claims_and_acknowledges_entries_but_never_reopens_an_ended_future(
    redis_client: Any,
) -> None:
    rids = [futures.new_request_id() for _ in range(2)]
    for rid in rids:
        futures.submit(rid, {"op": "optim", "rid": rid}, team_id=1, base=BASE)
    assert futures.fail(rids[1], "lost", "server")
    got = redis_client.xreadgroup(futures.GROUP, "w-1", {futures.stream_key(BASE): ">"}, count=10)
    entries = [(entry_id, rids[i]) for i, (entry_id, _f) in enumerate(got[0][1])]
    futures.claim_entries(BASE, "w-1", entries)
    claimed = futures.get(rids[0])
    assert claimed is not None and (claimed["status"], claimed["worker"]) == ("claimed", "w-1")
    assert futures.get(rids[1])["status"] == futures.FAILED
    pending = redis_client.xpending(futures.stream_key(BASE), futures.GROUP)
    assert pending["pending"] == 0


def test_it_wakes_a_long_poll_as_soon_as_the_future_ends() -> None:
    rid = futures.new_request_id()
    futures.submit(rid, {"op": "optim", "rid": rid}, team_id=1, base=BASE)
    done_at: list[float] = []

    def finish() -> None:
        time.sleep(0.2)
        done_at.append(time.monotonic())
        futures.complete(rid, json_body=b"{}")

    threading.Thread(target=finish).start()
    futures.wait(rid, 10.0)
    woke = time.monotonic()
    assert done_at and woke - done_at[0] < 0.5
    # A future ends once: a late failure does not overwrite the result.
    assert not futures.fail(rid, "too late")
    assert futures.get(rid)["status"] == futures.DONE
