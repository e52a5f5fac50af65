"""``/forward_backward`` and ``/forward``: decode the request, encode the result.

The layouts mirror ``tinker/proto/request_conv.py`` and ``response_conv.py``: per-datum
outputs go back batched into ``ArrayRecord``s of ``BatchedTensor``s, as protobuf when the
poll carries ``Accept: application/x-protobuf`` (the 0.38 SDK refuses JSON there) and as JSON
otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from google.protobuf.message import DecodeError

from accounts.json_checks import NUL_REASON
from tinker_api import _proto
from tinker_api import schemas as s
from tinker_api.wire.images import ImageGeometry, WireImage, counter, expand, image_chunk
from tinker_api.wire.media import (
    DEFAULT_MAX_DECODED_BYTES,
    JSON,
    PROTOBUF,
    EncodedBody,
    WireError,
    decompress,
    json_position,
    known_id,
    media_type,
    parse_json,
)
from tinker_api.wire.tensors import (
    MAX_DENSE_ELEMENTS,
    as_numpy,
    model_input_parts,
    non_text_chunk,
    tensor_from_json,
    tensor_from_proto,
    tensor_json,
    unpack,
)
from training.loss_config import loss_config

if TYPE_CHECKING:
    import torch

# loss_fn_inputs indexed by input position: their first dimension is the token count.
PER_POSITION_INPUTS = frozenset(
    {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}
)
_RL_INPUTS = frozenset({"target_tokens", "logprobs", "advantages"})
# What each built-in loss reads. The SDK fills zero weights in when it runs a forward pass
# for a custom loss, so cross_entropy without weights is a client bug, not a default. RL
# datums carry no mask: prompt positions have zero advantages (cookbook rl/train.py drops
# its "mask" before sending).
REQUIRED_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens", "weights"}),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": _RL_INPUTS | {"sequence_ratio_mask"},
    "stable_reinforce": _RL_INPUTS,
    "custom": frozenset(),
}
LOSS_FNS = frozenset(REQUIRED_INPUTS)
# Text tokens of all datums of one request. The SDK's chunks hold at most 5 MB of tokens and
# loss inputs (16 bytes a position at least: about 312k positions), or one datum past that.
MAX_REQUEST_TOKENS = 1 << 20
# Cells that the sparse loss inputs of one request expand to: a few bytes of CSR can name a
# huge shape, and each tensor's own bound (``MAX_DENSE_ELEMENTS``) would add up over datums.
MAX_REQUEST_SPARSE_ELEMENTS = MAX_DENSE_ELEMENTS
# The SDK folds chunked results with these reductions, read from the text after ":".
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


@dataclass(frozen=True)
class ProvenanceSpan:
    """A run of datum positions copied from a sampled sequence's prompt or its output
    (StableReinforce); runs tile the field they annotate, in order."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class WireDatum:
    """One training example as the engine needs it.

    ``tokens`` is the model input with its chunks joined; ``loss_fn_inputs`` maps names to
    dense numpy arrays (float32 or int64) in their declared shape, sparse inputs expanded
    with zeros in unlisted cells, as the SDK's ``TensorData.to_numpy()`` does.
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None
    images: list[WireImage] = field(default_factory=list)
    """Image chunks; until `expand_images`, `tokens` holds the text tokens only."""
    expanded: bool = True

    def torch_inputs(self) -> dict[str, torch.Tensor]:
        import torch

        return {name: torch.from_numpy(arr) for name, arr in self.loss_fn_inputs.items()}


@dataclass
class ForwardBackwardBatch:
    """One ``/forward_backward`` (or ``/forward``) request: a chunk of a client batch.

    ``seq_id`` orders the model's requests; the SDK sends chunks of one call with
    consecutive seq_ids and expects them executed in seq_id order.
    """

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum] = field(default_factory=list)


def decode_forward_backward(
    body: bytes,
    *,
    content_type: str | None,
    content_encoding: str | None = None,
    forward_only: bool = False,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    check: bool = True,
) -> ForwardBackwardBatch:
    """Decode a ``/forward_backward`` or ``/forward`` body from its headers.

    ``forward_only=True`` is for the ``/forward`` path of older clients; the 0.38 SDK says
    so in the protobuf body instead. Raises ``WireError`` for anything the engine should
    never see: unknown media type, corrupt bytes, non-text chunks, ragged or non-finite
    tensors, inputs whose length disagrees with the tokens. ``check=False`` leaves the
    content checks (``check_batch``) to the caller, who may want the model and seq_id first.
    """
    raw = decompress(body, content_encoding, max_bytes=max_decoded_bytes)
    media = media_type(content_type)
    if media == PROTOBUF:
        batch = _decode_proto_forward_backward(raw)
    elif media in (JSON, ""):
        batch = _decode_json_forward_backward(raw)
    else:
        raise WireError(
            f"Content-Type {media!r} is not supported (use {PROTOBUF} or {JSON})", status=415
        )
    batch.forward_only = batch.forward_only or forward_only
    if check:
        check_batch(batch)
    return batch


def forward_backward_position(raw: bytes, content_type: str | None) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` of a decompressed body that failed to decode, when both can be
    read (``decode_forward_backward`` refuses most bodies after parsing the envelope)."""
    if media_type(content_type) != PROTOBUF:
        return json_position(raw)
    msg = _proto.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError:
        return None
    return (msg.model_id, msg.seq_id) if known_id(msg.model_id) else None


