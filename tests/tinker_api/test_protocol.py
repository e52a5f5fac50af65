"""The protocol endpoints over raw HTTP (JSON bodies, as curl or an older client sends them).

Fast checks need no worker: authentication, unknown and foreign ids, deduplication of a
resubmitted seq_id, sampling backpressure. The live ones run a real Celery worker: requests
of one model wait for the seq_id gap to fill, an idle model worker gives its block back, and
a worker that dies fails the futures it held instead of leaving them pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.tinker_api.conftest import BASE_NAME
from tinker_api import futures
from tinker_api.models import TinkerSession, TrainingModel

pytestmark = pytest.mark.usefixtures("clean_tinker_keys")


def api(client: Any, key: str, path: str, body: dict[str, Any] | None = None) -> Any:
    headers = {"HTTP_X_API_KEY": "tml-" + key}
    if body is None:
        return client.get(f"/api/v1/{path}", **headers)
    return client.post(f"/api/v1/{path}", body, content_type="application/json", **headers)


def datum(tokens: list[int]) -> dict[str, Any]:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
    }


def fwdbwd_body(model_id: str, seq_id: int) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {"data": [datum([5, 6, 7, 8, 9])], "loss_fn": "cross_entropy"},
    }


def new_session(client: Any, key: str) -> str:
    res = api(client, key, "create_session", {"sdk_version": "0.38.0", "tags": []})
    assert res.status_code == 200, res.content
    return res.json()["session_id"]


def new_model(client: Any, key: str, session_id: str, seq: int = 0) -> tuple[str, str]:
    res = api(
        client,
        key,
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": seq,
            "base_model": BASE_NAME,
            "lora_config": {"rank": 4},
        },
    )
    assert res.status_code == 200, res.content
    return res.json()["request_id"], res.json()["model_id"]


# --------------------------------------------------------------------------- no worker


@pytest.mark.django_db
def test_it_refuses_a_missing_or_unknown_key() -> None:
    client = Client()
    assert (
        client.post("/api/v1/create_session", {}, content_type="application/json").status_code
        == 401
    )
    res = api(client, "otk_nope_nope", "create_session", {"sdk_version": "0.38.0"})
    assert res.status_code == 401
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}


def test_it_answers_foreign_ids_as_unknown(
    tinker_base: Any, owner_key: tuple[Any, str], outsider_key: tuple[Any, str]
) -> None:
    client = Client()
    session_id = new_session(client, owner_key[1])
    request_id, model_id = new_model(client, owner_key[1], session_id)
    other = outsider_key[1]
    assert api(client, other, "get_info", {"model_id": model_id}).status_code == 404
    assert api(client, other, "session_heartbeat", {"session_id": session_id}).status_code == 404
    poll = api(client, other, "retrieve_future", {"request_id": request_id})
    assert poll.status_code == 410
    # What the client can do, as for a request lost with a Redis restarted empty.
    assert "will not run, send it again" in poll.json()["detail"]
    assert api(client, other, "training_runs").json()["training_runs"] == []
    assert api(client, other, f"training_runs/{model_id}").status_code == 404
    mine = api(client, owner_key[1], "get_info", {"model_id": model_id}).json()
    assert mine["model_id"] == model_id and mine["lora_rank"] == 4
    assert mine["model_data"]["model_name"] == str(tinker_base.resolved_path())
    # With a hub id, a client on another host can load the tokenizer.
    tinker_base.hub_id = "Qwen/Qwen2.5-0.5B-Instruct"
    tinker_base.save(update_fields=["hub_id"])
    data = api(client, owner_key[1], "get_info", {"model_id": model_id}).json()["model_data"]
    assert data["model_name"] == data["tokenizer_id"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_it_answers_a_resubmitted_seq_id_with_the_first_future(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    client = Client()
    _, model_id = new_model(client, owner_key[1], new_session(client, owner_key[1]))
    first = api(client, owner_key[1], "forward_backward", fwdbwd_body(model_id, 1)).json()
    again = api(client, owner_key[1], "forward_backward", fwdbwd_body(model_id, 1)).json()
    other = api(client, owner_key[1], "forward_backward", fwdbwd_body(model_id, 2)).json()
    assert first["request_id"] == again["request_id"] != other["request_id"]
    # create + two distinct forward/backward requests: the duplicate was not queued.
    assert redis_client.xlen(futures.stream_key(BASE_NAME)) == 3


def test_it_refuses_bad_requests_at_submission(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client = Client()
    key = owner_key[1]
    session_id = new_session(client, key)
    _, model_id = new_model(client, key, session_id)
    body = fwdbwd_body(model_id, 1)
    body["forward_backward_input"]["loss_fn"] = "no_such_loss"
    res = api(client, key, "forward_backward", body)
    assert res.status_code == 400 and "no_such_loss" in res.json()["detail"]
    res = api(
        client,
        key,
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": 1,
            "base_model": "nope",
            "lora_config": {"rank": 4},
        },
    )
    assert res.status_code == 400 and BASE_NAME in res.json()["detail"]
    res = api(
        client,
        key,
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": 1,
            "base_model": BASE_NAME,
            "lora_config": {"rank": 999},
        },
    )
    assert res.status_code == 400 and "rank" in res.json()["detail"]
    res = api(client, key, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "../up"})
    assert res.status_code == 400


def test_it_pushes_back_on_sampling_when_the_queue_is_full(
    tinker_base: Any, owner_key: tuple[Any, str], settings: Any
) -> None:
    settings.OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT = 1
    client = Client()
    key = owner_key[1]
    session_id = new_session(client, key)
    sampler = api(
        client,
        key,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_NAME},
    ).json()["sampling_session_id"]
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 3,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2},
    }
    headers = {"HTTP_X_API_KEY": "tml-" + key, "HTTP_X_TINKER_SAMPLING_BACKPRESSURE": "1"}
    first = client.post("/api/v1/asample", body, content_type="application/json", **headers)
    assert first.status_code == 200
    rid = first.json()["request_id"]
    assert first.json()["sample_sequence_ids"] == [f"{rid}:{i}" for i in range(3)]
    second = client.post(
        "/api/v1/asample", {**body, "seq_id": 1}, content_type="application/json", **headers
    )
    assert second.status_code == 429
    # Without the header the request is queued anyway.
    third = api(client, key, "asample", {**body, "seq_id": 1})
    assert third.status_code == 200


def test_it_stops_heartbeats_of_a_finished_session(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client = Client()
    key = owner_key[1]
    session_id = new_session(client, key)
    assert api(client, key, "session_heartbeat", {"session_id": session_id}).status_code == 200
    finish = api(client, key, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finish.status_code == 200
    api(client, key, f"sessions/{session_id}/finish", {"reason": {"type": "errored"}})
    assert TinkerSession.objects.get(pk=session_id).finish_reason == "success"
    assert api(client, key, "session_heartbeat", {"session_id": session_id}).status_code == 410


def test_it_records_the_seq_id_of_a_body_that_fails_validation(
    tinker_base: Any,
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
    redis_client: Any,
) -> None:
    client = Client()
    key = owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    invalid: list[tuple[str, dict[str, Any], str]] = [
        (
            "optim_step",
            {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": "fast"}},
            "adam_params.learning_rate",
        ),
        # What the SDK sends for AdamParams(learning_rate=float("nan")).
        (
            "optim_step",
            {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": None}},
            "adam_params.learning_rate",
        ),
        ("optim_step", {"model_id": model_id, "seq_id": 3}, "exactly one"),
        (
            "save_weights",
            {"model_id": model_id, "seq_id": 4, "path": "a", "ttl_seconds": 10**30},
            "ttl_seconds",
        ),
        ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 5}, "exactly one"),
        ("save_weights_external", {"model_id": model_id, "seq_id": 6}, "path"),
        ("load_weights", {"model_id": model_id, "seq_id": 7, "path": "p"}, "optimizer"),
        (
            "forward_backward",
            {**fwdbwd_body(model_id, 8), "forward_backward_input": {"data": "x"}},
            "forward_backward_input",
        ),
    ]
    for path, body, detail in invalid:
        res = api(client, key, path, body)
        assert res.status_code == 400 and detail in res.json()["detail"], (path, res.content)
        rid = redis_client.get(f"{futures.PREFIX}dedupe:seq:{model_id}:{body['seq_id']}")
        assert rid is not None, f"{path}: seq_id {body['seq_id']} left a gap"
        failed = api(client, key, "retrieve_future", {"request_id": rid.decode()})
        assert failed.status_code == 200 and failed.json()["category"] == "user"
        assert detail in failed.json()["error"], path
    # The skips are queued for the model worker, after the model's creation.
    assert redis_client.xlen(futures.stream_key(BASE_NAME)) == 1 + len(invalid)

    # Nothing is recorded for a body that names another team's model or an unusable seq_id.
    bad_lr = {"adam_params": {"learning_rate": "fast"}}
    res = api(client, outsider_key[1], "optim_step", {"model_id": model_id, "seq_id": 9, **bad_lr})
    assert res.status_code == 400
    for seq in (-1, 0, 2**63, "10"):
        res = api(client, key, "optim_step", {"model_id": model_id, "seq_id": seq, **bad_lr})
        assert res.status_code == 400
    assert not list(redis_client.scan_iter(match=f"{futures.PREFIX}dedupe:seq:{model_id}:9"))
    assert redis_client.xlen(futures.stream_key(BASE_NAME)) == 1 + len(invalid)


def test_it_bounds_sampling_requests_and_ids_at_submission(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    import json

    vocab = json.loads((Path(tinker_base.path) / "config.json").read_text())["vocab_size"]
    client = Client()
    key = owner_key[1]
    session_id = new_session(client, key)
    sampler = api(
        client,
        key,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_NAME},
    ).json()["sampling_session_id"]
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2},
    }
    for field, value, detail in [
        ("num_samples", 1_000_000, "num_samples: Input should be less than or equal to 128"),
        ("topk_sample_logprobs", 10**6, "topk_sample_logprobs: Input should be less than"),
        ("topk_prompt_logprobs", vocab + 1, f"over the base model's vocabulary of {vocab}"),
        ("topk_sample_logprobs", vocab + 1, f"over the base model's vocabulary of {vocab}"),
        ("prompt_alt_tokens_k", 10**6, "prompt_alt_tokens_k: Input should be less than"),
        ("seq_id", -1, "seq_id: Input should be greater than or equal to 0"),
        ("seq_id", 10**30, "seq_id: Input should be less than or equal to"),
    ]:
        res = api(client, key, "asample", {**body, field: value})
        assert res.status_code == 400, (field, value, res.content)
        assert field in res.json()["detail"] and detail in res.json()["detail"]
    assert redis_client.xlen(futures.stream_key(BASE_NAME)) == 0
    ok = api(client, key, "asample", {**body, "num_samples": 128, "topk_sample_logprobs": vocab})
    assert ok.status_code == 200 and len(ok.json()["sample_sequence_ids"]) == 128

    for seq in (2**63, 10**30):
        res = api(
            client,
            key,
            "create_model",
            {"session_id": session_id, "model_seq_id": seq, "base_model": BASE_NAME},
        )
        assert res.status_code == 400 and "model_seq_id" in res.json()["detail"]
    assert not TrainingModel.objects.filter(session_id=session_id).exists()


@pytest.mark.parametrize("path", ["training_runs", "sessions", "checkpoints"])
def test_it_refuses_an_offset_out_of_range(
    tinker_base: Any, owner_key: tuple[Any, str], path: str
) -> None:
    client = Client()
    key = owner_key[1]
    new_session(client, key)
    for offset in ("99999999999999999999", "-1", "abc", "9" * 5000):
        res = api(client, key, f"{path}?offset={offset}")
        assert res.status_code == 400, (offset, res.content)
        assert res.json()["detail"].startswith("offset must be an integer")
    assert api(client, key, f"{path}?limit=x").json() == {"detail": "limit must be an integer"}
    far = api(client, key, f"{path}?offset={2**62}&limit=1000")
    assert far.status_code == 200
    assert not next(v for k, v in far.json().items() if k != "cursor")


# --------------------------------------------------------------------------- live worker


@pytest.fixture
def live(
    live_server: Any,
    tinker_base: Any,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
) -> Iterator[tuple[str, Any]]:
    import httpx

    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", "2")
    monkeypatch.setenv("OPENTINKER_TINKER_TORCH_THREADS", "1")
    monkeypatch.setenv("OPENTINKER_TINKER_LONG_POLL_SECONDS", "1")
    worker = start_worker()
    with httpx.Client(base_url=live_server.url + "/api/v1/", timeout=30) as http:
        yield worker, http


def poll(http: Any, key: str, request_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = http.post(
            "retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": "tml-" + key}
        )
        if res.status_code != 408:
            return res
    raise AssertionError(f"future {request_id} still pending after {timeout} s")


def post(http: Any, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    res = http.post(path, json=body, headers={"X-API-Key": "tml-" + key})
    assert res.status_code == 200, res.text
    return res.json()


def new_live_model(http: Any, key: str) -> tuple[str, str]:
    """A LoRA model of a new session, created by the live worker: the session's id and its."""
    session_id = post(http, key, "create_session", {"sdk_version": "0.38.0"})["session_id"]
    created = post(
        http,
        key,
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": BASE_NAME,
            "lora_config": {"rank": 4},
        },
    )
    res = poll(http, key, created["request_id"], timeout=180)  # a model worker's start
    assert res.status_code == 200 and res.json()["model_id"] == created["model_id"]
    return session_id, str(created["model_id"])


