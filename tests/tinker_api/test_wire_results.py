"""The results we encode against the real tinker SDK: its converters parse our forward/backward
and sampling answers, its futures code reads our replies and tinker:// paths."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)

import torch
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids
from tinker.proto import response_conv
from tinker.types.try_again_response import TryAgainResponse

from tinker_api import schemas as s
from tinker_api import wire

torch.set_num_threads(1)


# --------------------------------------------------------------------------- results


def test_it_encodes_forward_backward_output_the_sdk_parses() -> None:
    outputs = [
        {"logprobs": np.array([-0.5, -1.5, -2.25], dtype=np.float64), "ids": np.array([1, 2, 3])},
        {"logprobs": torch.tensor([-0.75], dtype=torch.bfloat16), "ids": torch.tensor([7])},
        {"logprobs": [-3.0, -4.0], "ids": [9, 10]},
    ]
    metrics = {"loss:sum": 7.5, "tokens:sum": 6.0, "clip_frac:mean": 0.25}
    body = wire.encode_forward_backward_output(outputs, metrics, protobuf=True)
    assert body.content_type == "application/x-protobuf"

    out = response_conv.deserialize_proto_response(body.content, types.ForwardBackwardOutput)

    assert isinstance(out, types.ForwardBackwardOutput)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == metrics
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [
        [-0.5, -1.5, -2.25],
        [-0.75],
        [-3.0, -4.0],
    ]
    assert [o["logprobs"].dtype for o in out.loss_fn_outputs] == ["float32"] * 3
    assert [o["ids"].tolist() for o in out.loss_fn_outputs] == [[1, 2, 3], [7], [9, 10]]
    assert out.loss_fn_outputs[0]["logprobs"].shape == [3]


def test_it_emits_metrics_the_sdk_folds_across_chunks() -> None:
    chunks = [
        wire.encode_forward_backward_output(
            [{"logprobs": [-1.0]}] * n, {"loss:sum": loss, "acc:mean": acc}, protobuf=True
        )
        for n, loss, acc in ((1, 2.0, 1.0), (3, 5.0, 0.0))
    ]
    parsed = [response_conv.deserialize_forward_backward_output(c.content) for c in chunks]

    combined = combine_fwd_bwd_output_results(parsed)

    assert combined.metrics == {"loss:sum": 7.0, "acc:mean": 0.25}
    assert len(combined.loss_fn_outputs) == 4
    for bad in ({"loss": 1.0}, {"loss:sum:x": 1.0}, {"loss:median": 1.0}):
        with pytest.raises(ValueError, match="name:reduction"):
            wire.encode_forward_backward_output([{"logprobs": [0.0]}], bad, protobuf=True)


def test_it_splits_records_where_per_datum_shapes_change() -> None:
    outputs = [
        {"topk": np.arange(6, dtype=np.float32).reshape(3, 2)},
        {"topk": np.arange(4, dtype=np.float32).reshape(2, 2)},
        {"topk": np.arange(5, dtype=np.float32).reshape(1, 5)},
        {"topk": np.float32(0.5)},
    ]
    body = wire.encode_forward_backward_output(outputs, {}, protobuf=True)

    out = response_conv.deserialize_forward_backward_output(body.content)

    assert [o["topk"].shape for o in out.loss_fn_outputs] == [[3, 2], [2, 2], [1, 5], [1]]
    for sent, got in zip(outputs, out.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(got["topk"].to_numpy().reshape(-1), np.ravel(sent["topk"]))
    with pytest.raises(ValueError, match="has fields"):
        wire.encode_forward_backward_output(
            [{"logprobs": [0.0]}, {"other": [0.0]}], {}, protobuf=True
        )


def test_it_encodes_sample_responses_the_sdk_parses() -> None:
    sequences = [
        wire.SampledSequenceOut(
            tokens=[5, 6, 2],
            stop_reason="stop",
            logprobs=[-0.25, -1.5, -0.125],
            topk_logprobs=[[(5, -0.25), (9, -2.0)], [(6, -1.5)], None],
        ),
        wire.SampledSequenceOut(tokens=[8, 8, 8, 8], stop_reason="length"),
    ]
    prompt_logprobs = [None, -3.5, -0.5, None]
    topk_prompt = [None, [(11, -0.5), (12, -1.0), (13, -4.0)], [(14, -0.25)], None]
    body = wire.encode_sample_response(
        sequences,
        protobuf=True,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk_prompt,
    )
    ids = wire.future_created("req-9", sample_sequence_ids=["s-0", "s-1"]).body

    parsed = response_conv.deserialize_proto_response(body.content, types.SampleResponse)
    assert isinstance(parsed, types.SampleResponse)
    # What SamplingClient does with the /asample reply before handing the result over.
    out = _attach_sequence_ids(
        parsed, types.UntypedAPIFuture.model_validate(ids).sample_sequence_ids
    )

    first, second = out.sequences
    assert (first.sequence_id, second.sequence_id) == ("s-0", "s-1")
    assert (first.stop_reason, second.stop_reason) == ("stop", "length")
    assert first.tokens == [5, 6, 2] and second.tokens == [8, 8, 8, 8]
    assert first.logprobs == [-0.25, -1.5, -0.125]
    assert second.logprobs is None and second.topk_logprobs is None
    assert first.topk_logprobs == [[(5, -0.25), (9, -2.0)], [(6, -1.5)], None]
    assert out.prompt_logprobs == [None, -3.5, -0.5, None]
    assert out.topk_prompt_logprobs == topk_prompt


def test_it_marks_every_topk_position_empty_without_dropping_the_field() -> None:
    body = wire.encode_sample_response(
        [wire.SampledSequenceOut(tokens=[1], stop_reason="length")],
        protobuf=True,
        prompt_logprobs=[None],
        topk_prompt_logprobs=[None],
    )
    out = response_conv.deserialize_sample_response(body.content)
    assert out.prompt_logprobs == [None]
    assert out.topk_prompt_logprobs == [None]


def test_it_answers_json_when_the_client_does_not_ask_for_protobuf() -> None:
    assert wire.wants_protobuf("application/x-protobuf")
    assert wire.wants_protobuf("application/json, application/x-protobuf;q=0.9")
    assert not wire.wants_protobuf("application/json")
    assert not wire.wants_protobuf(None)

    sample = wire.encode_sample_response(
        [wire.SampledSequenceOut(tokens=[3], stop_reason="stop", logprobs=[-1.0], sequence_id="a")],
        protobuf=False,
        prompt_logprobs=np.array([np.nan, -2.0]),
    )
    parsed = s.SampleResponseJson.model_validate_json(sample.content)
    assert sample.content_type == "application/json"
    assert parsed.prompt_logprobs == [None, -2.0]
    assert parsed.sequences[0].sequence_id == "a"

    fwd = wire.encode_forward_backward_output(
        [{"logprobs": np.array([[-1.0, -2.0]])}], {"loss:sum": math.nan}, protobuf=False
    )
    parsed_fwd = s.ForwardBackwardOutputJson.model_validate_json(fwd.content)
    logprobs = parsed_fwd.loss_fn_outputs[0]["logprobs"]
    assert (logprobs.data, logprobs.shape, logprobs.dtype) == ([-1.0, -2.0], [1, 2], "float32")
    assert parsed_fwd.metrics == {"loss:sum": None}
    # The SDK's JSON TensorData reads the same array back.
    sdk_td = types.TensorData(data=logprobs.data, dtype=logprobs.dtype, shape=logprobs.shape)
    assert sdk_td.to_numpy().tolist() == [[-1.0, -2.0]]


# --------------------------------------------------------------------------- futures


def test_it_builds_future_replies_the_sdk_understands() -> None:
    pending = wire.try_again("req-1", "paused_capacity", "GPU busy")
    failed = wire.request_failed("loss is NaN", "user")
    created = wire.future_created("req-2", model_id="sess:train:0")

    assert pending.status == 408
    assert TryAgainResponse.model_validate(pending.body).queue_state == "paused_capacity"
    assert failed.status == 200
    sdk_failed = types.RequestFailedResponse.model_validate(failed.body)
    assert sdk_failed.category is types.RequestErrorCategory.User
    assert sdk_failed.error == "loss is NaN"
    assert types.UntypedAPIFuture.model_validate(created.body).model_id == "sess:train:0"
    assert wire.expired("req-3").status == 410
    assert wire.sampling_backpressure().status == 429


def test_it_names_checkpoints_the_way_the_sdk_parses_them() -> None:
    path = wire.tinker_path(wire.model_id_for("sess-7", 2), "sampler", "step-10")
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)

    assert parsed.training_run_id == "sess-7:train:2"
    assert parsed.checkpoint_type == "sampler"
    assert parsed.checkpoint_id == "sampler_weights/step-10"
    assert wire.parse_tinker_path(path) == ("sess-7:train:2", "sampler", "step-10")
    for bad in ("s3://x/weights/a", "tinker://run/weights", "tinker://run/other/a"):
        with pytest.raises(wire.WireError, match="invalid tinker path"):
            wire.parse_tinker_path(bad)
    with pytest.raises(ValueError):
        wire.tinker_path("run", "training", "a/b")
