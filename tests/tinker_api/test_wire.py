"""The wire format against the real tinker SDK: its classes build and send the requests we
decode, and its converters parse the responses we encode."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)

import torch
import zstandard
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import request_conv, tinker_public_pb2
from tinker.types._pydantic_types.forward_backward_input import (
    ForwardBackwardInput as JsonForwardBackwardInput,
)

from tests.tinker_api._sdk import SdkWire
from tinker_api import _proto, wire
from tinker_api import schemas as s
from tinker_api.wire.forward_backward import MAX_REQUEST_SPARSE_ELEMENTS, MAX_REQUEST_TOKENS

torch.set_num_threads(1)


def send_forward_backward(
    data: list[types.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    *,
    compress: bool = False,
    forward_only: bool = False,
    seq_id: int = 3,
) -> SdkWire:
    """Have the SDK's training resource send a forward_backward; return what it sent."""
    sdk = SdkWire()
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id="sess-1:train:0",
        seq_id=seq_id,
    )
    sdk.call(
        lambda c: c.training.forward_backward(request=request, forward_only=forward_only),
        proto_compress_fwdbwd=compress,
    )
    return sdk


def decode_sent(sdk: SdkWire, **kwargs: object) -> wire.ForwardBackwardBatch:
    req = sdk.last
    return wire.decode_forward_backward(
        req.content,
        content_type=req.headers.get("content-type"),
        content_encoding=req.headers.get("content-encoding"),
        **kwargs,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- schema


def _normalized(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    prefix = f".{fdp.package}."
    out: dict[str, object] = {}

    def walk(msg: descriptor_pb2.DescriptorProto, scope: str) -> None:
        out[scope + msg.name] = (
            msg.options.map_entry,
            sorted(
                (
                    f.number,
                    f.name,
                    f.label,
                    f.type,
                    f.type_name.replace(prefix, ""),
                    msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
                    f.proto3_optional,
                )
                for f in msg.field
            ),
        )
        for nested in msg.nested_type:
            walk(nested, scope + msg.name + ".")

    for msg in fdp.message_type:
        walk(msg, "")
    for enum in fdp.enum_type:
        out["enum " + enum.name] = [(v.name, v.number) for v in enum.value]
    return out


def test_it_declares_the_same_protobuf_schema_as_the_sdk() -> None:
    sdk_fdp = descriptor_pb2.FileDescriptorProto()
    tinker_public_pb2.DESCRIPTOR.CopyToProto(sdk_fdp)
    ours, theirs = _normalized(_proto.FILE_DESCRIPTOR_PROTO), _normalized(sdk_fdp)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize("compress", [False, True])
def test_it_decodes_what_the_sdk_sends_to_forward_backward(compress: bool) -> None:
    rng = np.random.default_rng(0)
    advantages = rng.normal(size=5).astype(np.float32)
    data = [
        types.Datum(
            # Two chunks: the decoder joins them.
            model_input=types.ModelInput(
                chunks=[
                    types.EncodedTextChunk(tokens=[11, 12]),
                    types.EncodedTextChunk(tokens=[13, 14, 2**31 - 1]),
                ]
            ),
            loss_fn_inputs={
                "target_tokens": [12, 13, 14, 15, 0],
                "logprobs": torch.tensor([-0.5, -1.25, -2.0, -0.125, -3.0]),
                "advantages": advantages,
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([7, 8]),
            # Custom losses send weights = -dLoss/dlogprobs, negative ones included; inputs
            # a loss does not read travel too.
            loss_fn_inputs={
                "target_tokens": [8, 9],
                "logprobs": [-0.5, -0.5],
                "advantages": [0.0, 1.0],
                "weights": [-1.5, 0.25],
            },
        ),
    ]
    sdk = send_forward_backward(
        data,
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "note": "x"},
        compress=compress,
    )

    assert sdk.last.url.path == "/api/v1/forward_backward"
    assert sdk.last.headers["content-type"] == wire.PROTOBUF
    assert sdk.last.headers.get("content-encoding") == ("zstd" if compress else None)
    # Decoded as sent: "note" (a string, which travels in loss_fn_config_v2) is no ppo knob,
    # which the checks refuse.
    with pytest.raises(wire.WireError, match=r"unknown loss_fn_config keys \['note'\]"):
        decode_sent(sdk)
    batch = decode_sent(sdk, check=False)

    assert (batch.model_id, batch.seq_id, batch.loss_fn, batch.forward_only) == (
        "sess-1:train:0",
        3,
        "ppo",
        False,
    )
    assert batch.loss_fn_config == {
        "clip_low_threshold": pytest.approx(0.8),
        "clip_high_threshold": pytest.approx(1.2),
        "note": "x",
    }
    first, second = batch.data
    assert first.tokens == [11, 12, 13, 14, 2**31 - 1]
    assert first.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert first.loss_fn_inputs["target_tokens"].tolist() == [12, 13, 14, 15, 0]
    assert first.loss_fn_inputs["logprobs"].dtype == np.float32
    assert first.loss_fn_inputs["logprobs"].tolist() == [-0.5, -1.25, -2.0, -0.125, -3.0]
    np.testing.assert_array_equal(first.loss_fn_inputs["advantages"], advantages)
    assert second.tokens == [7, 8]
    assert second.loss_fn_inputs["weights"].tolist() == [-1.5, 0.25]
    assert second.torch_inputs()["weights"].dtype == torch.float32


def test_it_expands_sparse_tensors_as_the_sdk_densifies_them() -> None:
    # Top-k distillation targets: (positions, k) tensors, mostly padding, which the SDK
    # sends as CSR.
    targets = torch.zeros(6, 4, dtype=torch.int64)
    weights = torch.zeros(6, 4, dtype=torch.float32)
    targets[0, 1], targets[3, 0], targets[3, 3], targets[5, 2] = 17, 4, 9, 21
    weights[0, 1], weights[3, 0], weights[3, 3], weights[5, 2] = 0.5, -0.25, 0.75, 1.0
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(100, 106))),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    sent = datum.loss_fn_inputs
    assert sent["target_tokens"].sparse_crow_indices is not None  # the sparse path is taken
    assert sent["weights"].sparse_crow_indices is not None

    batch = decode_sent(send_forward_backward([datum], compress=True))

    got = batch.data[0].loss_fn_inputs
    assert got["target_tokens"].shape == (6, 4)
    np.testing.assert_array_equal(got["target_tokens"], sent["target_tokens"].to_numpy())
    np.testing.assert_array_equal(got["weights"], sent["weights"].to_numpy())
    np.testing.assert_array_equal(got["weights"], weights.numpy())


