"""Decode what the tinker SDK sends and encode what it reads back.

Pure functions over bytes and headers, no Django. One module per part of the protocol:
``media`` (media types, compression, JSON bodies), ``tensors`` (token and tensor codecs),
``forward_backward`` and ``sampling`` (their requests and results), ``replies`` (futures and
polls), ``paths`` (model ids and ``tinker://`` paths). Callers use the names re-exported here.
"""

from __future__ import annotations

from tinker_api.wire.forward_backward import (
    REQUIRED_INPUTS,
    ForwardBackwardBatch,
    ProvenanceSpan,
    WireDatum,
    check_batch,
    decode_forward_backward,
    encode_forward_backward_output,
    expand_images,
    forward_backward_position,
    geometry_count,
)
from tinker_api.wire.images import ImageGeometry, WireImage, counter
from tinker_api.wire.media import (
    JSON,
    PROTOBUF,
    WireError,
    decompress,
    json_position,
    parse_json,
    wants_protobuf,
)
from tinker_api.wire.paths import model_id_for, parse_tinker_path, tinker_path
from tinker_api.wire.replies import (
    Reply,
    expired,
    future_created,
    request_failed,
    sampling_backpressure,
    try_again,
)
from tinker_api.wire.sampling import (
    MAX_SCORE_CELLS,
    PromptTargets,
    SampledSequenceOut,
    check_topk_sample,
    encode_sample_response,
    prompt_targets,
    sample_prompt,
)
from tinker_api.wire.tensors import TensorOut, model_input_tokens

__all__ = [
    "JSON",
    "MAX_SCORE_CELLS",
    "PROTOBUF",
    "REQUIRED_INPUTS",
    "ForwardBackwardBatch",
    "ImageGeometry",
    "PromptTargets",
    "ProvenanceSpan",
    "Reply",
    "SampledSequenceOut",
    "TensorOut",
    "WireDatum",
    "WireError",
    "WireImage",
    "check_batch",
    "check_topk_sample",
    "counter",
    "decode_forward_backward",
    "decompress",
    "encode_forward_backward_output",
    "encode_sample_response",
    "expand_images",
    "expired",
    "forward_backward_position",
    "future_created",
    "geometry_count",
    "json_position",
    "model_id_for",
    "model_input_tokens",
    "parse_json",
    "parse_tinker_path",
    "prompt_targets",
    "request_failed",
    "sample_prompt",
    "sampling_backpressure",
    "tinker_path",
    "try_again",
    "wants_protobuf",
]
