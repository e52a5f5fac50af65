"""The JSON endpoints against the real tinker SDK: its resources send the bodies our request
models parse, and its types validate (strictly) the bodies our response models produce."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)

from tinker import types
from tinker.types.optimizer import DimuonParams

from tests.tinker_api._sdk import SdkWire
from tinker_api import schemas as s
from tinker_api import wire


def sent_json(sdk: SdkWire) -> dict[str, Any]:
    return json.loads(sdk.last.content)


def test_it_parses_the_session_setup_the_sdk_sends() -> None:
    sdk = SdkWire(body=s.ClientConfigResponse().model_dump())
    flags = sdk.call(
        lambda c: c.service.client_config(request=types.ClientConfigRequest(sdk_version="0.38.0"))
    )
    assert s.ClientConfigRequest.model_validate(sent_json(sdk)).sdk_version == "0.38.0"
    # The flags that keep the SDK on the paths this server implements arrive intact.
    assert flags.use_pyqwest_transport is False
    assert flags.sample_use_retrieve_futures is False
    assert flags.custom_loss_server_side is False
    assert flags.proto_compress_fwdbwd is True

    sdk = SdkWire(body=s.CreateSessionResponse(session_id="sess-1").model_dump())
    created = sdk.call(
        lambda c: c.service.create_session(
            request=types.CreateSessionRequest(
                tags=["exp"], user_metadata={"owner": "ana"}, sdk_version="0.38.0"
            )
        )
    )
    parsed = s.CreateSessionRequest.model_validate(sent_json(sdk))
    assert (parsed.tags, parsed.user_metadata, created.session_id) == (
        ["exp"],
        {"owner": "ana"},
        "sess-1",
    )
    assert sdk.last.headers["x-api-key"] == "tml-test-key"
    assert sdk.last.headers["x-idempotency-key"]

    sdk = SdkWire(body=s.SessionHeartbeatResponse().model_dump())
    sdk.call(lambda c: c.service.session_heartbeat(session_id="sess-1"))
    assert s.SessionHeartbeatRequest.model_validate(sent_json(sdk)).session_id == "sess-1"


def test_it_parses_model_creation_and_answers_get_info() -> None:
    sdk = SdkWire(body=wire.future_created("req-1", model_id="sess-1:train:0").body)
    future = sdk.call(
        lambda c: c.models.create(
            request=types.CreateModelRequest(
                session_id="sess-1",
                model_seq_id=0,
                base_model="Qwen/Qwen3-0.6B",
                lora_config=types.LoraConfig(rank=16, seed=7, train_unembed=False),
            )
        )
    )
    parsed = s.CreateModelRequest.model_validate(sent_json(sdk))
    assert future.request_id == "req-1" and future.model_id == "sess-1:train:0"
    assert parsed.lora_config is not None
    assert (parsed.lora_config.rank, parsed.lora_config.seed) == (16, 7)
    assert parsed.lora_config.train_unembed is False
    assert parsed.optimizer_config.type == "adamw"

    info = s.GetInfoResponse(
        model_id="sess-1:train:0",
        model_data=s.ModelData(model_name="Qwen/Qwen3-0.6B", arch="qwen3"),
        is_lora=True,
        lora_rank=16,
    )
    sdk = SdkWire(body=info.model_dump())
    got = sdk.call(
        lambda c: c.models.get_info(request=types.GetInfoRequest(model_id="sess-1:train:0"))
    )
    assert s.GetInfoRequest.model_validate(sent_json(sdk)).model_id == "sess-1:train:0"
    assert (got.model_data.model_name, got.lora_rank, got.optimizer_config.type) == (
        "Qwen/Qwen3-0.6B",
        16,
        "adamw",
    )


def test_it_parses_both_optimizer_step_shapes() -> None:
    sdk = SdkWire()
    sdk.call(
        lambda c: c.training.optim_step(
            request=types.OptimStepRequest(
                optim_params=types.AdamParams(learning_rate=3e-5, grad_clip_norm=1.0),
                model_id="m",
                seq_id=5,
            )
        )
    )
    adam = s.OptimStepRequest.model_validate(sent_json(sdk))
    assert adam.adam_params is not None and adam.optimizer_params is None
    assert (adam.adam_params.learning_rate, adam.adam_params.beta2, adam.seq_id) == (3e-5, 0.95, 5)

    sdk.call(
        lambda c: c.training.optim_step(
            request=types.OptimStepRequest(
                optim_params=DimuonParams(learning_rate=0.01), model_id="m", seq_id=6
            )
        )
    )
    other = s.OptimStepRequest.model_validate(sent_json(sdk))
    assert other.adam_params is None and other.optimizer_params is not None
    assert other.optimizer_params["type"] == "dimuon"

    with pytest.raises(ValidationError, match="exactly one"):
        s.OptimStepRequest.model_validate({"model_id": "m", "seq_id": 1})


def test_it_parses_every_save_and_load_request() -> None:
    sdk = SdkWire()
    sdk.call(
        lambda c: c.weights.save(
            request=types.SaveWeightsRequest(
                model_id="m", path="step-3", seq_id=7, ttl_seconds=3600
            )
        )
    )
    save = s.SaveWeightsRequest.model_validate(sent_json(sdk))
    assert (save.path, save.seq_id, save.ttl_seconds, save.overwrite) == ("step-3", 7, 3600, False)

    sdk.call(
        lambda c: c.weights.save_for_sampler(
            request=types.SaveWeightsForSamplerRequest(model_id="m", path="final", seq_id=8)
        )
    )
    named = s.SaveWeightsForSamplerRequest.model_validate(sent_json(sdk))
    assert (named.path, named.sampling_session_seq_id) == ("final", None)

    sdk.call(
        lambda c: c.weights.save_for_sampler(
            request=types.SaveWeightsForSamplerRequest(
                model_id="m", seq_id=9, sampling_session_seq_id=2
            )
        )
    )
    unnamed = s.SaveWeightsForSamplerRequest.model_validate(sent_json(sdk))
    assert (unnamed.path, unnamed.sampling_session_seq_id, unnamed.kind) == (None, 2, "snapshot")

    sdk.call(
        lambda c: c.weights.load(
            request=types.LoadWeightsRequest(
                session_id="sess-1",
                model_seq_id=1,
                path="tinker://sess-1:train:0/weights/step-3",
                optimizer=True,
            )
        )
    )
    create = s.LoadWeightsRequest.model_validate(sent_json(sdk))
    assert create.creates_model and create.model_seq_id == 1 and create.optimizer
    assert wire.parse_tinker_path(create.path) == ("sess-1:train:0", "training", "step-3")

    sdk.call(
        lambda c: c.weights.load(
            request=types.LoadWeightsRequest(
                model_id="m", seq_id=4, path="tinker://r/weights/a", optimizer=False
            )
        )
    )
    legacy = s.LoadWeightsRequest.model_validate(sent_json(sdk))
    assert not legacy.creates_model and legacy.seq_id == 4

    with pytest.raises(ValidationError, match="either model_id"):
        s.LoadWeightsRequest.model_validate({"path": "tinker://r/weights/a", "optimizer": False})


def test_it_parses_sampling_requests_as_the_sampling_client_sends_them() -> None:
    sdk = SdkWire(body=s.CreateSamplingSessionResponse(sampling_session_id="samp-1").model_dump())
    made = sdk.call(
        lambda c: c.service.create_sampling_session(
            request=types.CreateSamplingSessionRequest(
                session_id="sess-1", sampling_session_seq_id=0, base_model="Qwen/Qwen3-0.6B"
            )
        )
    )
    assert made.sampling_session_id == "samp-1"
    assert s.CreateSamplingSessionRequest.model_validate(sent_json(sdk)).base_model

    sdk = SdkWire(body=wire.future_created("req-5", sample_sequence_ids=["a", "b", "c"]).body)
    future = sdk.call(
        lambda c: c.sampling.asample(
            request=types.SampleRequest(
                sampling_session_id="samp-1",
                seq_id=12,
                num_samples=3,
                prompt=types.ModelInput(
                    chunks=[
                        types.EncodedTextChunk(tokens=[1, 2]),
                        types.EncodedTextChunk(tokens=[3]),
                    ]
                ),
                sampling_params=types.SamplingParams(max_tokens=16, stop=[7, 8], temperature=0.7),
                prompt_logprobs=True,
                topk_prompt_logprobs=5,
                record_stability_info=False,
            ),
            max_retries=0,
            extra_headers={"X-Tinker-Sampling-Backpressure": "1"},
        )
    )
    assert future.sample_sequence_ids == ["a", "b", "c"]
    assert sdk.last.headers["x-tinker-sampling-backpressure"] == "1"
    req = wire.parse_json(s.SampleRequest, sdk.last.content)
    assert wire.sample_prompt(req) == ([1, 2, 3], [])
    assert (req.num_samples, req.seq_id, req.prompt_logprobs, req.topk_prompt_logprobs) == (
        3,
        12,
        True,
        5,
    )
    assert (req.sampling_params.max_tokens, req.sampling_params.stop) == (16, [7, 8])
    assert req.sampling_params.temperature == pytest.approx(0.7)

    sdk.call(
        lambda c: c.sampling.asample(
            request=types.SampleRequest(
                sampling_session_id="samp-1",
                seq_id=13,
                prompt=types.ModelInput.from_ints([1, 2, 3]),
                sampling_params=types.SamplingParams(stop="\n\n"),
                prompt_alt_tokens_k=2,
            )
        )
    )
    alt = wire.parse_json(s.SampleRequest, sdk.last.content)
    assert alt.sampling_params.stop == "\n\n"
    assert alt.prompt_alt_tokens_k == 2
    assert wire.sample_prompt(alt) == ([1, 2, 3], [])

    sdk.call(
        lambda c: c.sampling.asample(
            request=types.SampleRequest(
                sampling_session_id="samp-1",
                seq_id=14,
                prompt=types.ModelInput.from_ints([1, 2, 3]),
                sampling_params=types.SamplingParams(),
                prompt_logprobs=True,
                prompt_logprobs_last_n=3,
            )
        )
    )
    too_long = wire.parse_json(s.SampleRequest, sdk.last.content)
    with pytest.raises(wire.WireError, match="between 1 and 2"):
        wire.sample_prompt(too_long)
    with pytest.raises(wire.WireError, match="invalid SampleRequest: num_samples") as err:
        wire.parse_json(
            s.SampleRequest, sdk.last.content.replace(b'"num_samples":1', b'"num_samples":0')
        )
    assert err.value.status == 400


def test_it_parses_future_polls_sent_as_the_api_future_sends_them() -> None:
    sdk = SdkWire(status=408, body=wire.try_again("req-1", "paused_rate_limit").body)

    async def poll(c: Any) -> Any:
        # _APIFuture._fetch_via_rest: raw response, no retries, protobuf accepted.
        return await c.futures.with_raw_response.retrieve(
            request=types.FutureRetrieveRequest(request_id="req-1", allow_metadata_only=True),
            timeout=45,
            extra_headers={"Accept": "application/x-protobuf", "X-Tinker-Request-Iteration": "0"},
            max_retries=0,
        )

    with pytest.raises(Exception) as err:
        sdk.call(poll)
    assert getattr(err.value, "status_code", None) == 408
    assert err.value.body["queue_state"] == "paused_rate_limit"  # type: ignore[attr-defined]
    poll_body = s.FutureRetrieveRequest.model_validate(sent_json(sdk))
    assert (poll_body.request_id, poll_body.allow_metadata_only) == ("req-1", True)
    assert wire.wants_protobuf(sdk.last.headers["accept"])


NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
CHECKPOINT = s.Checkpoint(
    checkpoint_id="weights/step-3",
    checkpoint_type="training",
    time=NOW,
    tinker_path="tinker://sess-1:train:0/weights/step-3",
    size_bytes=1024,
)


@pytest.mark.parametrize(
    ("ours", "sdk_type"),
    [
        (s.CreateModelResponse(model_id="sess-1:train:0"), types.CreateModelResponse),
        (s.OptimStepResponse(metrics={"lr:mean": 1e-4}), types.OptimStepResponse),
        (s.OptimStepResponse(), types.OptimStepResponse),
        (s.SaveWeightsResponse(path=CHECKPOINT.tinker_path), types.SaveWeightsResponse),
        (
            s.SaveWeightsForSamplerResponse(path="tinker://r/sampler_weights/x"),
            types.SaveWeightsForSamplerResponseInternal,
        ),
        (
            s.SaveWeightsForSamplerResponse(sampling_session_id="samp-2"),
            types.SaveWeightsForSamplerResponseInternal,
        ),
        (s.LoadWeightsResponse(model_id="sess-1:train:1"), types.LoadWeightsResponse),
        (
            s.GetSamplerResponse(sampler_id="samp-1", base_model="Qwen/Qwen3-0.6B"),
            types.GetSamplerResponse,
        ),
        (s.ClientDynamicConfigResponse(), types.ClientDynamicConfigResponse),
        (
            s.GetServerCapabilitiesResponse(
                supported_models=[
                    s.SupportedModel(
                        model_name="Qwen/Qwen3-0.6B",
                        max_context_length=4096,
                        trainable=True,
                        sampleable=True,
                    )
                ]
            ),
            types.GetServerCapabilitiesResponse,
        ),
        (s.HealthResponse(), types.HealthResponse),
        (s.TelemetryResponse(), types.TelemetryResponse),
        (
            s.CheckpointsListResponse(
                checkpoints=[CHECKPOINT], cursor=s.Cursor(offset=0, limit=20, total_count=1)
            ),
            types.CheckpointsListResponse,
        ),
        (
            s.TrainingRunsResponse(
                training_runs=[
                    s.TrainingRun(
                        training_run_id="sess-1:train:0",
                        base_model="Qwen/Qwen3-0.6B",
                        model_owner="team-a",
                        is_lora=True,
                        lora_rank=8,
                        last_request_time=NOW,
                        last_checkpoint=CHECKPOINT,
                        user_metadata={"renderer_name": "qwen3"},
                    )
                ],
                cursor=s.Cursor(offset=0, limit=20, total_count=1),
            ),
            types.TrainingRunsResponse,
        ),
        (
            s.WeightsInfoResponse(base_model="Qwen/Qwen3-0.6B", is_lora=True, lora_rank=8),
            types.WeightsInfoResponse,
        ),
        (s.RequestFailedResponse(error="bad", category="server"), types.RequestFailedResponse),
    ],
)
def test_it_answers_in_shapes_the_sdk_validates(ours: BaseModel, sdk_type: Any) -> None:
    body = json.loads(ours.model_dump_json())
    parsed = sdk_type.model_validate(body)
    # Every field we send is one the SDK reads: nothing silently dropped.
    assert set(body) <= set(type(parsed).model_fields)
    for name, value in body.items():
        if value is not None and not isinstance(value, dict | list):
            assert getattr(parsed, name) == getattr(ours, name), name


def test_it_refuses_sampling_requests_it_cannot_serve() -> None:
    base = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
        "sampling_params": {},
    }
    assert s.SampleRequest.model_validate(base).num_samples == 1
    for bad in (
        {"num_samples": 0},
        {"sampling_params": {"top_p": 0}},
        {"sampling_params": {"temperature": -1}},
        {"prompt": {"chunks": [{"type": "video"}]}},
    ):
        with pytest.raises(ValidationError):
            s.SampleRequest.model_validate(base | bad)
    with pytest.raises(ValidationError, match="base_model or model_path"):
        s.CreateSamplingSessionRequest.model_validate(
            {"session_id": "x", "sampling_session_seq_id": 0}
        )


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("num_samples", s.MAX_NUM_SAMPLES + 1, s.MAX_NUM_SAMPLES),
        ("num_samples", 10**6, 64),
        ("topk_prompt_logprobs", s.MAX_TOPK_LOGPROBS + 1, 20),
        ("topk_sample_logprobs", 10**6, 20),
        ("prompt_alt_tokens_k", s.MAX_PROMPT_ALT_TOKENS_K + 1, 8),
        ("seq_id", -1, 0),
        ("seq_id", 2**63, 2**63 - 1),
        ("seq_id", 10**30, 10**18),
    ],
)
def test_it_bounds_what_one_sample_request_may_ask_for(field: str, bad: int, good: int) -> None:
    base = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
        "sampling_params": {},
    }
    assert getattr(s.SampleRequest.model_validate(base | {field: good}), field) == good
    with pytest.raises(wire.WireError, match=f"^invalid SampleRequest: {field}: ") as err:
        wire.parse_json(s.SampleRequest, json.dumps(base | {field: bad}).encode())
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (s.CreateModelRequest, {"model_seq_id": 2**63}, "model_seq_id"),
        (s.CreateModelRequest, {"model_seq_id": 10**30}, "model_seq_id"),
        (s.CreateModelRequest, {"lora_config": {"rank": 4, "seed": 2**64}}, "lora_config.seed"),
        (s.OptimStepRequest, {"seq_id": 2**63}, "seq_id"),
        (s.OptimStepRequest, {"adam_params": {"learning_rate": "NaN"}}, "adam_params"),
        (s.SaveWeightsRequest, {"ttl_seconds": 10**30}, "ttl_seconds"),
        (s.SaveWeightsForSamplerRequest, {"sampling_session_seq_id": -1}, "sampling_session"),
        (s.LoadWeightsRequest, {"model_seq_id": 2**63}, "model_seq_id"),
        (s.CreateSamplingSessionRequest, {"sampling_session_seq_id": 2**63}, "sampling_session"),
        (s.CheckpointTtlRequest, {"ttl_seconds": -5}, "ttl_seconds"),
        # The SDK's range: an hour to ten years.
        (s.CheckpointTtlRequest, {"ttl_seconds": 3599}, "ttl_seconds"),
        (s.SaveWeightsRequest, {"ttl_seconds": 10 * 365 * 24 * 3600 + 1}, "ttl_seconds"),
    ],
)
def test_it_refuses_ids_and_counts_past_64_bits(
    model: type[BaseModel], body: dict[str, Any], field: str
) -> None:
    valid: dict[type[BaseModel], dict[str, Any]] = {
        s.CreateModelRequest: {"session_id": "s", "model_seq_id": 2**63 - 1, "base_model": "b"},
        s.OptimStepRequest: {"model_id": "m", "seq_id": 1, "adam_params": {}},
        s.SaveWeightsRequest: {"model_id": "m", "seq_id": 1, "ttl_seconds": 3600},
        s.SaveWeightsForSamplerRequest: {
            "model_id": "m",
            "seq_id": 1,
            "sampling_session_seq_id": 0,
        },
        s.LoadWeightsRequest: {
            "session_id": "s",
            "model_seq_id": 0,
            "path": "p",
            "optimizer": True,
        },
        s.CreateSamplingSessionRequest: {
            "session_id": "s",
            "sampling_session_seq_id": 0,
            "base_model": "b",
        },
        s.CheckpointTtlRequest: {"ttl_seconds": 3600},
    }
    model.model_validate(valid[model])
    with pytest.raises(wire.WireError, match=f": {field}") as err:
        wire.parse_json(model, json.dumps(valid[model] | body).encode())
    assert err.value.status == 400