def test_it_reads_forward_only_and_provenance_spans() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 0.0, 1.0, 1.0]},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="seq-a", offset=0, length=2),
            types.SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=2),
        ],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="seq-a", offset=1, length=4)],
    )
    batch = decode_sent(send_forward_backward([datum], forward_only=True, seq_id=9))

    assert batch.forward_only and batch.seq_id == 9
    assert batch.data[0].model_input_spans == [
        wire.ProvenanceSpan("prompt", "seq-a", 0, 2),
        wire.ProvenanceSpan("sampled", "seq-a", 0, 2),
    ]
    assert batch.data[0].loss_fn_input_spans == [wire.ProvenanceSpan("sampled", "seq-a", 1, 4)]


def test_it_decodes_the_json_form_older_clients_send() -> None:
    targets = torch.zeros(3, 5, dtype=torch.int64)
    targets[1, 2] = 42
    fbi = JsonForwardBackwardInput(
        data=[
            {
                "model_input": types.ModelInput.from_ints([5, 6, 7]),
                "loss_fn_inputs": {"target_tokens": targets, "weights": [0.0, -2.0, 1.0]},
            }
        ],
        loss_fn="cross_entropy",
        # No knob of cross_entropy's: decoded without the checks, which would refuse it.
        loss_fn_config={"beta": 0.1},
    )
    sparse = fbi.data[0].loss_fn_inputs["target_tokens"]
    assert sparse.sparse_crow_indices is not None
    body = {
        "forward_backward_input": fbi.model_dump(mode="json", exclude_none=True),
        "model_id": "m-1",
        "seq_id": 4,
        "type": "forward_backward",
    }
    raw = s.ForwardBackwardRequestJson.model_validate(body).model_dump_json().encode()
    raw_compressed = zstandard.ZstdCompressor().compress(raw)

    for payload, encoding in ((raw, None), (raw_compressed, "zstd")):
        batch = wire.decode_forward_backward(
            payload,
            content_type="application/json; charset=utf-8",
            content_encoding=encoding,
            check=False,
        )
        assert (batch.model_id, batch.seq_id, batch.loss_fn_config) == ("m-1", 4, {"beta": 0.1})
        datum = batch.data[0]
        assert datum.tokens == [5, 6, 7]
        np.testing.assert_array_equal(datum.loss_fn_inputs["target_tokens"], targets.numpy())
        assert datum.loss_fn_inputs["weights"].tolist() == [0.0, -2.0, 1.0]
    assert wire.decode_forward_backward(
        raw, content_type="application/json", forward_only=True, check=False
    )


