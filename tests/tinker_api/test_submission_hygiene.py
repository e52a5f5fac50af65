"""What a Tinker request may store, and what a refused or deduplicated one leaves behind:
nothing. Raw HTTP, no model worker (every future stays queued)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from tests.tinker_api.conftest import BASE_NAME
from tests.tinker_api.test_protocol import api, fwdbwd_body, new_model, new_session
from tinker_api import _proto, futures
from tinker_api.models import Checkpoint, SamplingSession, TinkerSession, TrainingModel
from tinker_api.schema_limits import MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS, MAX_TAGS
from tinker_api.services import checkpoints
from tinker_api.wire import PROTOBUF

pytestmark = pytest.mark.usefixtures("clean_tinker_keys", "tinker_data_dir")


def raw(client: Client, key: str, path: str, body: str) -> Any:
    return client.post(
        f"/api/v1/{path}", body, content_type="application/json", HTTP_X_API_KEY="tml-" + key
    )


def queued(redis_client: Any) -> int:
    return int(redis_client.xlen(futures.stream_key(BASE_NAME)))


def rows(model_id: str) -> list[tuple[str, int]]:
    return sorted(Checkpoint.objects.filter(model_id=model_id).values_list("name", "pk"))


def test_a_save_refused_for_its_seq_id_changes_nothing(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    assert api(client, key, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "keep"})
    before, stream = rows(model_id), queued(redis_client)
    for seq, reason in ((None, "seq_id is required"), (0, "seq_id must be 1 or more")):
        for path, body in (
            ("save_weights", {"path": "keep", "overwrite": True}),
            ("save_weights_for_sampler", {"path": "keep"}),
            ("save_weights_for_sampler", {"sampling_session_seq_id": 7}),
            ("save_weights_external", {"path": "keep"}),
            ("optim_step", {"adam_params": {}}),
        ):
            sent = {"model_id": model_id, **body} | ({} if seq is None else {"seq_id": seq})
            res = api(client, key, path, sent)
            assert res.status_code == 400 and reason in res.json()["detail"], (path, res.content)
    assert rows(model_id) == before and queued(redis_client) == stream
    assert not SamplingSession.objects.exists()


def test_a_reused_seq_id_answers_its_first_request_and_writes_nothing(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    two = {"model_id": model_id, "seq_id": 2}
    first = api(client, key, "save_weights", {**two, "path": "two"}).json()["request_id"]
    before, stream = rows(model_id), queued(redis_client)
    for path, body in (
        ("save_weights", {"path": "two"}),  # a retry
        ("save_weights", {"path": "two-b"}),
        ("save_weights", {"path": "two", "overwrite": True}),
        ("save_weights_for_sampler", {"path": "two-c"}),
        ("save_weights_for_sampler", {"sampling_session_seq_id": 3}),
        ("save_weights_external", {"path": "two-d"}),
    ):
        res = api(client, key, path, {**two, **body})
        assert res.status_code == 200 and res.json()["request_id"] == first, (path, body)
    assert rows(model_id) == before and queued(redis_client) == stream
    assert not SamplingSession.objects.exists()

    # A refusal after the seq_id was claimed lands on the claimed id: the seq_id is spent.
    taken = api(client, key, "save_weights", {"model_id": model_id, "seq_id": 3, "path": "two"})
    assert taken.status_code == 400 and "exists; pass overwrite" in taken.json()["detail"]
    rid = redis_client.get(f"{futures.PREFIX}dedupe:seq:{model_id}:3").decode()
    failed = api(client, key, "retrieve_future", {"request_id": rid}).json()
    assert failed["category"] == "user" and "exists" in failed["error"]
    assert rows(model_id) == before and queued(redis_client) == stream + 1


def test_a_checkpoint_resolves_once_its_file_is_written(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client, key = Client(), owner_key[1]
    session_id = new_session(client, key)
    _, model_id = new_model(client, key, session_id)
    api(client, key, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "s"})
    path = f"tinker://{model_id}/weights/s"
    load = {"session_id": session_id, "model_seq_id": 1, "path": path, "optimizer": False}
    assert api(client, key, "weights_info", {"tinker_path": path}).status_code == 404
    assert api(client, key, "load_weights", load).status_code == 404
    assert not TrainingModel.objects.filter(pk=f"{session_id}:train:1").exists()
    # Into the model that saves it, a queued state loads after its save (seq_id order).
    legacy = {"model_id": model_id, "seq_id": 2, "path": path, "optimizer": False}
    assert api(client, key, "load_weights", legacy).status_code == 200

    ckpt = Checkpoint.objects.get(model_id=model_id, name="s")
    ckpt.file_path().parent.mkdir(parents=True)
    ckpt.file_path().write_bytes(b"state")
    checkpoints.record_state_saved(ckpt.pk, size_bytes=5, step=0)
    info = api(client, key, "weights_info", {"tinker_path": path})
    assert info.status_code == 200 and info.json()["base_model"] == BASE_NAME
    assert api(client, key, "load_weights", load).status_code == 200
    ckpt.file_path().unlink()
    assert api(client, key, "weights_info", {"tinker_path": path}).status_code == 404


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", "1", "true", "null"])
def test_it_refuses_user_metadata_that_is_not_text(
    tinker_base: Any, owner_key: tuple[Any, str], value: str
) -> None:
    client, key = Client(), owner_key[1]
    session_id = new_session(client, key)
    meta = '{"user_metadata": {"a": "ok", "b": ' + value + "}"
    for path, rest in (
        ("create_session", '"sdk_version": "0.38.0"'),
        (
            "create_model",
            f'"session_id": "{session_id}", "model_seq_id": 0, "base_model": "{BASE_NAME}"',
        ),
    ):
        res = raw(client, key, path, f"{meta}, {rest}}}")
        assert res.status_code == 400, (path, res.content)
        assert "user_metadata.b: Input should be a valid string" in res.json()["detail"]
    assert TinkerSession.objects.count() == 1 and not TrainingModel.objects.exists()


def test_it_keeps_string_metadata_and_the_session_names(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client, key = Client(), owner_key[1]
    body = {
        "sdk_version": "0.38.0",
        "tags": ["a"],
        "user_metadata": {"run": "7", "note": "é"},
        "display_name": "my run",
        "project_id": "proj-1",
    }
    session_id = api(client, key, "create_session", body).json()["session_id"]
    row = TinkerSession.objects.get(pk=session_id)
    assert (row.display_name, row.project_id) == ("my run", "proj-1")
    info = api(client, key, f"sessions/{session_id}").json()
    assert info["display_name"] == "my run" and info["user_metadata"] == body["user_metadata"]


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("user_metadata", {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, "user_metadata.k"),
        ("user_metadata", {"k" * 513: "v"}, "user_metadata"),
        ("user_metadata", {str(i): "v" for i in range(MAX_METADATA_KEYS + 1)}, "user_metadata"),
        ("tags", ["t"] * (MAX_TAGS + 1), "tags"),
        ("tags", ["t" * 257], "tags.0"),
        ("display_name", "d" * 257, "display_name"),
        ("project_id", "p" * 257, "project_id"),
    ],
)
def test_it_bounds_what_a_session_stores(
    tinker_base: Any, owner_key: tuple[Any, str], field: str, value: Any, where: str
) -> None:
    client, key = Client(), owner_key[1]
    res = api(client, key, "create_session", {"sdk_version": "0.38.0", field: value})
    assert res.status_code == 400 and f"{where}" in res.json()["detail"], res.content
    assert not TinkerSession.objects.exists()


def test_it_bounds_the_metadata_of_models_and_checkpoints(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client, key = Client(), owner_key[1]
    session_id = new_session(client, key)
    _, model_id = new_model(client, key, session_id)
    big = {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}
    for path, body in (
        ("create_model", {"session_id": session_id, "model_seq_id": 1, "base_model": BASE_NAME}),
        ("save_weights", {"model_id": model_id, "seq_id": 1, "path": "x"}),
        ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 2, "path": "y"}),
    ):
        res = api(client, key, path, {**body, "user_metadata": big})
        assert res.status_code == 400 and "user_metadata.k" in res.json()["detail"], path
    assert TrainingModel.objects.count() == 1 and not Checkpoint.objects.exists()


def test_it_refuses_nul_characters_postgresql_cannot_store(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    """A NUL in a stored name is a 400 naming the field, in an id a 404: never the
    database's error (PostgreSQL's text and jsonb hold no NUL), and nothing is queued."""
    client, key = Client(), owner_key[1]
    session_id = new_session(client, key)
    _, model_id = new_model(client, key, session_id)
    for path, body, where in (
        ("create_session", {"sdk_version": "0.38\x00"}, "sdk_version"),
        ("create_session", {"sdk_version": "0", "user_metadata": {"k": "\x00"}}, "user_metadata.k"),
        (
            "create_model",
            {"session_id": session_id, "model_seq_id": 1, "base_model": "\x00"},
            "base_model",
        ),
        ("get_info", {"model_id": "m\x00"}, "model_id"),
        ("optim_step", {"model_id": model_id + "\x00", "seq_id": 1, "adam_params": {}}, "model_id"),
        ("forward_backward", fwdbwd_body(model_id + "\x00", 1), "model_id"),
    ):
        res = api(client, key, path, body)
        assert res.status_code == 400, (path, res.content)
        assert f"{where}: null characters are not allowed" in res.json()["detail"], path
    proto = _proto.ForwardBackwardRequest(model_id=model_id + "\x00", seq_id=1).SerializeToString()
    res = client.post(
        "/api/v1/forward_backward", proto, content_type=PROTOBUF, HTTP_X_API_KEY="tml-" + key
    )
    assert res.status_code == 400 and "model_id: null" in res.json()["detail"]
    for path in (f"sessions/{session_id}%00", f"training_runs/{model_id}%00", "samplers/%00"):
        res = api(client, key, path)
        assert res.status_code == 404 and "NUL character" in res.json()["detail"], path
    assert TinkerSession.objects.count() == 1 and TrainingModel.objects.count() == 1
    assert queued(redis_client) == 1  # the model's creation
    # A stop string goes to the model worker, never to the database: a NUL is text there.
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    params = {"max_tokens": 1, "stop": ["\x00never"]}
    res = api(
        client,
        key,
        "asample",
        {"base_model": BASE_NAME, "prompt": prompt, "sampling_params": params},
    )
    assert res.status_code == 200, res.content
    assert queued(redis_client) == 2


@pytest.mark.parametrize("limit", ["-5", "0", "abc", "1.5"])
def test_it_refuses_a_bad_page_limit(tinker_base: Any, owner_key: tuple[Any, str], limit) -> None:
    client, key = Client(), owner_key[1]
    new_session(client, key)
    for path in ("sessions", "training_runs", "checkpoints"):
        res = api(client, key, f"{path}?limit={limit}")
        assert res.status_code == 400 and "limit" in res.json()["detail"], (path, res.content)
    huge = api(client, key, "training_runs?limit=" + "1" * 23).json()
    assert huge["cursor"]["limit"] == 1000


def test_it_names_the_allowed_methods_of_a_405(owner_key: tuple[Any, str], db: None) -> None:
    client, key = Client(), owner_key[1]
    res = client.get("/api/v1/create_session", HTTP_X_API_KEY="tml-" + key)
    assert res.status_code == 405 and res["Allow"] == "POST"
    assert json.loads(res.content) == {"detail": "method GET not allowed"}
    ttl = "/api/v1/training_runs/r/checkpoints/weights/y/ttl"
    res = client.get(ttl, HTTP_X_API_KEY="tml-" + key)
    assert res.status_code == 405 and res["Allow"] == "PUT, POST"


def test_a_finished_sessions_models_and_samplers_take_no_more_requests(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    from tests.tinker_api.test_protocol import fwdbwd_body

    client, key = Client(), owner_key[1]
    session_id = new_session(client, key)
    _, model_id = new_model(client, key, session_id)
    sampler = api(
        client,
        key,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_NAME},
    )
    assert sampler.status_code == 200, sampler.content
    sampler_id = sampler.json()["sampling_session_id"]
    assert api(client, key, "forward_backward", fwdbwd_body(model_id, 1)).status_code == 200
    finish = api(client, key, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finish.status_code == 200
    before = queued(redis_client)
    # Each would have run on the model rebuilt from its initial weights, as if nothing ended.
    for seq, (path, body) in enumerate(
        [
            ("forward_backward", fwdbwd_body(model_id, 0)),
            ("forward", fwdbwd_body(model_id, 0)),
            ("optim_step", {"model_id": model_id, "adam_params": {}}),
            ("save_weights", {"model_id": model_id, "path": "late"}),
            ("save_weights_for_sampler", {"model_id": model_id, "path": "late"}),
        ],
        start=2,
    ):
        body["seq_id"] = seq
        refused = api(client, key, path, body)
        assert refused.status_code == 400, (path, refused.content)
        assert "has ended (success)" in refused.json()["detail"], path
    assert not Checkpoint.objects.filter(model_id=model_id).exists()
    sample = api(
        client,
        key,
        "asample",
        {
            "sampling_session_id": sampler_id,
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 2},
        },
    )
    assert sample.status_code == 400 and "has ended" in sample.json()["detail"]
    # Reading what it left still works.
    assert api(client, key, f"training_runs/{model_id}").status_code == 200
    assert api(client, key, f"samplers/{sampler_id}").status_code == 200
    # The refusals queued only the skips that keep the model's sequence whole.
    assert queued(redis_client) - before == 5


def test_a_loss_fn_config_the_loss_does_not_take_is_refused_when_it_arrives(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any
) -> None:
    from tests.tinker_api.test_protocol import fwdbwd_body

    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    for loss_fn, config, said in (
        ("cross_entropy", {"bogus": 1.0}, "unknown loss_fn_config keys ['bogus']; allowed none"),
        ("ppo", {"clip_low": 0.5}, "allowed ['clip_high_threshold', 'clip_low_threshold']"),
        ("ppo", {"clip_low_threshold": "x"}, "loss_fn_config['clip_low_threshold'] must be"),
    ):
        body = fwdbwd_body(model_id, 1)
        body["forward_backward_input"]["loss_fn"] = loss_fn
        body["forward_backward_input"]["loss_fn_config"] = config
        if loss_fn == "ppo":
            for datum in body["forward_backward_input"]["data"]:
                n = len(datum["loss_fn_inputs"]["target_tokens"]["data"])
                datum["loss_fn_inputs"] = {
                    "target_tokens": datum["loss_fn_inputs"]["target_tokens"],
                    "logprobs": {"data": [-1.0] * n, "dtype": "float32"},
                    "advantages": {"data": [1.0] * n, "dtype": "float32"},
                }
        refused = api(client, key, "forward_backward", body)
        assert refused.status_code == 400, refused.content
        assert said in refused.json()["detail"]


@pytest.mark.parametrize(
    "adam, where",
    [
        ({"learning_rate": -1e-4}, "learning_rate"),
        ({"beta1": -0.1}, "beta1"),
        ({"beta2": 1.0}, "beta2"),
        ({"eps": 0}, "eps"),
        ({"weight_decay": -0.01}, "weight_decay"),
    ],
)
def test_adam_params_the_engine_refuses_are_refused_when_they_arrive(
    tinker_base: Any, owner_key: tuple[Any, str], redis_client: Any, adam: Any, where: str
) -> None:
    # Accepted, they failed the future later, on the model worker.
    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    before = queued(redis_client)
    body = {"model_id": model_id, "seq_id": 1, "adam_params": adam}
    refused = api(client, key, "optim_step", body)
    assert refused.status_code == 400 and f"adam_params.{where}" in refused.json()["detail"]
    assert queued(redis_client) - before == 1  # the skip past its spent seq_id, nothing to run
    body = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.0}}
    assert api(client, key, "optim_step", body).status_code == 200


def test_checkpoint_metadata_reads_back_whole_and_as_text(
    tinker_base: Any, owner_key: tuple[Any, str]
) -> None:
    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    meta = {"_private": "kept", "_seq": "mine", "step": "3"}
    save = {"model_id": model_id, "seq_id": 1, "path": "m", "user_metadata": meta}
    assert api(client, key, "save_weights", save).status_code == 200
    ckpt = Checkpoint.objects.get(model_id=model_id, name="m")
    assert (ckpt.seq, ckpt.user_metadata) == (1, meta)
    checkpoints.record_state_saved(ckpt.pk, size_bytes=5, step=0)
    listed = api(client, key, f"training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["user_metadata"] for c in listed] == [meta]
    # A row written before values had to be text reads back as JSON, not as Python's repr.
    Checkpoint.objects.filter(pk=ckpt.pk).update(user_metadata={"n": 1, "l": [1, "a"], "t": True})
    listed = api(client, key, f"training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert listed[0]["user_metadata"] == {"n": "1", "l": '[1, "a"]', "t": "true"}
    # A retry of the same save (its claim expired) reuses the row; another seq_id may not.
    with pytest.raises(Exception, match="exists; pass overwrite"):
        checkpoints._new_checkpoint(
            ckpt.model, ckpt.kind, "m", ttl_seconds=None, overwrite=False, user_metadata={}, seq=2
        )
    again = checkpoints._new_checkpoint(
        ckpt.model, ckpt.kind, "m", ttl_seconds=None, overwrite=False, user_metadata=meta, seq=1
    )
    assert again.seq == 1 and again.user_metadata == meta
