"""Requests refused at submission, with the official SDK against a live server.

The SDK numbers a training client's requests before sending them, so a request the server
refuses with a 4xx has spent its seq_id: the server records that seq_id as failed, the model
worker steps past it, and the client's next request runs. A seq_id that never arrives at all
fails the requests waiting behind it after ``OPENTINKER_TINKER_SEQ_GAP_SECONDS``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tinker_api.conftest import BASE_NAME
from tinker_api import futures

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types  # noqa: E402

from tests.tinker_api.test_sdk_live import (  # noqa: E402
    EXAMPLES,
    rest_client,
    service_client,
    sft_datum,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("clean_tinker_keys"),
]

GAP_SECONDS = 3


@pytest.fixture
def worker_env() -> dict[str, str]:
    return {"OPENTINKER_TINKER_SEQ_GAP_SECONDS": str(GAP_SECONDS)}


@pytest.fixture
def server(live_tinker: str) -> str:
    return live_tinker + "/"


def plain_datum(tokens: list[int], targets: list[int] | None = None) -> types.Datum:
    targets = [*tokens[1:], tokens[0]] if targets is None else targets
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": np.array(targets, dtype=np.int64),
            "weights": np.ones(len(targets), dtype=np.float32),
        },
    )


def test_it_runs_the_next_request_after_every_refusal_at_submission(
    server: str, owner_key: tuple[Any, str], redis_client: Any, tinker_base: Any
) -> None:
    vocab = json.loads((Path(tinker_base.path) / "config.json").read_text())["vocab_size"]
    with service_client(server, owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]
        training.save_state("taken").result()
        training.save_weights_for_sampler("taken-sampler").result()
        sampler_path = f"tinker://{training.model_id}/sampler_weights/taken-sampler"
        no_weights = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": np.array([6, 7, 8], dtype=np.int64)},
        )
        refusals: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
            (
                "unknown loss_fn",
                lambda: training.forward_backward(data, "no_such_loss"),  # type: ignore[arg-type]
                tinker.BadRequestError,
                "no_such_loss",
            ),
            (
                "target length != input length",
                lambda: training.forward_backward(
                    [plain_datum([5, 6, 7], [6, 7])], "cross_entropy"
                ),
                tinker.BadRequestError,
                "first dimension",
            ),
            (
                "cross_entropy without weights",
                lambda: training.forward([no_weights], "cross_entropy"),
                tinker.BadRequestError,
                "weights",
            ),
            (
                "input token outside the vocabulary",
                lambda: training.forward_backward(
                    [plain_datum([5, vocab + 3, 7])], "cross_entropy"
                ),
                tinker.BadRequestError,
                f"data[0].model_input: token id {vocab + 3} at position 1",
            ),
            (
                "target token outside the vocabulary",
                lambda: training.forward(
                    [plain_datum([5, 6, 7]), plain_datum([5, 6, 7], [6, 7, vocab])], "cross_entropy"
                ),
                tinker.BadRequestError,
                f"data[1].loss_fn_inputs['target_tokens']: token id {vocab} at position 2",
            ),
            (
                "negative token id",
                lambda: training.forward_backward(
                    [plain_datum([5, 6, 7], [6, -1, 8])], "cross_entropy"
                ),
                tinker.BadRequestError,
                "token id -1 at position 1",
            ),
            (
                "longer than the context",
                lambda: training.forward_backward([plain_datum([5] * 600)], "cross_entropy"),
                tinker.BadRequestError,
                "context",
            ),
            (
                "loss_fn custom",
                lambda: training.forward_backward(data, "custom"),
                tinker.BadRequestError,
                "forward_backward_custom",
            ),
            (
                "save_state onto an existing name",
                lambda: training.save_state("taken"),
                tinker.BadRequestError,
                "exists",
            ),
            (
                "save_state with an invalid name",
                lambda: training.save_state("../up"),
                tinker.BadRequestError,
                "invalid checkpoint name",
            ),
            (
                "named sampler save onto an existing name",
                lambda: training.save_weights_for_sampler("taken-sampler"),
                tinker.BadRequestError,
                "exists",
            ),
            (
                "in-place load of sampler weights",
                lambda: training.load_state(sampler_path),
                tinker.BadRequestError,
                "sampler weights",
            ),
            (
                "in-place load of an unknown checkpoint",
                lambda: training.load_state(f"tinker://{training.model_id}/weights/nope"),
                tinker.NotFoundError,
                "unknown checkpoint",
            ),
            # The SDK sends a NaN as null: the body fails validation before its model is
            # looked up, and its seq_id is spent all the same.
            (
                "NaN learning rate",
                lambda: training.optim_step(types.AdamParams(learning_rate=float("nan"))),
                tinker.BadRequestError,
                "adam_params.learning_rate",
            ),
        ]
        for what, call, error, detail in refusals:
            with pytest.raises(error) as caught:
                _submit_and_wait(call)
            assert detail in str(caught.value), (what, str(caught.value))
            # The refused seq_id is recorded, so the next request runs at once.
            started = time.monotonic()
            result = training.forward_backward(data, "cross_entropy").result(timeout=60)
            assert np.isfinite(result.metrics["loss:sum"]), what
            assert time.monotonic() - started < GAP_SECONDS, f"{what}: waited out the gap"
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)

        # A refused seq_id answers retrieve_future with the 400's body.
        rid = redis_client.get(f"{futures.PREFIX}dedupe:seq:{training.model_id}:3")
        answer = _retrieve(server, owner_key[1], rid.decode())
        assert answer.status_code == 200
        assert answer.json()["category"] == "user"
        assert "no_such_loss" in json.loads(answer.json()["error"])["detail"]


def _submit_and_wait(call: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        # load_state is deprecated (FutureWarning) but still sends its seq_id.
        warnings.simplefilter("ignore", FutureWarning)
        return call().result(timeout=60)


def _retrieve(server: str, key: str, request_id: str) -> Any:
    import httpx

    return httpx.post(
        server + "api/v1/retrieve_future",
        json={"request_id": request_id},
        headers={"X-API-Key": "tml-" + key},
        timeout=30,
    )


def _post(server: str, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    res = httpx.post(
        server + "api/v1/" + path, json=body, headers={"X-API-Key": "tml-" + key}, timeout=30
    )
    assert res.status_code == 200, res.text
    return res.json()


def _result(server: str, key: str, request_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = _retrieve(server, key, request_id)
        if res.status_code != 408:
            return res.json()
    raise AssertionError(f"future {request_id} still pending after {timeout} s")


def _new_model(server: str, key: str) -> str:
    """A LoRA model of a new session, created by the live worker; its id."""
    session_id = _post(server, key, "create_session", {"sdk_version": "0.38.0"})["session_id"]
    created = _post(
        server,
        key,
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": BASE_NAME,
            "lora_config": {"rank": 4},
        },
    )
    _result(server, key, created["request_id"])
    return str(created["model_id"])


def test_it_fails_requests_waiting_on_a_seq_id_that_never_arrives(
    server: str, owner_key: tuple[Any, str]
) -> None:
    key = owner_key[1]
    model_id = _new_model(server, key)
    adam = {"learning_rate": 0.01}
    # seq 1 is never sent (a client that numbered it and then failed before sending).
    waiting = _post(
        server, key, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": adam}
    )
    started = time.monotonic()
    failed = _result(server, key, waiting["request_id"])
    assert time.monotonic() - started >= GAP_SECONDS - 1
    assert failed["category"] == "user"
    assert "seq_id 1, which never arrived" in failed["error"]
    after = _post(
        server, key, "optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": adam}
    )
    assert "metrics" in _result(server, key, after["request_id"], timeout=GAP_SECONDS)


def test_it_runs_the_next_request_after_a_body_that_fails_validation(
    server: str, owner_key: tuple[Any, str]
) -> None:
    import httpx

    from tinker_api import _proto

    key = owner_key[1]
    model_id = _new_model(server, key)
    corrupt = _proto.ForwardBackwardRequest(model_id=model_id, seq_id=9, loss_fn="cross_entropy")
    datum = corrupt.data.add()
    datum.model_input.add().encoded_text.tokens = b"\1\0\0"
    invalid: list[tuple[str, dict[str, Any] | bytes, str]] = [
        (
            "optim_step",
            {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": "fast"}},
            "adam_params.learning_rate",
        ),
        (
            "save_weights",
            {"model_id": model_id, "seq_id": 3, "path": "x", "ttl_seconds": -1},
            "ttl_seconds",
        ),
        ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 5}, "exactly one"),
        (
            "forward_backward",
            {"model_id": model_id, "seq_id": 7, "forward_backward_input": {"data": []}},
            "loss_fn",
        ),
        ("forward_backward", corrupt.SerializeToString(), "whole number"),
    ]
    adam = {"learning_rate": 0.01}
    for path, body, detail in invalid:
        if isinstance(body, bytes):
            res = httpx.post(
                server + "api/v1/" + path,
                content=body,
                headers={"X-API-Key": "tml-" + key, "Content-Type": "application/x-protobuf"},
                timeout=30,
            )
            seq = 9
        else:
            res = httpx.post(
                server + "api/v1/" + path, json=body, headers={"X-API-Key": "tml-" + key}
            )
            seq = int(body["seq_id"])
        assert res.status_code == 400 and detail in res.json()["detail"], (path, res.text)
        # The next seq_id runs at once instead of waiting out the gap for the refused one.
        step = _post(
            server,
            key,
            "optim_step",
            {"model_id": model_id, "seq_id": seq + 1, "adam_params": adam},
        )
        started = time.monotonic()
        assert "metrics" in _result(server, key, step["request_id"], timeout=GAP_SECONDS * 2)
        assert time.monotonic() - started < GAP_SECONDS, f"{path}: waited out the gap"


def test_it_lists_sessions_and_publishes_checkpoints(
    server: str, owner_key: tuple[Any, str], outsider_key: tuple[Any, str]
) -> None:
    with service_client(server, owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        path = training.save_state("published").result().path
        rest = rest_client(server, owner_key[1])
        session_id = training.model_id.split(":")[0]
        assert session_id in rest.list_sessions().result().sessions
        assert rest.get_session(session_id).result().training_run_ids == [training.model_id]
        rest.publish_checkpoint_from_tinker_path(path).result()
        assert [
            c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints
        ] == [True]
        rest.unpublish_checkpoint_from_tinker_path(path).result()
        assert [
            c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints
        ] == [False]
        outsider = rest_client(server, outsider_key[1])
        assert session_id not in outsider.list_sessions().result().sessions
        with pytest.raises(tinker.NotFoundError):
            outsider.get_session(session_id).result()
        with pytest.raises(tinker.NotFoundError):
            outsider.publish_checkpoint_from_tinker_path(path).result()
