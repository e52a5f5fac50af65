"""A Tinker sampling batch runs a forward per turn of the model worker's loop, so that the
chat batch (the OpenAI-style streams) keeps decoding beside it instead of stalling until the
whole batch ends; training waits for the batch, as before, and a session's close read
meanwhile waits for it too. The batch's tokens are those it gives alone."""

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


def test_the_chat_batch_decodes_while_a_sampling_batch_runs(
    base_model_dir: Path, settings: Any
) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-interleave")
    sample = submit(sample_op())
    worker.read(0)
    worker.step()  # the batch starts: its prefill
    assert worker.sampling_batch is not None and not finished(sample)
    chat = submit(chat_op())
    create = submit({"op": "create", "model": "m-late", "seq": 0, "config": {"rank": 4, "seed": 1}})
    close = submit({"op": "close", "models": ["m-other"]})
    streamed_meanwhile = 0
    while not finished(sample):
        # Training and the close wait for the batch.
        assert not finished(create) and not finished(close)
        worker.read(0)
        worker.step()
        streamed_meanwhile = streamed_tokens(chat)
    # The stream went on beside the batch: most of its tokens came before the batch's end.
    assert streamed_meanwhile >= 12, streamed_meanwhile
    while worker.read(0) or worker.step():
        pass
    assert futures.get(create)["status"] == futures.DONE
    assert futures.get(close)["status"] == futures.DONE
    assert futures.get(chat)["status"] == futures.DONE

    # The same request alone on the same worker: the same tokens, seed for seed.
    again = submit(sample_op())
    while worker.read(0) or worker.step():
        pass
    assert tokens_of(again) == tokens_of(sample)
    assert futures.queued_samples(BASE) == 0


def test_more_forwards_per_chat_step_favour_the_sampling_batch(
    base_model_dir: Path, settings: Any
) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    settings.OPENTINKER_TINKER_SAMPLE_STEPS_PER_CHAT_STEP = 4
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-favour")
    sample = submit(sample_op(n=4, max_tokens=24))
    chat = submit(chat_op())
    turns = 0
    while not finished(sample):
        worker.read(0)
        worker.step()
        turns += 1
    # 24 forwards of the batch (its prefill and 23 decode steps) in 6 turns, a chat step in each.
    assert turns == 6
    assert streamed_tokens(chat) <= 6
    while worker.read(0) or worker.step():
        pass
    assert futures.get(chat)["status"] == futures.DONE
