"""Tinker sample requests decode in the model worker's one continuous batch, beside the
OpenAI-style streams: one forward a turn serves both, so neither stalls the other; training
runs between the turns; a session's close waits only for the sample rows that read its
snapshots. A request's tokens are those it gives alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tinker_api import events, futures
from tinker_api.worker.server import ModelWorker

BASE = "interleave-test"

pytestmark = [pytest.mark.usefixtures("clean_tinker_keys"), pytest.mark.django_db]


def submit(op: dict[str, Any]) -> str:
    rid = futures.new_request_id()
    futures.submit(rid, {**op, "rid": rid}, team_id=1, base=BASE)
    return rid


def sample_op(n: int = 8, max_tokens: int = 24) -> dict[str, Any]:
    return {
        "op": "sample",
        "target": {},
        "prompt": [5, 6, 7, 8, 9],
        "n": n,
        "params": {
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 11,
            "stop_on_eos": False,
        },
    }


def chat_op() -> dict[str, Any]:
    return {
        "op": "chat",
        "target": {},
        "mode": "chat",
        "messages": [{"role": "user", "content": "What is 3+4?"}],
        "n": 1,
        "stream": True,
        "logprobs": False,
        "top_logprobs": 0,
        "max_context": 512,
        "params": {
            "max_tokens": 24,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 1,
            "stop": [],
            "ignore_eos": True,
        },
    }


def finished(rid: str) -> bool:
    fut = futures.get(rid)
    return fut is not None and fut["status"] in (futures.DONE, futures.FAILED)


def streamed_tokens(rid: str) -> int:
    """How many tokens the stream's deltas and end carried (one token, one text piece here:
    the stream interval is 0)."""
    got = [event for _id, event in events.read(rid, "0", 1)]
    return sum(1 for e in got if e["t"] == "delta" for _c in e["c"])


def tokens_of(rid: str) -> list[list[int]]:
    fut = futures.get(rid)
    assert fut is not None and fut["status"] == futures.DONE, fut
    return [list(s["tokens"]) for s in json.loads(fut["json"])["sequences"]]


def run_until_idle(worker: ModelWorker) -> None:
    while worker.read(0) or worker.step():
        pass


def test_samples_and_streams_decode_in_one_batch(base_model_dir: Path, settings: Any) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-interleave")
    sample = submit(sample_op())
    worker.read(0)
    worker.step()  # the request joins the batch: its prefill and first token
    assert worker.chat.sampling is not None and worker.chat.sampling.busy
    chat = submit(chat_op())
    create = submit({"op": "create", "model": "m-late", "seq": 0, "config": {"rank": 4, "seed": 1}})
    close = submit({"op": "close", "models": ["m-other"]})
    turns = 1
    while not finished(sample):
        worker.read(0)
        worker.step()
        turns += 1
        assert turns < 60, "the sample request never finished"
    # One forward a turn for both: 24 tokens took 24 turns, and the stream, which joined a
    # turn later, had drawn 23 of its own by then and sent what text they spell.
    assert turns == 24
    (running,) = worker.chat.runs
    assert running.choices[0].tokens == 23
    assert streamed_tokens(chat) >= 12, streamed_tokens(chat)
    # Training and a close of a model no sample reads did not wait for the samples.
    assert futures.get(create)["status"] == futures.DONE
    assert futures.get(close)["status"] == futures.DONE
    run_until_idle(worker)
    assert futures.get(chat)["status"] == futures.DONE

    # The same request alone on the same worker: the same tokens, seed for seed.
    again = submit(sample_op())
    run_until_idle(worker)
    assert tokens_of(again) == tokens_of(sample)
    assert futures.queued_samples(BASE) == 0


@pytest.mark.django_db(transaction=True)
def test_a_session_that_ends_with_samples_out_closes_after_them(
    base_model_dir: Path, settings: Any
) -> None:
    """The close of a model whose snapshot sample rows decode waits for those rows (its
    client ended the session with a sample in flight); the request is answered, not failed."""
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-close-after")
    create = submit({"op": "create", "model": "m", "seq": 0, "config": {"rank": 4, "seed": 1}})
    run_until_idle(worker)
    assert futures.get(create)["status"] == futures.DONE
    policy = worker.policies.get("m")
    assert policy is not None
    worker.samplers.keep_snapshot(9001, policy, policy.snapshot())
    op = sample_op(n=2, max_tokens=12)
    sample = submit({**op, "target": {"model": "m", "checkpoint": 9001}})
    worker.read(0)
    worker.step()
    close = submit({"op": "close", "models": ["m"]})
    worker.read(0)
    while not finished(sample):
        assert not finished(close)
        worker.step()
    assert futures.get(sample)["status"] == futures.DONE, futures.get(sample)
    worker.step()
    assert futures.get(close)["status"] == futures.DONE
    assert worker.policies.get("m") is None
