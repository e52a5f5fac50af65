"""The protobuf messages of the Tinker public wire format, declared without generated code.

The SDK ships its schema as ``tinker/proto/tinker_public_pb2.py``; the server must not
import the SDK, and generated ``_pb2`` files pin the protoc that made them, so the schema
is declared here as a table and built into a private descriptor pool at import. Only the
field numbers and types reach the wire: the package name differs from the SDK's on purpose,
so both schemas can live in one process (the tests load both and compare them).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "opentinker.tinker_wire"

# Scalar type names as they appear in the table below.
_SCALARS: dict[str, int] = {
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
    "float": descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
}

_ENUMS: dict[str, list[tuple[str, int]]] = {
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
}

# message -> [(number, name, kind, type, oneof)] where kind is "one" (singular, no
# presence), "opt" (proto3 optional), "rep" (repeated), "map" (type = "key,value") or
# "oneof" (member of the named real oneof). Mirrors tinker_public.proto of tinker 0.38.
_Field = tuple[int, str, str, str, str | None]
_MESSAGES: dict[str, list[_Field]] = {
    "SampleResponse": [
        (1, "sequences", "rep", "SampledSequence", None),
        (2, "prompt_logprobs", "opt", "bytes", None),
        (3, "topk_prompt_logprobs", "opt", "TopkLogprobs", None),
        (4, "prompt_cache_hit_tokens", "one", "int32", None),
        (5, "target_prompt_logprobs", "opt", "Tensor", None),
        (6, "prompt_alt_tokens", "opt", "PromptAltTokens", None),
    ],
    "PromptAltTokens": [
        (1, "tokens", "one", "Tensor", None),
        (2, "logprobs", "one", "Tensor", None),
    ],
    "SampledSequence": [
        (1, "stop_reason", "one", "StopReason", None),
        (2, "tokens", "one", "bytes", None),
        (3, "logprobs", "opt", "bytes", None),
        (4, "topk_sampled_logprobs", "opt", "TopkLogprobs", None),
    ],
    "TopkLogprobs": [
        (1, "token_ids", "one", "bytes", None),
        (2, "logprobs", "one", "bytes", None),
        (3, "k", "one", "uint32", None),
        (4, "length", "one", "uint32", None),
    ],
    "SparseCsr": [
        (1, "values", "one", "bytes", None),
        (2, "crow_indices", "one", "bytes", None),
        (3, "col_indices", "one", "bytes", None),
    ],
    "Tensor": [
        (1, "dense", "oneof", "bytes", "encoding"),
        (2, "sparse_csr", "oneof", "SparseCsr", "encoding"),
        (3, "dtype", "one", "DType", None),
        (4, "shape", "rep", "int64", None),
    ],
    "BatchedTensor": [
        (1, "data", "one", "bytes", None),
        (2, "offsets", "one", "bytes", None),
        (3, "dtype", "one", "DType", None),
        (4, "trailing_shape", "rep", "int64", None),
    ],
    "ArrayRecord": [
        (1, "type_tag", "one", "string", None),
        (2, "fields", "map", "string,BatchedTensor", None),
        (3, "num_datums", "one", "int64", None),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", "one", "string", None),
        (2, "loss_fn_outputs", "rep", "ArrayRecord", None),
        (3, "metrics", "map", "string,double", None),
    ],
    "ForwardBackwardRequest": [
        (1, "model_id", "one", "string", None),
        (2, "seq_id", "one", "int32", None),
        (3, "data", "rep", "Datum", None),
        (4, "loss_fn", "one", "string", None),
        (5, "loss_fn_config", "map", "string,double", None),
        (6, "forward_only", "one", "bool", None),
        (7, "loss_fn_config_v2", "map", "string,LossConfigValue", None),
    ],
    "LossConfigValue": [
        (1, "number", "oneof", "double", "value"),
        (2, "text", "oneof", "string", "value"),
    ],
    "Datum": [
        (1, "model_input", "rep", "Chunk", None),
        (2, "loss_fn_inputs", "map", "string,Tensor", None),
        (3, "model_input_spans", "rep", "ProvenanceSpan", None),
        (4, "loss_fn_input_spans", "rep", "ProvenanceSpan", None),
    ],
    "ProvenanceSpan": [
        (1, "prompt_tokens", "oneof", "PromptProvenanceSpan", "span"),
        (2, "sampled_tokens", "oneof", "SampledProvenanceSpan", "span"),
    ],
    "PromptProvenanceSpan": [
        (1, "sequence_id", "one", "string", None),
        (2, "offset", "one", "int64", None),
        (3, "length", "one", "int64", None),
    ],
    "SampledProvenanceSpan": [
        (1, "sequence_id", "one", "string", None),
        (2, "offset", "one", "int64", None),
        (3, "length", "one", "int64", None),
    ],
    "Chunk": [
        (1, "encoded_text", "oneof", "EncodedTextChunk", "chunk"),
        (2, "image", "oneof", "ImageChunk", "chunk"),
        (3, "dmel", "oneof", "DmelChunk", "chunk"),
    ],
    "EncodedTextChunk": [(1, "tokens", "one", "bytes", None)],
    "ImageChunk": [
        (1, "data", "one", "bytes", None),
        (2, "format", "one", "string", None),
        (3, "expected_tokens", "opt", "int32", None),
        (4, "override_dimensions", "opt", "ImageDimensions", None),
    ],
    "ImageDimensions": [
        (1, "width", "one", "uint32", None),
        (2, "height", "one", "uint32", None),
    ],
    "DmelChunk": [(1, "dmel", "one", "bytes", None)],
    "SamplingParams": [
        (1, "max_tokens", "opt", "int32", None),
        (2, "seed", "opt", "uint64", None),
        (3, "temperature", "opt", "float", None),
        (4, "top_k", "opt", "int32", None),
        (5, "top_p", "opt", "float", None),
        (6, "stop_strs", "oneof", "StopStrings", "stop"),
        (7, "stop_tokens", "oneof", "StopTokens", "stop"),
    ],
    "StopStrings": [(1, "values", "rep", "string", None)],
    "StopTokens": [(1, "values", "rep", "int32", None)],
}

_F = descriptor_pb2.FieldDescriptorProto


def _set_type(field: _F, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]  # type: ignore[assignment]
    elif type_name in _ENUMS:
        field.type = _F.TYPE_ENUM
        field.type_name = f".{_PACKAGE}.{type_name}"
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{type_name}"


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="opentinker/tinker_wire.proto", package=_PACKAGE, syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = fdp.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for msg_name, fields in _MESSAGES.items():
        msg = fdp.message_type.add(name=msg_name)
        # Real oneofs come first in declaration order, then one synthetic oneof per
        # proto3-optional field, as protoc lays them out.
        real_oneofs: list[str] = []
        for *_, oneof in fields:
            if oneof is not None and oneof not in real_oneofs:
                real_oneofs.append(oneof)
        for oneof in real_oneofs:
            msg.oneof_decl.add(name=oneof)
        for number, name, kind, type_name, oneof in fields:
            field = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
            if kind == "map":
                key_type, value_type = type_name.split(",")
                entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
                entry = msg.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                key = entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL)
                _set_type(key, key_type)
                value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
                _set_type(value, value_type)
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{msg_name}.{entry_name}"
                continue
            _set_type(field, type_name)
            if kind == "rep":
                field.label = _F.LABEL_REPEATED
            elif kind == "oneof":
                assert oneof is not None
                field.oneof_index = real_oneofs.index(oneof)
            elif kind == "opt":
                field.proto3_optional = True
                field.oneof_index = len(msg.oneof_decl)
                msg.oneof_decl.add(name=f"_{name}")
    return fdp


FILE_DESCRIPTOR_PROTO = _build_file()
_pool = descriptor_pool.DescriptorPool()
_file = _pool.Add(FILE_DESCRIPTOR_PROTO)


def _message_class(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


ForwardBackwardRequest = _message_class("ForwardBackwardRequest")
ForwardBackwardOutput = _message_class("ForwardBackwardOutput")
SampleResponse = _message_class("SampleResponse")
Tensor = _message_class("Tensor")
TopkLogprobs = _message_class("TopkLogprobs")

DTYPE_UNSPECIFIED = 0
DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1