def block_released(redis_client: Any, timeout: float = 30) -> bool:
    """Whether the model worker gave its lock-table block back within ``timeout``."""
    from workers.locktable import GpuLockTable

    table = GpuLockTable(redis_client)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(lease.job_id.startswith("tinker:") for lease in table.leases()):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_it_runs_a_models_requests_in_seq_id_order_and_releases_an_idle_worker(
    live: tuple[Any, Any], owner_key: tuple[Any, str], redis_client: Any
) -> None:
    _worker, http = live
    key = owner_key[1]
    _session, model_id = new_live_model(http, key)
    # seq 2 arrives before seq 1: it must wait for it.
    step = post(
        http,
        key,
        "optim_step",
        {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
    )
    res = http.post(
        "retrieve_future",
        json={"request_id": step["request_id"]},
        headers={"X-API-Key": "tml-" + key},
    )
    assert res.status_code == 408 and res.json()["type"] == "try_again"
    fwd = post(http, key, "forward_backward", fwdbwd_body(model_id, 1))
    fwd_result = poll(http, key, fwd["request_id"]).json()
    assert fwd_result["metrics"]["loss:sum"] > 0
    assert len(fwd_result["loss_fn_outputs"][0]["logprobs"]["data"]) == 4
    step_result = poll(http, key, step["request_id"]).json()
    # The step saw the gradient of seq 1: a non-zero norm.
    assert step_result["metrics"]["optim/grad_norm:mean"] > 0

    assert block_released(redis_client), "the idle model worker kept its block"
    assert futures.worker_of(BASE_NAME) is None


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_live_sessions_model_survives_its_worker_leaving_idle(
    live: tuple[Any, Any], owner_key: tuple[Any, str], redis_client: Any
) -> None:
    """A client that pauses longer than the idle time (a long evaluation of its own) finds
    its model as it left it: weights, optimizer state and step, not its last save."""
    _worker, http = live
    key = owner_key[1]
    session_id, model_id = new_live_model(http, key)
    fwd = post(http, key, "forward_backward", fwdbwd_body(model_id, 1))
    poll(http, key, fwd["request_id"])
    step = post(
        http,
        key,
        "optim_step",
        {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
    )
    poll(http, key, step["request_id"])

    def logprobs(seq_id: int) -> list[float]:
        forward = post(http, key, "forward", fwdbwd_body(model_id, seq_id))
        res = poll(http, key, forward["request_id"])
        assert res.status_code == 200, res.text
        return list(res.json()["loss_fn_outputs"][0]["logprobs"]["data"])

    before = logprobs(3)
    assert block_released(redis_client), "the idle model worker kept its block"
    post(http, key, "session_heartbeat", {"session_id": session_id})
    # The next request starts a new worker, which takes the model up where it was left.
    after = logprobs(4)
    assert after == pytest.approx(before, abs=1e-6)
    saved = post(http, key, "save_weights", {"model_id": model_id, "seq_id": 5, "path": "s"})
    assert poll(http, key, saved["request_id"]).status_code == 200
    from tinker_api.models import Checkpoint

    # One optimizer step was taken before the worker left: the new worker's state counts it.
    assert Checkpoint.objects.get(model_id=model_id, name="s").step == 1
    left = TrainingModel.objects.get(pk=model_id).spill_path()
    assert left.is_file()
    post(http, key, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert not left.exists(), "a finished session's live state stayed on disk"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_queued_behind_a_model_worker_starts_when_the_worker_leaves(
    live_server: Any,
    tinker_base: Any,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
    owner_key: tuple[Any, str],
    team: Any,
    owner: Any,
    tiny_base_model: Any,
) -> None:
    import httpx

    from jobs import services
    from jobs.models import Job, JobState

    # The worker would serve until idle for 600 s; a job waiting for its slot ends that
    # after 2 s without a request.
    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", "600")
    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_YIELD_SECONDS", "2")
    monkeypatch.setenv("OPENTINKER_TINKER_TORCH_THREADS", "1")
    monkeypatch.setenv("OPENTINKER_TINKER_LONG_POLL_SECONDS", "1")
    # One slot, which the model worker takes; no beat, so no reaper pass places the job.
    worker = start_worker(slots=1)
    key = owner_key[1]
    with httpx.Client(base_url=live_server.url + "/api/v1/", timeout=30) as http:
        _session, model_id = new_live_model(http, key)
    job = services.submit_job(
        team=team,
        user=owner,
        spec={"method": "rl", "env": "math", "dataset": "builtin:arith_train", "steps": 1},
        name="behind-the-model-worker",
    )
    queued = Job.objects.get(pk=job.pk)
    assert queued.state == JobState.QUEUED
    assert queued.queue_note == (
        "waiting for 1 GPU (0 of 1 free; 1 held by model workers, which give them back when idle)"
    )
    deadline = time.monotonic() + 60
    while Job.objects.get(pk=job.pk).state == JobState.QUEUED and time.monotonic() < deadline:
        time.sleep(0.2)
    # Placed by the model worker's own dispatch as it gave the slot back.
    assert Job.objects.get(pk=job.pk).state != JobState.QUEUED, worker.log()[-3000:]
    assert f"for {BASE_NAME} ended: yielded" in worker.log()
    # Its session is still open: the model waits on disk for the next worker.
    assert TrainingModel.objects.get(pk=model_id).spill_path().is_file()
    services.cancel_job(Job.objects.get(pk=job.pk))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_it_fails_the_futures_of_a_worker_that_dies_and_recovers_from_the_saved_state(
    live: tuple[Any, Any], owner_key: tuple[Any, str], start_worker: Callable[..., Any]
) -> None:
    worker, http = live
    key = owner_key[1]
    session_id, model_id = new_live_model(http, key)
    sampler = post(
        http, key, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "path": "keep"}
    )
    sampler_path = poll(http, key, sampler["request_id"]).json()["path"]
    state = post(http, key, "save_weights", {"model_id": model_id, "seq_id": 2, "path": "state"})
    assert poll(http, key, state["request_id"]).status_code == 200
    # seq 4 waits for seq 3 inside the worker, which then dies with it.
    held = post(http, key, "forward_backward", fwdbwd_body(model_id, 4))
    time.sleep(1.0)
    worker.kill()
    answer = poll(http, key, held["request_id"], timeout=30).json()
    assert answer["category"] == "server"
    assert "model worker" in answer["error"]

    # A new worker rebuilds the model from its saved state; the lost seq 4 is skipped.
    start_worker()
    step = post(http, key, "optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {}})
    assert "metrics" in poll(http, key, step["request_id"]).json()
    fwd = post(http, key, "forward_backward", fwdbwd_body(model_id, 5))
    assert poll(http, key, fwd["request_id"]).json()["metrics"]["loss:sum"] > 0
    # The sampler weights saved before the crash load from disk.
    sampling_id = post(
        http,
        key,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": sampler_path},
    )["sampling_session_id"]
    sample = post(
        http,
        key,
        "asample",
        {
            "sampling_session_id": sampling_id,
            "seq_id": 0,
            "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0.0},
        },
    )
    out = poll(http, key, sample["request_id"]).json()
    assert len(out["sequences"]) == 2 and 1 <= len(out["sequences"][0]["tokens"]) <= 3


def test_it_applies_the_team_quota_to_new_models(
    tinker_base: Any, owner_key: tuple[Any, str], team: Any, settings: Any
) -> None:
    client = Client()
    key = owner_key[1]
    session_id = new_session(client, key)
    body = {"session_id": session_id, "base_model": BASE_NAME, "lora_config": {"rank": 4}}
    settings.OPENTINKER_TINKER_MAX_MODELS_PER_TEAM = 1
    assert api(client, key, "create_model", {**body, "model_seq_id": 0}).status_code == 200
    second = api(client, key, "create_model", {**body, "model_seq_id": 1})
    assert second.status_code == 403 and "limit" in second.json()["detail"]
    settings.OPENTINKER_TINKER_MAX_MODELS_PER_TEAM = 10
    team.quota.max_gpus = 0
    team.quota.save()
    refused = api(client, key, "create_model", {**body, "model_seq_id": 1})
    assert refused.status_code == 403 and "quota" in refused.json()["detail"]
