"""The model worker in-process: requests read from its Redis stream, multi-LoRA batching.

Forward/backward requests of different models that are ready together run as ONE engine call;
each request still gets its own loss, metrics and logprobs, equal to running it alone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tinker_api import futures
from tinker_api.worker.server import ModelWorker

BASE = "batching-test"


pytestmark = pytest.mark.usefixtures("clean_tinker_keys")


def submit(op: dict[str, Any], body: bytes | None = None) -> str:
    rid = futures.new_request_id()
    futures.create(rid, team_id=1, kind=op["op"], base=BASE)
    futures.enqueue(BASE, {**op, "rid": rid}, body=body)
    return rid


def create(model: str, seed: int) -> str:
    config = {"rank": 4, "seed": seed, "train_attn": True, "train_mlp": True}
    return submit({"op": "create", "model": model, "seq": 0, "config": config})


def tensor(values: list[Any], dtype: str) -> dict[str, Any]:
    return {"data": values, "dtype": dtype}


def fwdbwd(model: str, seq: int, loss_fn: str, rows: list[list[int]]) -> str:
    data = []
    for tokens in rows:
        n = len(tokens) - 1
        inputs: dict[str, Any] = {"target_tokens": tensor(tokens[1:], "int64")}
        if loss_fn == "cross_entropy":
            inputs["weights"] = tensor([1.0] * n, "float32")
        else:
            inputs["logprobs"] = tensor([-1.0] * n, "float32")
            inputs["advantages"] = tensor([0.5] * n, "float32")
        data.append(
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                "loss_fn_inputs": inputs,
            }
        )
    body = json.dumps(
        {
            "model_id": model,
            "seq_id": seq,
            "forward_backward_input": {"data": data, "loss_fn": loss_fn},
        }
    ).encode()
    return submit(
        {
            "op": "fwdbwd",
            "model": model,
            "seq": seq,
            "forward_only": False,
            "ctype": "application/json",
        },
        body,
    )


def result(rid: str) -> dict[str, Any]:
    fut = futures.get(rid)
    assert fut is not None and fut["status"] == futures.DONE, fut
    return json.loads(fut["json"])


def drain(worker: ModelWorker) -> None:
    while worker.read(0) or worker.step():
        pass


def batch_sizes(monkeypatch: pytest.MonkeyPatch, name: str, arg: int) -> list[int]:
    """Wrap `training.ops.<name>` so that every call records len(args[arg]): how many
    datums or policies went into one engine call."""
    from training import ops

    sizes: list[int] = []
    real = getattr(ops, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        sizes.append(len(args[arg]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, name, recording)
    return sizes


ROWS_A = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
ROWS_B = [[20, 21, 22, 23]]


def test_it_batches_two_models_into_one_engine_call_with_their_own_results(
    base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = batch_sizes(monkeypatch, "forward_backward", arg=1)  # datums per call

    together = ModelWorker(BASE, str(base_model_dir), "cpu", "w-together")
    create("a", 1), create("b", 2)
    drain(together)
    fa = fwdbwd("a", 1, "cross_entropy", ROWS_A)
    fb = fwdbwd("b", 1, "importance_sampling", ROWS_B)
    drain(together)
    assert calls == [3], "both models' rows should run in one forward/backward"
    batched = {"a": result(fa), "b": result(fb)}

    # The same requests, one model at a time, on a fresh worker.
    futures.set_next_seq("a", 0), futures.set_next_seq("b", 0)
    alone = ModelWorker(BASE, str(base_model_dir), "cpu", "w-alone")
    create("a", 1), create("b", 2)
    drain(alone)
    solo = {}
    for name, loss, rows in (("a", "cross_entropy", ROWS_A), ("b", "importance_sampling", ROWS_B)):
        rid = fwdbwd(name, 1, loss, rows)
        drain(alone)
        solo[name] = result(rid)
    assert calls[1:] == [2, 1]

    for name in ("a", "b"):
        assert batched[name]["metrics"]["loss:sum"] == pytest.approx(
            solo[name]["metrics"]["loss:sum"], rel=1e-5
        )
        got = [v for o in batched[name]["loss_fn_outputs"] for v in o["logprobs"]["data"]]
        want = [v for o in solo[name]["loss_fn_outputs"] for v in o["logprobs"]["data"]]
        assert got == pytest.approx(want, abs=1e-5)
    # Each model accumulated only its own gradient.
    for name in ("a", "b"):
        g1 = [p.grad for p in together.policies[name].parameters() if p.grad is not None]
        g2 = [p.grad for p in alone.policies[name].parameters() if p.grad is not None]
        assert len(g1) == len(g2) > 0
        for x, y in zip(g1, g2, strict=True):
            assert (x - y).abs().max().item() < 1e-5


def test_it_fails_one_bad_request_without_failing_its_batch_mates(base_model_dir: Path) -> None:
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-bad")
    create("a", 1), create("b", 2)
    drain(worker)
    good = fwdbwd("a", 1, "cross_entropy", ROWS_A)
    # An unknown loss_fn_config key (the web process refuses it; a request that reached a
    # worker all the same fails alone).
    bad_body = json.dumps(
        {
            "model_id": "b",
            "seq_id": 1,
            "forward_backward_input": {
                "data": [
                    {
                        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                        "loss_fn_inputs": {
                            "target_tokens": tensor([2, 3, 4], "int64"),
                            "weights": tensor([1.0, 1.0, 1.0], "float32"),
                        },
                    }
                ],
                "loss_fn": "cross_entropy",
                "loss_fn_config": {"no_such_knob": 1.0},
            },
        }
    ).encode()
    bad = submit(
        {
            "op": "fwdbwd",
            "model": "b",
            "seq": 1,
            "forward_only": False,
            "ctype": "application/json",
        },
        bad_body,
    )
    drain(worker)
    assert result(good)["metrics"]["loss:sum"] > 0
    failed = futures.get(bad)
    assert failed is not None and failed["status"] == futures.FAILED
    assert "no_such_knob" in failed["error"] and failed["category"] == "user"


def optim(model: str, seq: int, **adam: Any) -> str:
    return submit({"op": "optim", "model": model, "seq": seq, "adam": adam})


def test_it_steps_the_optimizers_of_ready_models_in_one_update(
    base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = batch_sizes(monkeypatch, "optim_steps", arg=0)  # policies per call
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-optim")
    create("a", 1), create("b", 2), create("c", 3)
    drain(worker)
    for name in ("a", "b", "c"):
        fwdbwd(name, 1, "cross_entropy", ROWS_A)
    drain(worker)
    before = {n: [p.detach().clone() for p in worker.policies[n].parameters()] for n in "ab"}
    oa = optim("a", 2, learning_rate=1e-2)
    ob = optim("b", 2, learning_rate=1e-3, grad_clip_norm=1e-4)
    # A bad request fails alone; its batch mates still step.
    oc = optim("c", 2, learning_rate=-1.0)
    drain(worker)
    assert calls == [2], "both valid optimizer steps should run as one update"
    ma, mb = result(oa)["metrics"], result(ob)["metrics"]
    assert ma["optim/learning_rate:mean"] == 1e-2 and mb["optim/learning_rate:mean"] == 1e-3
    assert ma["optim/step:mean"] == mb["optim/step:mean"] == 1.0
    for name in "ab":
        after = list(worker.policies[name].parameters())
        assert any(not x.equal(y) for x, y in zip(before[name], after, strict=True))
    failed = futures.get(oc)
    assert failed["status"] == futures.FAILED and failed["category"] == "user"
    assert "learning_rate" in failed["error"]
    assert worker.policies["c"].step == 0
    # Each model's next request runs after its optimizer step, in seq_id order.
    assert futures.next_seq("a") == futures.next_seq("c") == 3


def test_it_holds_a_ready_batch_briefly_for_other_active_models(
    base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = batch_sizes(monkeypatch, "forward_backward", arg=1)  # datums per call
    monkeypatch.delenv("OPENTINKER_TINKER_GATHER_MS", raising=False)
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-gather")
    # On a CPU a batch costs what its parts cost: no waiting unless configured.
    assert worker.gather == 0.0
    worker.gather = 2.0
    create("a", 1), create("b", 2)
    drain(worker)
    # b's client is a little behind a's: b's request joins a's batch.
    fwdbwd("a", 1, "cross_entropy", ROWS_A)
    worker.read(0)
    worker.order.seen["b"] = time.monotonic()  # b's last request was just answered
    late = threading.Timer(0.1, fwdbwd, args=("b", 1, "cross_entropy", ROWS_B))
    late.start()
    started = time.monotonic()
    worker.gather_batch()
    late.join()
    assert time.monotonic() - started < 1.5, "the window ends when b's request arrives"
    worker.step()
    assert calls == [3]
    # A model silent for longer than ACTIVE_SECONDS is not waited for.
    worker.order.seen["b"] -= 10.0
    fwdbwd("a", 2, "cross_entropy", ROWS_A)
    worker.read(0)
    started = time.monotonic()
    worker.gather_batch()
    assert time.monotonic() - started < 0.5
    worker.step()
    assert calls == [3, 2]


@pytest.mark.django_db(transaction=True)
def test_it_drops_the_queued_work_of_a_finished_session(base_model_dir: Path) -> None:
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-close")
    create("a", 1)
    drain(worker)
    # seq 2 waits for a seq 1 that never comes (a client-side custom loss that raised).
    stuck = fwdbwd("a", 2, "cross_entropy", ROWS_A)
    drain(worker)
    assert futures.get(stuck)["status"] == futures.CLAIMED
    closed = submit({"op": "close", "models": ["a"]})
    drain(worker)
    failed = futures.get(stuck)
    assert failed["status"] == futures.FAILED and "finished" in failed["error"]
    assert futures.get(closed)["status"] == futures.DONE
    assert "a" not in worker.policies and "a" not in worker.engine.policies


@pytest.mark.django_db(transaction=True)
def test_it_closes_the_models_of_sessions_that_stopped_heartbeating(
    base_model_dir: Path, team: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from tinker_api.models import TinkerSession, TrainingModel

    long_ago = timezone.now() - timedelta(hours=1)
    for session_id, beat in (("s-gone", long_ago), ("s-live", timezone.now())):
        session = TinkerSession.objects.create(id=session_id, team=team, last_heartbeat=beat)
        TrainingModel.objects.create(
            id=f"{session_id}:train:0", session=session, team=team, base_model=BASE, lora_rank=4
        )
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-reap")
    create("s-gone:train:0", 1), create("s-live:train:0", 2)
    drain(worker)
    assert worker.reap_sessions() == ["s-gone:train:0"]
    assert set(worker.policies) == {"s-live:train:0"}
    gone = TinkerSession.objects.get(pk="s-gone")
    assert gone.finished and gone.finish_reason == "interrupted"
    assert not TinkerSession.objects.get(pk="s-live").finished


@pytest.mark.django_db(transaction=True)
def test_a_model_is_taken_up_from_its_newest_state_on_disk(
    base_model_dir: Path, team: Any, tinker_data_dir: Path
) -> None:
    """What a worker left when it gave its block back, unless a save is newer; a session that
    stops heartbeating takes its left state with it."""
    import os
    from datetime import timedelta

    from django.utils import timezone

    from tinker_api.models import Checkpoint, TinkerSession, TrainingModel
    from tinker_api.worker.policies import latest_state

    session = TinkerSession.objects.create(id="s-left", team=team)
    row = TrainingModel.objects.create(
        id="s-left:train:0", session=session, team=team, base_model=BASE, lora_rank=4
    )
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-left")
    create(row.id, 1)
    drain(worker)
    assert latest_state(row) == ""
    assert worker.policies.spill() == 1
    left = row.spill_path()
    assert latest_state(row) == str(left)
    saved = Checkpoint.objects.create(
        model=row, team=team, kind=Checkpoint.Kind.TRAINING, name="later", file="later.pt"
    )
    worker.policies[row.id].save_state(saved.file_path())
    Checkpoint.objects.filter(pk=saved.pk).update(size_bytes=saved.file_path().stat().st_size)
    os.utime(left, (1, 1))
    assert latest_state(row) == str(saved.file_path())
    os.utime(saved.file_path(), (0, 0))
    assert latest_state(row) == str(left)
    long_ago = timezone.now() - timedelta(hours=1)
    TinkerSession.objects.filter(pk=session.pk).update(last_heartbeat=long_ago)
    assert worker.reap_sessions() == [row.id]
    assert not left.exists()


@pytest.mark.django_db(transaction=True)
def test_the_beat_ends_sessions_whose_client_left_while_no_worker_held_them(
    team: Any, tinker_data_dir: Path
) -> None:
    """Their models' left states go with them; a session still heartbeating keeps its own."""
    from datetime import timedelta

    from django.utils import timezone

    from opentinker_site.celery import app
    from tinker_api.models import TinkerSession, TrainingModel
    from tinker_api.tasks import end_silent_sessions
    from workers.celeryconf import END_SILENT_SESSIONS_TASK

    assert any(
        entry["task"] == END_SILENT_SESSIONS_TASK for entry in app.conf.beat_schedule.values()
    )
    left = {}
    for session_id, beat in (("s-gone", timezone.now() - timedelta(hours=1)), ("s-here", None)):
        session = TinkerSession.objects.create(
            id=session_id, team=team, last_heartbeat=beat or timezone.now()
        )
        row = TrainingModel.objects.create(
            id=f"{session_id}:train:0", session=session, team=team, base_model=BASE, lora_rank=4
        )
        left[session_id] = row.spill_path()
        left[session_id].parent.mkdir(parents=True)
        left[session_id].write_bytes(b"state")
    assert end_silent_sessions() == 1
    gone = TinkerSession.objects.get(pk="s-gone")
    assert gone.finished and gone.finish_reason == "interrupted"
    assert not left["s-gone"].exists() and left["s-here"].is_file()
    assert not TinkerSession.objects.get(pk="s-here").finished


