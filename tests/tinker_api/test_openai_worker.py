"""The model worker's side of the OpenAI-style endpoints, driven directly: ``ChatHandler``
on a real engine and real Redis, stepped as the worker loop steps it, read back through the
request's event stream, as the web view reads it; and the text a stream releases as tokens
arrive (stop strings held back, then cut).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.tinker_api.conftest import _build_random_model
from tinker_api import events, futures
from tinker_api.worker.requests import Op

BASE = "tiny-tinker"


@pytest.fixture(scope="module")
def engine(base_model_dir: Path) -> Any:
    import torch

    from training.engine import Engine

    torch.set_num_threads(1)
    return Engine(str(base_model_dir), device="cpu")


def make_handler(engine: Any) -> Any:
    from tinker_api.worker.chat import ChatHandler
    from tinker_api.worker.policies import Policies
    from tinker_api.worker.sampler_cache import SamplerCache

    return ChatHandler(BASE, engine, Policies(engine), SamplerCache(engine))


@pytest.fixture
def handler(engine: Any, redis_client: Any, clean_tinker_keys: None, settings: Any) -> Any:
    # Every token its own event, so that a test sees each step's text.
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    return make_handler(engine)


def chat_op(**fields: Any) -> Op:
    """An op as ``services.serving.submit`` queues it, with its future and queue count."""
    rid = futures.new_request_id()
    op = {
        "op": "chat",
        "rid": rid,
        "target": {},
        "mode": "chat",
        "messages": [{"role": "user", "content": "What is 3+4?"}],
        "n": 1,
        "stream": False,
        "logprobs": False,
        "top_logprobs": 0,
        "max_context": 512,
        "params": {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 1, "stop": []},
    }
    for key, value in fields.items():
        if key in op["params"] or key == "ignore_eos":
            op["params"][key] = value
        else:
            op[key] = value
    futures.submit(rid, op, team_id=1, base=BASE)
    return Op(fields=op)


def drive(handler: Any, ops: list[Op]) -> None:
    handler.admit(ops)
    while handler.busy:
        handler.step()


def events_of(op: Op) -> list[dict[str, Any]]:
    return [event for _id, event in events.read(op.rid, "0", 1)]


def test_it_batches_requests_streams_some_and_ends_each_one(handler: Any) -> None:
    streamed = chat_op(stream=True, n=2, max_tokens=20, ignore_eos=True)
    whole = chat_op(stream=False, max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=2)
    drive(handler, [streamed, whole])

    got = events_of(streamed)
    assert got[0]["t"] == "start" and got[0]["prompt_tokens"] > 5
    assert got[-1] == {
        "t": "done",
        "usage": {
            "prompt_tokens": got[0]["prompt_tokens"],
            "completion_tokens": 40,
            "total_tokens": got[0]["prompt_tokens"] + 40,
        },
    }
    deltas = [e for e in got if e["t"] == "delta"]
    # A stream hears of its text step by step, not at the end.
    assert len(deltas) > 5
    ends = {e["i"]: e for e in got if e["t"] == "end"}
    assert set(ends) == {0, 1} and all(e["finish_reason"] == "length" for e in ends.values())

    # A request that does not stream gets its choice in one event, logprobs included.
    kinds = [e["t"] for e in events_of(whole)]
    assert kinds == ["start", "end", "done"]
    (end,) = [e for e in events_of(whole) if e["t"] == "end"]
    assert len(end["lp"]) == 20 and all(len(x["top_logprobs"]) == 2 for x in end["lp"])
    for op in (streamed, whole):
        assert futures.get(op.rid)["status"] == futures.DONE
    assert futures.queued_samples(BASE) == 0


def streamed_texts(got: list[dict[str, Any]], choices: int) -> list[str]:
    texts = [""] * choices
    for event in got:
        for c in event["c"] if event["t"] == "delta" else [event] if event["t"] == "end" else []:
            texts[c["i"]] += c["text"]
    return texts


def test_it_sends_a_streams_text_at_most_once_per_interval(
    engine: Any, redis_client: Any, clean_tinker_keys: None, settings: Any
) -> None:
    fields = {"stream": True, "n": 2, "max_tokens": 20, "ignore_eos": True, "logprobs": True}
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    each = chat_op(**fields)
    drive(make_handler(engine), [each])
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 1000
    held = chat_op(**fields)
    started = time.monotonic()
    drive(make_handler(engine), [held])
    elapsed = time.monotonic() - started

    every, coalesced = events_of(each), events_of(held)
    one_each = [e for e in every if e["t"] == "delta"]
    few = [e for e in coalesced if e["t"] == "delta"]
    assert len(one_each) >= 19
    # The first text at once, then at most one event a second; the ends carry the rest.
    assert 1 <= len(few) <= 1 + elapsed
    assert streamed_texts(coalesced, 2) == streamed_texts(every, 2)
    entries = [
        [
            x["token"]
            for e in events
            if e["t"] in ("delta", "end")
            for c in e.get("c", [e])
            if c["i"] == i
            for x in c["lp"]
        ]
        for events in (every, coalesced)
        for i in (0, 1)
    ]
    assert entries[:2] == entries[2:] and all(len(x) == 20 for x in entries)


def test_a_reader_behind_gets_the_deltas_it_missed_as_one_event() -> None:
    got = [
        ("1-0", {"t": "start", "prompt_tokens": 3}),
        ("2-0", {"t": "delta", "c": [{"i": 0, "text": "a", "lp": [1]}]}),
        ("3-0", {"t": "delta", "c": [{"i": 1, "text": "x", "lp": [2]}]}),
        (
            "4-0",
            {
                "t": "delta",
                "c": [{"i": 0, "text": "b", "lp": [3]}, {"i": 1, "text": "y", "lp": [4]}],
            },
        ),
        ("5-0", {"t": "end", "i": 0, "text": "c", "lp": [], "finish_reason": "length"}),
        ("6-0", {"t": "delta", "c": [{"i": 1, "text": "z", "lp": [5]}]}),
    ]
    before = json.dumps(got)
    assert events.coalesce(got) == [
        got[0],
        (
            "4-0",
            {
                "t": "delta",
                "c": [{"i": 0, "text": "ab", "lp": [1, 3]}, {"i": 1, "text": "xy", "lp": [2, 4]}],
            },
        ),
        got[4],
        got[5],
    ]
    assert json.dumps(got) == before


def test_it_skips_a_request_whose_client_left_before_it_started(handler: Any) -> None:
    gone, kept = chat_op(), chat_op()
    events.cancel(gone.rid)
    drive(handler, [gone, kept])
    assert events_of(gone) == []
    assert json.loads(futures.get(gone.rid)["json"]) == {"cancelled": True}
    assert [e["t"] for e in events_of(kept)][-1] == "done"
    assert futures.queued_samples(BASE) == 0


def test_it_refuses_what_only_the_worker_can_judge_naming_the_parameter(handler: Any) -> None:
    long = chat_op(max_tokens=600)
    ids = chat_op(mode="completion", prompts=[[1, 2, 10**6]])
    fine = chat_op()
    drive(handler, [long, ids, fine])
    (error,) = events_of(long)
    assert error["t"] == "error" and error["status"] == 400 and error["param"] == "max_tokens"
    (error,) = events_of(ids)
    assert error["status"] == 400 and error["param"] == "prompt"
    assert futures.get(long.rid)["status"] == futures.FAILED
    # The others in the batch are not held back by them.
    assert events_of(fine)[-1]["t"] == "done"
    assert futures.queued_samples(BASE) == 0


def test_it_asks_for_completions_on_a_model_without_a_chat_template(
    tmp_path: Path, redis_client: Any, clean_tinker_keys: None
) -> None:
    from tinker_api.worker.chat import ChatHandler
    from tinker_api.worker.policies import Policies
    from tinker_api.worker.sampler_cache import SamplerCache
    from training.engine import Engine

    plain = Engine(str(_build_random_model(tmp_path / "plain")), device="cpu")
    handler = ChatHandler(BASE, plain, Policies(plain), SamplerCache(plain))
    chat, text = chat_op(), chat_op(mode="completion", prompts=["12+7="])
    drive(handler, [chat, text])
    (error,) = events_of(chat)
    assert error["param"] == "model" and "/v1/completions" in error["message"]
    assert events_of(text)[-1]["t"] == "done"


def test_it_starts_a_request_that_arrives_while_others_decode(handler: Any) -> None:
    def text_of(op: Op) -> str:
        got = events_of(op)
        return "".join(e["text"] for e in got if e["t"] == "end")

    alone = chat_op(max_tokens=12, seed=8, ignore_eos=True)
    drive(handler, [alone])

    early = chat_op(stream=True, max_tokens=30, ignore_eos=True)
    late = chat_op(max_tokens=12, seed=8, ignore_eos=True)
    handler.admit([early])
    for _ in range(5):
        handler.step()
    handler.admit([late])
    steps = 0
    while futures.get(late.rid)["status"] != futures.DONE:
        handler.step()
        steps += 1
    # The late request ran beside the early one, and finished first: it did not wait.
    assert steps == 12
    assert [e["t"] for e in events_of(early)][-1] != "done"
    while handler.busy:
        handler.step()
    assert [e["t"] for e in events_of(early)][-1] == "done"
    # Joining mid-decode changed nothing it drew.
    assert text_of(late) == text_of(alone)


def test_it_holds_new_requests_until_the_batch_empties_when_rows_cannot_join(
    handler: Any,
) -> None:
    # As with a model whose cache keeps a sliding window (it cannot be padded to merge).
    handler.batch.can_join = False
    first, second = chat_op(max_tokens=6, ignore_eos=True), chat_op(max_tokens=6, ignore_eos=True)
    handler.admit([first])
    handler.step()
    handler.admit([second])
    while futures.get(first.rid)["status"] != futures.DONE:
        assert events_of(second) == []
        handler.step()
    while handler.busy:
        handler.step()
    assert [e["t"] for e in events_of(second)] == ["start", "end", "done"]
    assert futures.queued_samples(BASE) == 0


def test_it_takes_requests_in_order_while_their_rows_fit() -> None:
    from tinker_api.worker.requests import fitting, rows_of

    def op(n: int, prompts: int | None = None) -> Op:
        if prompts is None:
            return Op(fields={"op": "chat", "mode": "chat", "n": n})
        return Op(fields={"op": "chat", "mode": "completion", "n": n, "prompts": [[1]] * prompts})

    sample = Op(fields={"op": "sample", "n": 4})
    assert [rows_of(o) for o in (op(2), op(2, prompts=3), sample)] == [2, 6, 4]
    assert fitting([op(2), op(2), op(1)], 3, at_least_one=True) == 1
    assert fitting([op(1), op(1), op(1)], 3, at_least_one=True) == 3
    # The one that does not fit stops the rest, small as they are.
    assert fitting([op(1), op(3), op(1)], 3, at_least_one=True) == 1
    # Larger than the whole room: alone when it may be, else not at all.
    assert fitting([op(5), op(1)], 3, at_least_one=True) == 1
    assert fitting([op(5), op(1)], 3, at_least_one=False) == 0
    assert fitting([], 3, at_least_one=True) == 0


def test_requests_past_the_row_limit_wait_for_rows_to_leave(
    engine: Any, redis_client: Any, clean_tinker_keys: None, settings: Any
) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    settings.OPENTINKER_TINKER_SAMPLE_BATCH_ROWS = 3
    handler = make_handler(engine)
    first = chat_op(n=2, max_tokens=4, ignore_eos=True)
    second = chat_op(n=2, max_tokens=4, ignore_eos=True)
    third = chat_op(n=1, max_tokens=4, ignore_eos=True)
    handler.admit([first, second, third])
    # The second does not fit beside the first, and the third waits behind it.
    assert len(handler.batch) == 2
    assert events_of(second) == [] and events_of(third) == []
    widest = 0
    while futures.get(first.rid)["status"] != futures.DONE:
        handler.step()
        widest = max(widest, len(handler.batch))
    # The step that ended the first started the two that waited.
    assert len(handler.batch) == 3
    while handler.busy:
        handler.step()
        widest = max(widest, len(handler.batch))
    assert widest == 3
    for op in (first, second, third):
        assert [e["t"] for e in events_of(op)][-1] == "done"
    # A request larger than the limit on its own still runs, alone.
    large = chat_op(n=5, max_tokens=2, ignore_eos=True)
    handler.admit([large])
    assert len(handler.batch) == 5
    while handler.busy:
        handler.step()
    assert [e["t"] for e in events_of(large)][-1] == "done"
    assert futures.queued_samples(BASE) == 0


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>"
    '{"name": ..., "arguments": ...}</tool_call>. Tools:'
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_it_says_when_a_request_offers_tools_to_a_template_that_teaches_tool_calls(
    handler: Any, engine: Any
) -> None:
    plain = chat_op()
    offered = chat_op()
    offered.fields["tools"] = [WEATHER]
    drive(handler, [plain, offered])
    # The test model's template knows nothing of tools: calls stay text.
    assert events_of(plain)[0] == {
        "t": "start",
        "prompt_tokens": events_of(plain)[0]["prompt_tokens"],
    }
    assert events_of(offered)[0]["tools"] is False

    saved = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    try:
        taught, untaught = chat_op(), chat_op()
        taught.fields["tools"] = [WEATHER]
        drive(handler, [taught, untaught])
    finally:
        engine.tokenizer.chat_template = saved
    start = events_of(taught)[0]
    assert start["tools"] is True
    # The tools went into the prompt.
    assert start["prompt_tokens"] > events_of(untaught)[0]["prompt_tokens"] + 20
    assert "tools" not in events_of(untaught)[0]


def test_it_releases_streamed_text_only_once_it_is_final(base_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from tinker_api.worker.textstream import TextStream

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    ids = tokenizer.encode("12+7=19. done", add_special_tokens=False)
    plain = TextStream(tokenizer)
    assert "".join(plain.push(t) for t in ids) + plain.finish() == "12+7=19. done"

    stream = TextStream(tokenizer, stop=(". d",))
    released = []
    for t in ids:
        released.append(stream.push(t))
        if stream.stopped:
            break
    released.append(stream.finish())
    # The text before the stop string, never the stop string nor anything after it.
    assert "".join(released) == "12+7=19"
    assert stream.stopped
    # "." and ". " could begin the stop string: they were held back, not sent and retracted.
    assert all(". " not in piece for piece in released)


def test_text_decoded_a_token_at_a_time_is_the_whole_sequences_text(base_model_dir: Path) -> None:
    import random

    from transformers import AutoTokenizer

    from tinker_api.worker.textstream import TextStream

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    rng = random.Random(5)
    # Any tokens at all: pieces of multi-byte characters, special tokens, spaces.
    ids = [rng.randrange(len(tokenizer)) for _ in range(400)]
    ids += tokenizer.encode("é ü 名前 ok", add_special_tokens=False)
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert stream.covered == len(ids)
