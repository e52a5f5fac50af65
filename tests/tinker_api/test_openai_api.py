"""The OpenAI-compatible endpoints at the door: keys, model names, parameters and the queue
limit, answered in OpenAI's error shape before anything reaches a model worker.

No worker runs here: the requests that pass the door are checked by what lands on the base
model's stream (``tests/tinker_api/test_openai_live.py`` runs them for real).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from jobs.models import Job, JobState
from tests.tinker_api.conftest import BASE_NAME
from tinker_api import events, futures
from tinker_api.models import Checkpoint, TinkerSession, TrainingModel

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def bearer(key: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def post(client: Client, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, data=json.dumps(body), content_type="application/json")


def error_of(response: Any) -> dict[str, Any]:
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.fixture
def served(tinker_base: Any, tinker_data_dir: Path, clean_tinker_keys: None) -> Any:
    return tinker_base


@pytest.fixture
def finished_job(team: Any, owner: Any, tinker_data_dir: Path) -> Job:
    """A finished job with a final adapter and one native checkpoint on disk (the files are
    only looked at here, never loaded)."""
    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="adder",
        spec={
            "method": "rl",
            "env": "bandit",
            "base_model": BASE_NAME,
            "lora": {"rank": 4, "alpha": 8.0},
        },
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    root = tinker_data_dir / "jobs" / str(job.pk)
    (root / "adapter").mkdir(parents=True)
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    ckpt = root / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(b"state")
    line = {"name": "step-000002", "step": 2, "path": "x", "created": 5.0, "extra": {"step": 2}}
    (root / "checkpoints" / "checkpoints.jsonl").write_text(json.dumps(line) + "\n")
    return job


@pytest.fixture
def sampler_checkpoint(team: Any, owner: Any) -> Checkpoint:
    session = TinkerSession.objects.create(id="sess-1", team=team)
    model = TrainingModel.objects.create(
        id="sess-1:train:0", session=session, team=team, base_model=BASE_NAME, lora_rank=8
    )
    return Checkpoint.objects.create(
        model=model,
        team=team,
        kind=Checkpoint.Kind.SAMPLER,
        name="s1",
        file="tinker/s1",
        size_bytes=10,
    )


def queued_ops(redis_client: Any) -> list[dict[str, Any]]:
    entries = redis_client.xrange(futures.stream_key(BASE_NAME))
    return [json.loads(fields[b"op"]) for _id, fields in entries]


def test_it_answers_401_in_openai_shape_without_a_valid_key(served: Any) -> None:
    missing = Client().get("/v1/models")
    assert missing.status_code == 401
    assert error_of(missing)["type"] == "invalid_request_error"
    bad = bearer("otk_nope_nope").post(CHAT, data="{}", content_type="application/json")
    assert bad.status_code == 401
    assert error_of(bad)["code"] == "invalid_api_key"


def test_it_lists_what_the_key_may_use_and_hides_other_teams(
    served: Any,
    finished_job: Job,
    sampler_checkpoint: Checkpoint,
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
) -> None:
    mine = bearer(owner_key[1]).get("/v1/models").json()
    assert mine["object"] == "list"
    ids = [m["id"] for m in mine["data"]]
    job_id = f"job:{finished_job.pk}"
    assert ids[0] == BASE_NAME
    assert {job_id, f"{job_id}:step-000002", "tinker://sess-1:train:0/sampler_weights/s1"} <= set(
        ids
    )
    assert all(m["object"] == "model" and m["root"] == BASE_NAME for m in mine["data"])
    # The job's name, which resolves to the same adapter, follows its id.
    assert ids[ids.index(job_id) + 1] == "adder"
    theirs = [m["id"] for m in bearer(outsider_key[1]).get("/v1/models").json()["data"]]
    assert theirs == [BASE_NAME]
    one = bearer(owner_key[1]).get(f"/v1/models/{job_id}:step-000002")
    assert one.status_code == 200 and one.json()["id"] == f"{job_id}:step-000002"
    hidden = bearer(outsider_key[1]).get(f"/v1/models/{job_id}")
    assert hidden.status_code == 404 and error_of(hidden)["code"] == "model_not_found"


def adapter_job(team: Any, owner: Any, data_dir: Path, name: str) -> Job:
    """A finished job of ``team`` named ``name``, with a final adapter on disk."""
    job = Job.objects.create(
        team=team,
        created_by=owner,
        name=name,
        spec={"method": "rl", "env": "bandit", "base_model": BASE_NAME},
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    adapter = data_dir / "jobs" / str(job.pk) / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    return job


def test_it_lists_a_job_name_once_for_the_job_it_resolves_to(
    served: Any, team: Any, owner: Any, tinker_data_dir: Path, owner_key: tuple[Any, str]
) -> None:
    older = adapter_job(team, owner, tinker_data_dir, "adder")
    newer = adapter_job(team, owner, tinker_data_dir, "adder")
    shadowed = adapter_job(team, owner, tinker_data_dir, BASE_NAME)
    client = bearer(owner_key[1])
    listed = client.get("/v1/models").json()["data"]
    ids = [m["id"] for m in listed]
    assert ids == [
        BASE_NAME,
        f"job:{shadowed.pk}",
        f"job:{newer.pk}",
        "adder",
        f"job:{older.pk}",
    ]
    # Every listed name is one the API serves, as the same model.
    for entry in listed:
        one = client.get(f"/v1/models/{entry['id']}")
        assert one.status_code == 200 and one.json() == entry


def test_it_lists_a_teams_sampler_weights_alone(
    served: Any, sampler_checkpoint: Checkpoint, owner_key: tuple[Any, str]
) -> None:
    ids = [m["id"] for m in bearer(owner_key[1]).get("/v1/models").json()["data"]]
    assert ids == [BASE_NAME, "tinker://sess-1:train:0/sampler_weights/s1"]


@pytest.mark.parametrize(
    "name",
    [
        "gpt-4o",
        "job:not-a-uuid",
        "job:00000000-0000-0000-0000-000000000000",
        "tinker://nope/sampler_weights/x",
        "tinker://bad-path",
        "job:\x00",  # PostgreSQL's text holds no NUL: the lookup itself failed
    ],
)
def test_it_answers_404_naming_model_for_unknown_names(
    served: Any, owner_key: tuple[Any, str], name: str
) -> None:
    response = post(bearer(owner_key[1]), CHAT, {"model": name, "messages": QUESTION})
    assert response.status_code == 404
    error = error_of(response)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert name in error["message"]


def test_it_answers_404_for_another_teams_job_by_id_name_and_checkpoint(
    served: Any, finished_job: Job, sampler_checkpoint: Checkpoint, outsider_key: tuple[Any, str]
) -> None:
    outsider = bearer(outsider_key[1])
    for name in (
        f"job:{finished_job.pk}",
        f"job:{finished_job.pk}:step-000002",
        "adder",
        "tinker://sess-1:train:0/sampler_weights/s1",
    ):
        response = post(outsider, COMPLETIONS, {"model": name, "prompt": "1+1="})
        assert response.status_code == 404, name
        assert error_of(response)["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stop": [chr(97 + i) for i in range(17)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logit_bias": {"x5": 1}}, "logit_bias.x5"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
        ({"temperatur": 1}, "temperatur"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
        ),
        ({"seed": "abc"}, "seed"),
        # Strict types, as OpenAI's: a bool, a numeric string or a float is no integer.
        ({"n": "2"}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "name": "f", "content": "4"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ({"stop": ["\ud800"]}, "stop[0]"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias.\u00b2"),
        ({"logit_bias": {"\u0663": 1}}, "logit_bias.\u0663"),
        ({"logit_bias": {"0005": 1, "5": 2}}, "logit_bias.5"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        # Known to OpenAI, not done here: refused by name, not as unrecognized.
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
)
def test_it_answers_400_naming_the_bad_chat_parameter(
    served: Any, owner_key: tuple[Any, str], body: dict[str, Any], param: str, redis_client: Any
) -> None:
    response = post(bearer(owner_key[1]), CHAT, {"model": BASE_NAME, "messages": QUESTION, **body})
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert queued_ops(redis_client) == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 30}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": {"text": "a"}}, "prompt"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [1.0, 2.0]}, "prompt"),
        ({"prompt": [[1], [2.0]]}, "prompt"),
        ({"logprobs": True}, "logprobs"),
        ({"n": "2"}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": ["a", "\ud800"]}, "prompt[1]"),
        ({"logit_bias": {"\u00b9": 1}}, "logit_bias.\u00b9"),
    ],
)
def test_it_answers_400_naming_the_bad_completion_parameter(
    served: Any, owner_key: tuple[Any, str], body: dict[str, Any], param: str
) -> None:
    response = post(bearer(owner_key[1]), COMPLETIONS, {"model": BASE_NAME, "prompt": "1", **body})
    assert response.status_code == 400, response.content
    assert error_of(response)["param"] == param


def test_it_refuses_bodies_that_are_not_json_objects(
    served: Any, owner_key: tuple[Any, str]
) -> None:
    client = bearer(owner_key[1])
    for raw in (b"{not json", b"[1, 2]", b""):
        response = client.post(CHAT, data=raw, content_type="application/json")
        assert response.status_code == 400
        assert error_of(response)["param"] is None


def test_it_answers_unknown_endpoints_and_methods_in_openai_shape(
    served: Any, owner_key: tuple[Any, str]
) -> None:
    client = bearer(owner_key[1])
    assert client.get("/v1/embeddings").status_code == 404
    assert error_of(client.get("/v1/embeddings"))["type"] == "invalid_request_error"
    assert client.get(CHAT).status_code == 405
    assert error_of(client.get(CHAT))["message"].startswith("method GET")


def test_it_says_why_a_chat_parameter_is_refused(served: Any, owner_key: tuple[Any, str]) -> None:
    client = bearer(owner_key[1])
    for body, said in (
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "text must be a string",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "surrogate"),
        ({"logit_bias": {"0005": 1, "5": 2}}, "'0005' and '5' name the same token"),
        ({"logit_bias": {"\u00b2": 1}}, "is not a token id"),
        ({"seed": 2**63}, "less than or equal to 9223372036854775807"),
    ):
        response = post(client, CHAT, {"model": BASE_NAME, "messages": QUESTION, **body})
        assert response.status_code == 400, body
        assert said in error_of(response)["message"], body


def test_it_refuses_bodies_nested_too_deeply_or_with_overlong_numbers(
    served: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    client = bearer(owner_key[1])
    # The start of a valid body, left open for the field each case adds.
    start = json.dumps({"model": BASE_NAME, "messages": QUESTION})[:-1]
    for raw, said in (
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ((start + ', "tools": ' + "[" * 100 + "]" * 100 + "}").encode(), "nested more than"),
        ((start + ', "n": ' + "9" * 5000 + "}").encode(), "more than 4300 digits"),
        ((start + ', "seed": -' + "1" * 4301 + "}").encode(), "more than 4300 digits"),
    ):
        response = client.post(CHAT, data=raw, content_type="application/json")
        assert response.status_code == 400
        error = error_of(response)
        assert said in error["message"] and error["param"] is None
        # Nothing about the interpreter (sys.set_int_max_str_digits) reaches the client.
        assert "sys." not in error["message"]
    assert queued_ops(redis_client) == []


def test_it_answers_an_unexpected_error_as_openai_json(
    served: Any, owner_key: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(caller: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr("tinker_api.services.serving.list_models", broken)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {owner_key[1]}", raise_request_exception=False)
    response = client.get("/v1/models")
    assert response.status_code == 500
    error = error_of(response)
    assert error["type"] == "server_error" and "secret" not in error["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/responses"),
        ("post", "/v1/chat/completions/"),
        ("put", "/v1/models"),
        ("delete", "/v1/files/x"),
        ("patch", "/v1/embeddings"),
    ],
)
def test_it_answers_unknown_endpoints_json_whatever_the_method(
    served: Any, owner_key: tuple[Any, str], method: str, path: str
) -> None:
    """Unknown endpoints are JSON 404s, not Django's CSRF page, for a client that sends no
    CSRF token (none of OpenAI's does)."""
    client = Client(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Bearer {owner_key[1]}")
    response = getattr(client, method)(path, data="{}", content_type="application/json")
    if path == "/v1/models":
        assert response.status_code == 405
    else:
        assert response.status_code == 404
        assert error_of(response)["message"] == f"unknown endpoint {method.upper()} {path}"
    assert error_of(response)["type"] == "invalid_request_error"


def test_it_answers_429_with_retry_after_when_the_queue_is_full(
    served: Any, owner_key: tuple[Any, str], redis_client: Any, settings: Any
) -> None:
    settings.OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT = 2
    redis_client.set(f"{futures.PREFIX}samples:{BASE_NAME}", 2)
    response = post(bearer(owner_key[1]), CHAT, {"model": BASE_NAME, "messages": QUESTION})
    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    assert error_of(response)["code"] == "rate_limit_exceeded"
    assert queued_ops(redis_client) == []
    # The refused request holds no place in its team's concurrency limit either.
    assert redis_client.zcard(events.inflight_key(owner_key[0].team_id)) == 0


@pytest.fixture
def door_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker runs: a request that passes the door is given up at its first silent poll
    (503) and stays queued; no worker is started for it."""
    from tinker_api.serving import views

    monkeypatch.setattr(views, "SILENCE_SECONDS", 0.0)
    monkeypatch.setattr(views, "POLL_MS", 1)
    monkeypatch.setattr("tinker_api.services.serving.ensure_worker", lambda base: "active")


def test_it_limits_the_requests_one_team_has_in_flight(
    served: Any,
    door_only: None,
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
    redis_client: Any,
    settings: Any,
) -> None:
    settings.OPENTINKER_OPENAI_TEAM_CONCURRENCY = 1
    team_id = owner_key[0].team_id
    body = {"model": BASE_NAME, "messages": QUESTION}
    # A request of a web process that died long ago no longer counts.
    assert events.take_slot(team_id, "req-dead", 1, hold_seconds=-1)
    assert post(bearer(owner_key[1]), CHAT, body).status_code == 503
    assert events.take_slot(team_id, "req-busy", 1, hold_seconds=60)
    refused = post(bearer(owner_key[1]), CHAT, body)
    assert refused.status_code == 429 and refused["Retry-After"] == "1"
    assert "in flight" in error_of(refused)["message"]
    # Another team is not held back by this one.
    assert post(bearer(outsider_key[1]), CHAT, body).status_code == 503
    # Each answered request gave its place back; only the one still running holds one.
    assert redis_client.zrange(events.inflight_key(team_id), 0, -1) == [b"req-busy"]
    assert redis_client.zcard(events.inflight_key(outsider_key[0].team_id)) == 0


def test_it_refuses_a_job_without_a_final_adapter_naming_model(
    served: Any, team: Any, owner: Any, owner_key: tuple[Any, str]
) -> None:
    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="running",
        spec={"method": "rl", "env": "bandit", "base_model": BASE_NAME},
        spec_version=1,
        state=JobState.RUNNING,
    )
    response = post(bearer(owner_key[1]), COMPLETIONS, {"model": f"job:{job.pk}", "prompt": "1"})
    assert response.status_code == 400
    assert error_of(response)["param"] == "model"
    # By name, only jobs with a final adapter count: this one is not a model yet.
    by_name = post(bearer(owner_key[1]), COMPLETIONS, {"model": "running", "prompt": "1"})
    assert by_name.status_code == 404


def test_it_refuses_a_training_state_tinker_path_naming_model(
    served: Any, sampler_checkpoint: Checkpoint, owner_key: tuple[Any, str]
) -> None:
    Checkpoint.objects.create(
        model=sampler_checkpoint.model,
        team=sampler_checkpoint.team,
        kind=Checkpoint.Kind.TRAINING,
        name="t1",
        file="tinker/t1",
        size_bytes=10,
    )
    response = post(
        bearer(owner_key[1]),
        CHAT,
        {"model": "tinker://sess-1:train:0/weights/t1", "messages": QUESTION},
    )
    assert response.status_code == 400
    assert error_of(response)["param"] == "model"


def test_it_queues_one_op_for_the_policys_base_model_worker(
    served: Any,
    door_only: None,
    finished_job: Job,
    owner_key: tuple[Any, str],
    redis_client: Any,
) -> None:
    """What the door hands the worker: the job's adapter file and LoRA scale, the messages
    (rendered by the worker), and the sampling settings, OpenAI defaults filled in."""
    body = {"model": "adder", "messages": QUESTION, "n": 2, "stop": "\n", "seed": 3}
    response = post(bearer(owner_key[1]), CHAT, body)
    assert response.status_code == 503
    assert error_of(response)["type"] == "server_error"
    (op,) = queued_ops(redis_client)
    assert op["op"] == "chat" and op["mode"] == "chat" and op["n"] == 2
    assert op["target"]["file"].endswith(f"jobs/{finished_job.pk}/adapter")
    assert op["target"]["scale"] == 2.0
    assert op["messages"] == QUESTION
    assert op["params"] == {
        "max_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 3,
        "stop": ["\n"],
        "ignore_eos": False,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": {},
    }
    # The client that was given up on is marked gone, so a worker would skip the request.
    assert redis_client.exists(f"{futures.PREFIX}cancel:{op['rid']}")
    assert futures.queued_samples(BASE_NAME) == 1


def test_it_refuses_a_prompt_too_long_for_the_context_before_any_worker_tokenizes_it(
    served: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    """Megabytes of prompt would stall the worker's every stream while it tokenized them."""
    longest = served.longest_token_bytes()
    assert longest is not None and 1 <= longest < 64
    client = bearer(owner_key[1])
    too_long = "x" * (longest * served.max_context + 1)
    chat = post(
        client, CHAT, {"model": BASE_NAME, "messages": [{"role": "user", "content": too_long}]}
    )
    completion = post(client, COMPLETIONS, {"model": BASE_NAME, "prompt": ["hi", too_long]})
    ids = post(client, COMPLETIONS, {"model": BASE_NAME, "prompt": [1] * served.max_context})
    for response, param in ((chat, "messages"), (completion, "prompt"), (ids, "prompt")):
        assert response.status_code == 400
        error = error_of(response)
        assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert "cannot fit" in error_of(chat)["message"]
    assert queued_ops(redis_client) == []


def test_it_limits_a_teams_requests_and_tokens_per_minute_by_its_quota(
    served: Any,
    door_only: None,
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
    redis_client: Any,
) -> None:
    from accounts.models import Quota

    team = owner_key[0].team
    Quota.objects.filter(team=team).update(openai_requests_per_minute=2)
    body = {"model": BASE_NAME, "messages": QUESTION}
    if 60 - time.time() % 60 < 3:
        time.sleep(4)  # all three requests in one minute's window
    assert [post(bearer(owner_key[1]), CHAT, body).status_code for _ in range(2)] == [503, 503]
    refused = post(bearer(owner_key[1]), CHAT, body)
    assert refused.status_code == 429, refused.content
    assert error_of(refused)["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in error_of(refused)["message"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused["x-ratelimit-limit-requests"] == "2"
    assert refused["x-ratelimit-remaining-requests"] == "0"
    # Only the two admitted requests were queued.
    assert len(queued_ops(redis_client)) == 2
    # Another team's quota is its own.
    assert post(bearer(outsider_key[1]), CHAT, body).status_code == 503

    Quota.objects.filter(team=team).update(
        openai_requests_per_minute=0, openai_tokens_per_minute=100
    )
    events.charge_tokens(team.pk, 100)
    spent = post(bearer(owner_key[1]), CHAT, body)
    assert spent.status_code == 429
    assert "100 tokens per minute" in error_of(spent)["message"]
    assert spent["x-ratelimit-remaining-tokens"] == "0"