def chat(team: int, **fields: Any) -> str:
    """A /v1 request of ``team``, queued as ``services.serving.submit`` queues it."""
    rid = futures.new_request_id()
    op = {
        "op": "chat",
        "rid": rid,
        "target": {},
        "mode": "completion",
        "prompts": ["3+4="],
        "n": 1,
        "stream": False,
        "logprobs": False,
        "top_logprobs": 0,
        "max_context": 512,
        "params": {"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "seed": 1, "stop": []},
        **fields,
    }
    futures.submit(rid, op, team_id=team, base=BASE)
    return rid


def test_a_chat_requests_prefill_is_its_own_teams_even_when_it_joins_from_a_step(
    base_model_dir: Path, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """One row at a time: b's request waits and joins when a's ends, inside a decode step;
    c's echo has nothing to generate (lm-eval's scoring) and joins after b's. Each prefill
    (and the scoring) is charged to its own team, not to the rows already decoding, and not
    lost for want of rows."""
    settings.OPENTINKER_TINKER_SAMPLE_BATCH_ROWS = 1
    settings.OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS = 3600
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-charge")
    ran: list[str] = []  # the prefills and scorings since the last charge

    def marked(what: str, real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            ran.append(what)
            return real(*args, **kwargs)

        return run

    from tinker_api.worker import chat as chat_module

    monkeypatch.setattr(worker.chat.batch, "add", marked("prefill", worker.chat.batch.add))
    monkeypatch.setattr(chat_module, "score_prompts", marked("scoring", chat_module.score_prompts))
    charges: list[tuple[dict[Any, float], list[str]]] = []
    meter_charge = worker.chat.charge

    def recording(shares: Any, seconds: float) -> None:
        charges.append((dict(shares), list(ran)))
        ran.clear()
        meter_charge(shares, seconds)

    worker.chat.charge = recording
    a, b, c = chat(11), chat(12), chat(13, echo=True, logprobs=True, params={"max_tokens": 0})
    drain(worker)
    for rid in (a, b, c):
        assert futures.get(rid)["status"] == futures.DONE
    # Each prefill or scoring is charged alone, to the team whose request it ran for.
    assert [(shares, what) for shares, what in charges if what] == [
        ({11: 1}, ["prefill"]),
        ({12: 1}, ["prefill"]),
        ({13: 1}, ["scoring"]),
    ]
    # The decode steps are the decoding rows' alone.
    assert {tuple(shares) for shares, what in charges if not what} == {(11,), (12,)}
    assert set(worker.meter.seconds) == {11, 12, 13}
    assert dict(worker.meter.requests) == {11: 1, 12: 1, 13: 1}


def test_a_request_queued_without_a_team_by_an_earlier_release_is_charged_to_its_futures(
    base_model_dir: Path, settings: Any
) -> None:
    """A web process of an earlier release named no team in its messages (``submit`` above
    queues as it did): the worker charges the team of the request's future."""
    settings.OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS = 3600
    worker = ModelWorker(BASE, str(base_model_dir), "cpu", "w-untagged")
    created = create("m", 1)
    drain(worker)
    result(created)
    assert dict(worker.meter.requests) == {1: 1}
    assert set(worker.meter.seconds) == {1} and worker.meter.seconds[1] > 0


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_ends_for_want_of_redis_still_writes_its_last_charges(
    team: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.models import ServingCharge
    from tinker_api import tasks
    from tinker_api.worker import server
    from tinker_api.worker.meter import Meter

    def redis_down(*_args: Any) -> None:
        raise ConnectionError("Redis is unreachable")

    class Ending:
        """A worker whose serve loop ends when Redis stays away past its patience."""

        def __init__(self, base: str, *_args: Any, **_kwargs: Any) -> None:
            self.meter = Meter(base, gpus=1)
            self.stopping = threading.Event()

        def serve(self) -> str:
            self.meter.charge({team.pk: 1}, 7.0)  # since its last flush
            raise ConnectionError("Redis is unreachable")

        fail_everything = staticmethod(redis_down)

    monkeypatch.setattr(server, "ModelWorker", Ending)
    monkeypatch.setattr(tasks, "lease_devices", lambda *_args: ["cpu"])
    monkeypatch.setattr(tasks.Heartbeat, "start", lambda self: None)
    monkeypatch.setattr(tasks.Heartbeat, "stop", lambda self: None)
    monkeypatch.setattr(tasks.GpuLockTable, "renew", lambda *_args, **_kwargs: object())
    monkeypatch.setattr(tasks.futures, "register_worker", lambda *_args: True)
    monkeypatch.setattr(tasks.futures, "unregister_worker", redis_down)
    with pytest.raises(ConnectionError):
        tasks._serve(BASE, base_path="", node="n", gpus=[0], lease_job_id="j", lease_token="t")
    assert ServingCharge.objects.get(team=team).gpu_seconds == pytest.approx(7.0)


def test_a_skipped_optimizer_step_answers_json_that_strict_parsers_read() -> None:
    from tinker_api.worker.handlers import optim_reply, strict_json

    def strict(raw: bytes) -> Any:
        def refuse(name: str) -> Any:
            raise ValueError(f"{name} is not JSON")

        return json.loads(raw, parse_constant=refuse)

    # What training.ops.optim_steps reports for a step skipped for a non-finite gradient.
    reply = strict(optim_reply({"grad_norm": float("nan"), "skipped": 1.0, "step": 3.0}))
    assert reply == {"metrics": {"optim/skipped:mean": 1.0, "optim/step:mean": 3.0}}
    assert strict(strict_json({"loss": float("-inf"), "x": [1.0, float("inf")]})) == {
        "loss": None,
        "x": [1.0, None],
    }