def test_it_refuses_image_chunks_for_a_text_only_model_with_a_clear_user_error() -> None:
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[1, 2]),
                types.ImageChunk(data=b"\x89PNG....", format="png", expected_tokens=1),
            ]
        ),
        loss_fn_inputs={"target_tokens": [2, 3, 4]},
    )
    # Images reach a model only once expanded for a vision-language base model
    # (tests/tinker_api/test_sdk_images.py); a batch that still holds them is refused.
    with pytest.raises(wire.WireError, match="holds images, but the base model takes none") as err:
        decode_sent(send_forward_backward([datum]))
    assert err.value.status == 400 and err.value.category == "user"

    prompt = types.ModelInput(
        chunks=[types.ImageAssetPointerChunk(location="s3://x.png", format="png")]
    )
    parsed = s.ModelInputJson.model_validate(prompt.model_dump(mode="json"))
    with pytest.raises(wire.WireError, match="image chunks are not accepted here"):
        wire.model_input_tokens(parsed)
    text_only = s.SampleRequest.model_validate(
        {"num_samples": 1, "prompt": prompt.model_dump(mode="json"), "sampling_params": {}}
    )
    with pytest.raises(wire.WireError, match=r"prompt.chunks\[0\]: .*text-only model"):
        wire.sample_prompt(text_only)