def _decode_proto_forward_backward(raw: bytes) -> ForwardBackwardBatch:
    msg = _proto.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireError(f"body is not a ForwardBackwardRequest protobuf: {exc}") from None
    if "\x00" in msg.model_id:
        # The model is looked up in PostgreSQL, whose text holds no NUL.
        raise WireError(f"model_id: {NUL_REASON}")
    # The SDK writes strings to loss_fn_config_v2 only and numbers to both maps; v2 wins.
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which == "text":
            config[key] = value.text
        elif which == "number":
            config[key] = value.number
    _check_sizes(
        len(msg.data),
        (len(datum.model_input) for datum in msg.data),
        sum(len(c.encoded_text.tokens) // 4 for datum in msg.data for c in datum.model_input),
        (
            (f"data[{i}].loss_fn_inputs[{name!r}]", list(t.shape))
            for i, datum in enumerate(msg.data)
            for name, t in datum.loss_fn_inputs.items()
            if t.WhichOneof("encoding") == "sparse_csr"
        ),
    )
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        pictures: list[WireImage] = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind == "image":
                image = chunk.image
                fields = SimpleNamespace(
                    data=image.data,
                    format=image.format,
                    expected_tokens=(
                        image.expected_tokens if image.HasField("expected_tokens") else None
                    ),
                )
                try:
                    pictures.append(image_chunk(j, len(tokens), fields, pointer=False))
                except WireError as exc:
                    raise WireError(f"data[{i}].{exc}") from None
                continue
            if kind != "encoded_text":
                raise non_text_chunk(i, kind)
            tokens.extend(unpack(chunk.encoded_text.tokens, np.int32, f"data[{i}] tokens").tolist())
        inputs = {
            name: tensor_from_proto(tensor, f"data[{i}].loss_fn_inputs[{name!r}]")
            for name, tensor in datum.loss_fn_inputs.items()
        }
        data.append(
            WireDatum(
                tokens=tokens,
                loss_fn_inputs=inputs,
                model_input_spans=_spans_from_proto(datum.model_input_spans),
                loss_fn_input_spans=_spans_from_proto(datum.loss_fn_input_spans),
                images=pictures,
                expanded=not pictures,
            )
        )
    return ForwardBackwardBatch(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=data,
    )


def _decode_json_forward_backward(raw: bytes) -> ForwardBackwardBatch:
    req = parse_json(s.ForwardBackwardRequestJson, raw)
    fbi = req.forward_backward_input
    _check_sizes(
        len(fbi.data),
        (len(datum.model_input.chunks) for datum in fbi.data),
        sum(
            len(c.tokens)
            for datum in fbi.data
            for c in datum.model_input.chunks
            if isinstance(c, s.EncodedTextChunkJson)
        ),
        (
            (f"data[{i}].loss_fn_inputs[{name!r}]", list(td.shape or []))
            for i, datum in enumerate(fbi.data)
            for name, td in datum.loss_fn_inputs.items()
            if td.sparse_crow_indices is not None or td.sparse_col_indices is not None
        ),
    )
    data = []
    for i, datum in enumerate(fbi.data):
        tokens, pictures = model_input_parts(datum.model_input, where=f"data[{i}]")
        data.append(
            WireDatum(
                tokens=tokens,
                loss_fn_inputs={
                    name: tensor_from_json(td, f"data[{i}].loss_fn_inputs[{name!r}]")
                    for name, td in datum.loss_fn_inputs.items()
                },
                images=pictures,
                expanded=not pictures,
            )
        )
    return ForwardBackwardBatch(
        model_id=req.model_id,
        seq_id=req.seq_id if req.seq_id is not None else 0,
        loss_fn=fbi.loss_fn,
        loss_fn_config=dict(fbi.loss_fn_config or {}),
        forward_only=req.forward_only,
        data=data,
    )


def _check_sizes(
    datums: int,
    chunks: Iterable[int],
    tokens: int,
    sparse_shapes: Iterable[tuple[str, list[int]]],
) -> None:
    """Bound what a request makes the server build before building any of it."""
    if datums > s.MAX_DATUMS:
        raise WireError(
            f"data: {datums} datums, over the limit of {s.MAX_DATUMS} per request; split the "
            "batch (the SDK sends chunks of at most 1024)"
        )
    for i, count in enumerate(chunks):
        if count > s.MAX_CHUNKS:
            raise WireError(
                f"data[{i}].model_input: {count} chunks, over the limit of {s.MAX_CHUNKS}"
            )
    if tokens > MAX_REQUEST_TOKENS:
        raise WireError(
            f"data: {tokens} model input tokens, over the limit of {MAX_REQUEST_TOKENS} per "
            "request; split the batch"
        )
    cells = 0
    for where, shape in sparse_shapes:
        size = math.prod(max(d, 0) for d in shape)
        if size > MAX_DENSE_ELEMENTS:
            continue  # refused on its own, with its shape, when it is decoded
        cells += size
        if cells > MAX_REQUEST_SPARSE_ELEMENTS:
            raise WireError(
                f"{where}: the sparse loss_fn_inputs of this request expand past "
                f"{MAX_REQUEST_SPARSE_ELEMENTS} elements",
                status=413,
            )


def _spans_from_proto(spans: Any) -> list[ProvenanceSpan] | None:
    if not spans:
        return None
    out = []
    for span in spans:
        kind = span.WhichOneof("span")
        arm = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        out.append(
            ProvenanceSpan(
                kind="prompt" if kind == "prompt_tokens" else "sampled",
                sequence_id=arm.sequence_id,
                offset=arm.offset,
                length=arm.length,
            )
        )
    return out


def check_batch(batch: ForwardBackwardBatch, vocab_size: int | None = None) -> None:
    """Refuse what the engine should never see; with ``vocab_size``, token ids outside
    ``[0, vocab_size)`` in the input or the targets too (named by datum and position)."""
    if batch.loss_fn not in LOSS_FNS:
        raise WireError(
            f"unknown loss_fn {batch.loss_fn!r}; expected one of {', '.join(sorted(LOSS_FNS))}"
        )
    try:
        loss_config(batch.loss_fn, batch.loss_fn_config)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    if not batch.model_id:
        raise WireError("model_id is required")
    # seq 0 of a model is its creating load_weights; training requests count from 1.
    if batch.seq_id < 1:
        raise WireError(f"seq_id must be 1 or more, got {batch.seq_id}")
    if not batch.data:
        raise WireError("no data: send at least one datum")
    required = REQUIRED_INPUTS[batch.loss_fn]
    for i, datum in enumerate(batch.data):
        if not datum.expanded:
            raise WireError(
                f"data[{i}]: holds images, but the base model takes none (text-only model)"
            )
        n = len(datum.tokens)
        if n == 0:
            raise WireError(f"data[{i}]: model_input has no tokens")
        missing = required - datum.loss_fn_inputs.keys()
        if missing:
            raise WireError(
                f"data[{i}]: loss_fn {batch.loss_fn!r} needs loss_fn_inputs "
                f"{sorted(required)}; missing {sorted(missing)}"
            )
        if batch.loss_fn == "stable_reinforce" and datum.model_input_spans is None:
            raise WireError(
                f"data[{i}]: stable_reinforce needs provenance spans (Datum.with_provenance)"
            )
        for name, arr in datum.loss_fn_inputs.items():
            where = f"data[{i}].loss_fn_inputs[{name!r}]"
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise WireError(f"{where}: holds NaN or infinity")
            if name in PER_POSITION_INPUTS and (arr.ndim == 0 or arr.shape[0] != n):
                raise WireError(
                    f"{where}: first dimension {arr.shape[:1]} must equal the {n} input tokens "
                    "(position i of the input predicts target i)"
                )
        target = datum.loss_fn_inputs.get("target_tokens")
        if target is not None and target.dtype.kind != "i":
            raise WireError(f"data[{i}].loss_fn_inputs['target_tokens']: must be int64")
        if vocab_size is not None:
            _check_token_ids(np.asarray(datum.tokens), f"data[{i}].model_input", vocab_size)
            if target is not None:
                where = f"data[{i}].loss_fn_inputs['target_tokens']"
                _check_token_ids(target, where, vocab_size)
        for label, spans in (
            ("model_input_spans", datum.model_input_spans),
            ("loss_fn_input_spans", datum.loss_fn_input_spans),
        ):
            if spans is not None and any(sp.length < 0 or sp.offset < 0 for sp in spans):
                raise WireError(f"data[{i}].{label}: offsets and lengths must not be negative")
        if (datum.model_input_spans is None) != (datum.loss_fn_input_spans is None):
            raise WireError(f"data[{i}]: provenance spans come as a pair")
        if (
            datum.model_input_spans is not None
            and sum(sp.length for sp in datum.model_input_spans) != n
        ):
            raise WireError(f"data[{i}].model_input_spans: lengths must add up to {n}")


def expand_images(
    batch: ForwardBackwardBatch,
    count: Callable[[WireImage, str], int] | None,
    image_token_id: int | None,
) -> None:
    """Put each datum's image placeholders in its tokens: `count(image, where)` gives the
    positions an image fills (None: the base model takes no images)."""
    for i, datum in enumerate(batch.data):
        if datum.expanded:
            continue
        where = f"data[{i}].model_input"
        if count is None or image_token_id is None:
            chunk = datum.images[0].chunk
            raise WireError(
                f"{where}.chunks[{chunk}]: an image chunk, but the base model takes no "
                "images (it is a text-only model)"
            )
        datum.tokens = expand(
            datum.tokens,
            datum.images,
            lambda image, w=where: count(image, w),
            image_token_id,
            where,
        )
        datum.expanded = True


def geometry_count(geometry: ImageGeometry) -> Callable[[WireImage, str], int]:
    """`expand_images`'s counter from the image's size and the model's processor geometry."""

    def count(image: WireImage, where: str) -> int:
        return counter(geometry, where)(image)

    return count


def _check_token_ids(ids: np.ndarray, where: str, vocab_size: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        flat = int(bad[0])
        # Two-dimensional targets (top-k distillation) have one row per position.
        pos = int(np.unravel_index(flat, ids.shape)[0]) if ids.ndim > 1 else flat
        raise WireError(
            f"{where}: token id {int(ids.flat[flat])} at position {pos} is outside the "
            f"vocabulary [0, {vocab_size})"
        )


def _check_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        # The SDK splits on ":" and unpacks exactly two parts; another shape crashes it.
        parts = key.split(":")
        if len(parts) != 2 or parts[1] not in METRIC_REDUCTIONS:
            raise ValueError(
                f"metric {key!r} must be 'name:reduction' with reduction in "
                f"{sorted(METRIC_REDUCTIONS)}"
            )
        out[key] = float(value)
    return out


def encode_forward_backward_output(
    loss_fn_outputs: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, float],
    *,
    protobuf: bool,
    loss_fn_output_type: str = "ArrayRecord",
) -> EncodedBody:
    """Encode a forward/backward result: one dict of arrays per datum (``logprobs`` at
    least), and metrics named ``name:reduction``. Each datum's arrays keep their shape;
    a scalar goes out as shape ``[1]``, since the SDK rebuilds a leading dimension."""
    metrics_out = _check_metrics(metrics)
    outputs = [
        {name: as_numpy(v, f"loss_fn_outputs[{i}][{name!r}]") for name, v in out.items()}
        for i, out in enumerate(loss_fn_outputs)
    ]
    names = list(outputs[0]) if outputs else []
    for i, out in enumerate(outputs):
        if sorted(out) != sorted(names):
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(out)}, expected {names}")
    if not protobuf:
        body = s.ForwardBackwardOutputJson(
            loss_fn_output_type=loss_fn_output_type,
            loss_fn_outputs=[{n: tensor_json(a) for n, a in out.items()} for out in outputs],
            metrics={k: s.finite_or_none(v) for k, v in metrics_out.items()},
        )
        return EncodedBody(body.model_dump_json(exclude_none=False).encode(), JSON)

    msg = _proto.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    msg.metrics.update(metrics_out)

    # Each ArrayRecord holds every field for a run of datums; a field's dtype and trailing
    # shape are per record, so a run ends where any of them changes.
    def layout(out: dict[str, np.ndarray]) -> tuple[Any, ...]:
        return tuple((n, out[n].dtype.str, np.atleast_1d(out[n]).shape[1:]) for n in names)

    start = 0
    while start < len(outputs):
        end = start + 1
        while end < len(outputs) and layout(outputs[end]) == layout(outputs[start]):
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=end - start)
        for name in names:
            arrays = [np.ascontiguousarray(np.atleast_1d(o[name])) for o in outputs[start:end]]
            sizes = [a.nbytes for a in arrays]
            bt = record.fields[name]
            bt.dtype = _proto.DTYPE_FLOAT32 if arrays[0].dtype.kind == "f" else _proto.DTYPE_INT64
            bt.trailing_shape.extend(arrays[0].shape[1:])
            bt.data = b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in arrays)
            bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<i8").tobytes()
        start = end
    return EncodedBody(msg.SerializeToString(), PROTOBUF)