def _one_datum(**inputs: types.TensorData | list[float] | list[int]) -> list[types.Datum]:
    """A three-token datum with ``inputs`` over unit cross-entropy weights."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"weights": [1.0, 1.0, 1.0], **inputs},
        )
    ]


@pytest.mark.parametrize(
    ("data", "loss_fn", "message"),
    [
        (_one_datum(target_tokens=[2, 3]), "cross_entropy", "must equal the 3 input tokens"),
        (
            _one_datum(target_tokens=[2, 3, 4], logprobs=[-1.0] * 3, advantages=[0, math.nan, 1]),
            "importance_sampling",
            "NaN or infinity",
        ),
        (_one_datum(target_tokens=[2, 3, 4]), "dpo", "unknown loss_fn 'dpo'"),
        (
            _one_datum(target_tokens=[2, 3, 4], advantages=[1.0, 1.0, 1.0]),
            "importance_sampling",
            r"missing \['logprobs'\]",
        ),
        (
            _one_datum(target_tokens=[2, 3, 4], advantages=[1.0] * 3, logprobs=[-1.0] * 3),
            "stable_reinforce",
            "needs provenance spans",
        ),
        (
            _one_datum(
                target_tokens=types.TensorData(
                    data=[5, 6],
                    dtype="int64",
                    shape=[3, 2],
                    sparse_crow_indices=[0, 1, 2, 2],
                    sparse_col_indices=[0, 7],
                )
            ),
            "cross_entropy",
            "column index out of range",
        ),
        (
            _one_datum(
                target_tokens=types.TensorData(
                    data=[5, 6],
                    dtype="int64",
                    shape=[3, 2],
                    sparse_crow_indices=[0, 2, 1, 2],
                    sparse_col_indices=[0, 1],
                )
            ),
            "cross_entropy",
            "must not decrease",
        ),
        (
            _one_datum(
                target_tokens=[2, 3, 4],
                extra=types.TensorData(
                    data=[],
                    dtype="float32",
                    shape=[1, 10**12],
                    sparse_crow_indices=[0, 0],
                    sparse_col_indices=[],
                ),
            ),
            "cross_entropy",
            "expands past",
        ),
        (
            [types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs={})],
            "cross_entropy",
            "has no tokens",
        ),
    ],
)
def test_it_refuses_inconsistent_datums(
    data: list[types.Datum], loss_fn: str, message: str
) -> None:
    with pytest.raises(wire.WireError, match=message):
        decode_sent(send_forward_backward(data, loss_fn))


def _corrupted(edit: object) -> bytes:
    """A body the SDK could not produce: its proto with one field changed by ``edit``."""
    msg = request_conv.forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=_one_datum(target_tokens=[2, 3, 4]), loss_fn="cross_entropy"
            ),
            model_id="m",
            seq_id=1,
        )
    )
    edit(msg.data[0])  # type: ignore[operator]
    return msg.SerializeToString()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.loss_fn_inputs["target_tokens"].shape.extend([2]), "does not hold 3 values"),
        (lambda d: setattr(d.loss_fn_inputs["target_tokens"], "dtype", 0), "unknown dtype"),
        (lambda d: setattr(d.loss_fn_inputs["target_tokens"], "dense", b"\0" * 7), "multiple"),
        (
            lambda d: setattr(d.model_input[0].encoded_text, "tokens", b"\xff\xff\xff\xff"),
            "must not be negative",
        ),
        (lambda d: setattr(d.model_input[0].encoded_text, "tokens", b"\1\0\0"), "whole number"),
        (lambda d: d.model_input.add().dmel.SetInParent(), "dmel chunks are not supported"),
    ],
)
def test_it_refuses_hand_made_corrupt_protobuf(edit: object, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_forward_backward(_corrupted(edit), content_type=wire.PROTOBUF)


def test_it_refuses_malformed_bodies_with_the_right_status() -> None:
    sdk = send_forward_backward(_one_datum(target_tokens=[2, 3, 4]))
    good = sdk.last.content

    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest protobuf"):
        wire.decode_forward_backward(b"\xff\xff\xff\x07garbage", content_type=wire.PROTOBUF)
    with pytest.raises(wire.WireError, match=r"not a zstd frame|not valid zstd"):
        wire.decode_forward_backward(good, content_type=wire.PROTOBUF, content_encoding="zstd")
    with pytest.raises(wire.WireError) as err:
        wire.decode_forward_backward(good, content_type="text/plain")
    assert err.value.status == 415
    with pytest.raises(wire.WireError) as err:
        wire.decode_forward_backward(good, content_type=wire.PROTOBUF, content_encoding="br")
    assert err.value.status == 415
    # A small frame that expands past the limit is refused before it is inflated.
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 100_000)
    with pytest.raises(wire.WireError) as err:
        wire.decode_forward_backward(
            bomb, content_type=wire.PROTOBUF, content_encoding="zstd", max_decoded_bytes=50_000
        )
    assert err.value.status == 413 and len(bomb) < 1000
    # The same without the content size in its frame header: still 413, not "not valid zstd".
    sizeless = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 100_000)
    with pytest.raises(wire.WireError) as err:
        wire.decompress(sizeless, "zstd", max_bytes=50_000)
    assert err.value.status == 413 and "expands past the 50000-byte limit" in str(err.value)
    assert len(wire.decompress(sizeless, "zstd", max_bytes=100_000)) == 100_000
    with pytest.raises(wire.WireError, match="not valid zstd") as err:
        wire.decompress(sizeless[:-3], "zstd", max_bytes=200_000)
    assert err.value.status == 400
    with pytest.raises(
        wire.WireError, match="invalid ForwardBackwardRequestJson: forward_backward_input"
    ):
        wire.decode_forward_backward(b'{"model_id": "m"}', content_type="application/json")
    overflow = {
        "model_id": "m",
        "seq_id": 1,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [2**70], "dtype": "int64"},
                        "weights": {"data": [1.0], "dtype": "float32"},
                    },
                }
            ],
        },
    }
    with pytest.raises(wire.WireError, match="does not fit in int64"):
        wire.decode_forward_backward(json.dumps(overflow).encode(), content_type=wire.JSON)
    empty = request_conv.forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="cross_entropy"),
            model_id="m",
            seq_id=1,
        )
    ).SerializeToString()
    with pytest.raises(wire.WireError, match="no data"):
        wire.decode_forward_backward(empty, content_type=wire.PROTOBUF)
    zero_seq = request_conv.forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=_one_datum(target_tokens=[2, 3, 4]), loss_fn="cross_entropy"
            ),
            model_id="m",
        )
    ).SerializeToString()
    with pytest.raises(wire.WireError, match="seq_id must be 1 or more"):
        wire.decode_forward_backward(zero_seq, content_type=wire.PROTOBUF)


def _proto_request(data: list[types.Datum]) -> bytes:
    return request_conv.forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id="m",
            seq_id=4,
        )
    ).SerializeToString()


def test_it_bounds_what_one_forward_backward_request_makes_the_server_build() -> None:
    datum = _one_datum(target_tokens=[2, 3, 4])[0]
    too_many = _proto_request([datum] * (s.MAX_DATUMS + 1))
    with pytest.raises(wire.WireError, match=f"{s.MAX_DATUMS + 1} datums, over the limit") as err:
        wire.decode_forward_backward(too_many, content_type=wire.PROTOBUF)
    assert err.value.status == 400
    as_json = {
        "model_id": "m",
        "seq_id": 4,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [{"model_input": {"chunks": []}}] * (s.MAX_DATUMS + 1),
        },
    }
    with pytest.raises(wire.WireError, match=r"forward_backward_input\.data: List should have at"):
        wire.decode_forward_backward(json.dumps(as_json).encode(), content_type=wire.JSON)

    chunks = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1])] * (s.MAX_CHUNKS + 1))
    many_chunks = types.Datum(model_input=chunks, loss_fn_inputs={})
    with pytest.raises(wire.WireError, match=r"data\[0\].model_input: 4097 chunks"):
        wire.decode_forward_backward(_proto_request([many_chunks]), content_type=wire.PROTOBUF)

    n = MAX_REQUEST_TOKENS // 2 + 1
    long = types.Datum(model_input=types.ModelInput.from_ints([1] * n), loss_fn_inputs={})
    with pytest.raises(wire.WireError, match=f"{2 * n} model input tokens, over the limit"):
        wire.decode_forward_backward(_proto_request([long, long]), content_type=wire.PROTOBUF)

    # Each sparse input is within its own bound; together they would expand past it.
    width = MAX_REQUEST_SPARSE_ELEMENTS // 3 // 4 + 1
    wide = types.TensorData(
        data=[1.0],
        dtype="float32",
        shape=[3, width],
        sparse_crow_indices=[0, 1, 1, 1],
        sparse_col_indices=[0],
    )
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"weights": wide}
    )
    with pytest.raises(
        wire.WireError, match=r"data\[3\].loss_fn_inputs\['weights'\]: the sparse"
    ) as err:
        wire.decode_forward_backward(_proto_request([sparse] * 4), content_type=wire.PROTOBUF)
    assert err.value.status == 413


def test_it_reads_the_model_and_seq_id_of_a_body_it_refuses() -> None:
    corrupt = _corrupted(lambda d: setattr(d.loss_fn_inputs["target_tokens"], "dtype", 0))
    assert wire.forward_backward_position(corrupt, wire.PROTOBUF) == ("m", 1)
    assert wire.forward_backward_position(b"\xff\xff\xff\x07garbage", wire.PROTOBUF) is None
    body = b'{"model_id": "m", "seq_id": 7, "adam_params": {"learning_rate": "fast"}}'
    assert wire.json_position(body) == ("m", 7)
    assert wire.forward_backward_position(body, "application/json; charset=utf-8") == ("m", 7)
    for unreadable in (
        b'{"model_id": "m", "seq_id": "7"}',
        b'{"model_id": "m", "seq_id": true}',
        b'{"model_id": 5, "seq_id": 7}',
        b'{"seq_id": 7}',
        b"[1, 2]",
        b"{" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff",
    ):
        assert wire.json_position(unreadable) is None, unreadable
