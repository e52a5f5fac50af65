"""Decode what the tinker SDK sends to ``/forward_backward`` and encode what it reads back.

Pure functions over bytes and headers, no Django. The 0.38 SDK sends forward/backward
bodies as protobuf (``Content-Type: application/x-protobuf``), zstd-compressed when the
server's client config sets ``proto_compress_fwdbwd`` (``Content-Encoding: zstd``); older
clients and curl send JSON. Results of forward/backward and sampling go back as protobuf when
the poll carries ``Accept: application/x-protobuf`` (the 0.38 SDK refuses JSON for those two)
and as JSON otherwise. The layouts mirror ``tinker/proto/request_conv.py`` and
``response_conv.py``: tokens as int32 bytes, floats as float32 bytes, NaN for an undefined
prompt logprob, per-datum outputs batched into ``ArrayRecord``s of ``BatchedTensor``s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ValidationError

from tinker_api import _proto
from tinker_api import schemas as s

if TYPE_CHECKING:
    import torch

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# Bodies are limited after decompression too: a small zstd frame can expand enormously.
DEFAULT_MAX_DECODED_BYTES = 256 * 1024 * 1024
# A sparse input's dense shape is bounded separately: few bytes can name a huge shape.
MAX_DENSE_ELEMENTS = 1 << 26

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
# The SDK folds chunked results with these reductions, read from the text after ":".
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


class WireError(ValueError):
    """A request body the server cannot accept. ``status`` is the HTTP status to answer
    with at submission (400 malformed, 413 too large, 415 unknown media type); the SDK
    shows the message to the user and does not retry a 4xx other than 408/409/429."""

    category: Literal["user"] = "user"

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, str]:
        return {"detail": str(self)}


# --------------------------------------------------------------------------- datum model


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


# --------------------------------------------------------------------------- decoding


def _media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def wants_protobuf(accept: str | None) -> bool:
    """True when the ``Accept`` header names the protobuf media type."""
    return any(_media_type(part) == PROTOBUF for part in (accept or "").split(","))


def decompress(
    body: bytes, content_encoding: str | None, *, max_bytes: int = DEFAULT_MAX_DECODED_BYTES
) -> bytes:
    """Undo ``Content-Encoding`` (identity or zstd), refusing output over ``max_bytes``."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        raw = body
    elif encoding == "zstd":
        try:
            size = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise WireError(f"body is not a zstd frame: {exc}") from None
        if size > max_bytes:
            raise WireError(
                f"body expands to {size} bytes, over the {max_bytes}-byte limit", status=413
            )
        try:
            raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
        except zstandard.ZstdError as exc:
            raise WireError(f"body is not valid zstd: {exc}") from None
    else:
        raise WireError(
            f"Content-Encoding {encoding!r} is not supported (use zstd or none)", status=415
        )
    if len(raw) > max_bytes:
        raise WireError(f"body is {len(raw)} bytes, over the {max_bytes}-byte limit", status=413)
    return raw


def decode_forward_backward(
    body: bytes,
    *,
    content_type: str | None,
    content_encoding: str | None = None,
    forward_only: bool = False,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> ForwardBackwardBatch:
    """Decode a ``/forward_backward`` or ``/forward`` body from its headers.

    ``forward_only=True`` is for the ``/forward`` path of older clients; the 0.38 SDK says
    so in the protobuf body instead. Raises ``WireError`` for anything the engine should
    never see: unknown media type, corrupt bytes, non-text chunks, ragged or non-finite
    tensors, inputs whose length disagrees with the tokens.
    """
    raw = decompress(body, content_encoding, max_bytes=max_decoded_bytes)
    media = _media_type(content_type)
    if media == PROTOBUF:
        batch = _decode_proto_forward_backward(raw)
    elif media in (JSON, ""):
        batch = _decode_json_forward_backward(raw)
    else:
        raise WireError(
            f"Content-Type {media!r} is not supported (use {PROTOBUF} or {JSON})", status=415
        )
    batch.forward_only = batch.forward_only or forward_only
    _check_batch(batch)
    return batch


def _decode_proto_forward_backward(raw: bytes) -> ForwardBackwardBatch:
    msg = _proto.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireError(f"body is not a ForwardBackwardRequest protobuf: {exc}") from None
    # The SDK writes strings to loss_fn_config_v2 only and numbers to both maps; v2 wins.
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which == "text":
            config[key] = value.text
        elif which == "number":
            config[key] = value.number
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise _non_text_chunk(i, kind)
            tokens.extend(
                _unpack(chunk.encoded_text.tokens, np.int32, f"data[{i}] tokens").tolist()
            )
        inputs = {
            name: _tensor_from_proto(tensor, f"data[{i}].loss_fn_inputs[{name!r}]")
            for name, tensor in datum.loss_fn_inputs.items()
        }
        data.append(
            WireDatum(
                tokens=tokens,
                loss_fn_inputs=inputs,
                model_input_spans=_spans_from_proto(datum.model_input_spans),
                loss_fn_input_spans=_spans_from_proto(datum.loss_fn_input_spans),
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
    data = []
    for i, datum in enumerate(fbi.data):
        data.append(
            WireDatum(
                tokens=model_input_tokens(datum.model_input, where=f"data[{i}]"),
                loss_fn_inputs={
                    name: tensor_from_json(td, f"data[{i}].loss_fn_inputs[{name!r}]")
                    for name, td in datum.loss_fn_inputs.items()
                },
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


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_json(model: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON request body, turning pydantic's errors into a 400 ``WireError``."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise WireError(f"invalid {model.__name__}: {_first_errors(exc)}") from None


# Bound on what one sampling request may ask the server to compute and send back per
# feature: prompt positions x top-k width (or x distinct target ids, or x draws), and
# generated tokens x top-k width. 4M cells is 32 MB of ids and logprobs.
MAX_SCORE_CELLS = 1 << 22


@dataclass
class PromptTargets:
    """``SampleRequest.target_prompt_logprobs``: token ids per prompt position (row i scores
    position i + 1), ``-1`` where nothing is asked; ``csr`` keeps a sparse request's layout,
    which the answer repeats."""

    ids: np.ndarray  # int64 (len(prompt) - 1, K), -1 in unlisted cells
    csr: tuple[list[int], list[int]] | None = None

    def answer(self, values: np.ndarray) -> tuple[np.ndarray, tuple[list[int], list[int]] | None]:
        """The answer's data in the request's layout: every cell when dense, the listed cells
        (row by row) when sparse."""
        if self.csr is None:
            return values.astype(np.float32), None
        crow, col = self.csr
        rows = np.repeat(np.arange(len(crow) - 1), np.diff(np.asarray(crow, dtype=np.int64)))
        return values[rows, np.asarray(col, dtype=np.int64)].astype(np.float32), self.csr


def prompt_targets(td: s.TensorDataJson, prompt_len: int) -> PromptTargets:
    """Check and expand ``target_prompt_logprobs`` for a prompt of ``prompt_len`` tokens."""
    where = "target_prompt_logprobs"
    if td.dtype != "int64":
        raise WireError(f"{where}: must be an int64 tensor of token ids, got {td.dtype}")
    shape = list(td.shape or [])
    if len(shape) != 2:
        raise WireError(f"{where}: must be two-dimensional [len(prompt) - 1, K], got {shape}")
    if shape[0] != prompt_len - 1:
        raise WireError(
            f"{where}: needs exactly len(prompt) - 1 = {prompt_len - 1} rows (row i scores "
            f"prompt position i + 1), got {shape[0]}"
        )
    if any(v is None or (isinstance(v, float) and not v.is_integer()) for v in td.data):
        raise WireError(f"{where}: data must be integer token ids")
    try:
        values = np.asarray(td.data, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise WireError(f"{where}: a token id does not fit in int64") from None
    csr = None
    if td.sparse_crow_indices is None and td.sparse_col_indices is None:
        ids = _shaped(values, shape, where)
    elif td.sparse_crow_indices is None or td.sparse_col_indices is None:
        raise WireError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
    else:
        crow = [int(v) for v in td.sparse_crow_indices]
        col = [int(v) for v in td.sparse_col_indices]
        crow_arr, col_arr = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
        ids = _dense_from_csr(values, crow_arr, col_arr, shape, where, fill=-1)
        csr = (crow, col)
    if ids.size and int(ids.min()) < -1:
        raise WireError(f"{where}: token ids must be 0 or more (-1 asks for nothing)")
    distinct = np.unique(ids[ids >= 0]).size
    if distinct == 0:
        raise WireError(f"{where}: names no token id (every cell is -1)")
    if prompt_len * distinct > MAX_SCORE_CELLS:
        raise WireError(
            f"{where}: len(prompt) x distinct ids = {prompt_len * distinct}, over the "
            f"limit of {MAX_SCORE_CELLS}"
        )
    return PromptTargets(ids=ids, csr=csr)


def sample_prompt(req: s.SampleRequest) -> list[int]:
    """The prompt tokens of an ``/asample`` request, after the checks the SDK makes on its
    side (``sampling_client.py``) and the bounds on what one request may ask for."""
    tokens = model_input_tokens(req.prompt)
    if not tokens:
        raise WireError("prompt has no tokens")
    if req.prompt_logprobs_last_n is not None:
        if not req.prompt_logprobs:
            raise WireError("prompt_logprobs_last_n requires prompt_logprobs")
        if req.prompt_logprobs_last_n > len(tokens) - 1:
            raise WireError(
                f"prompt_logprobs_last_n must be between 1 and {len(tokens) - 1} for this prompt"
            )
    for name, k in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
    ):
        if len(tokens) * k > MAX_SCORE_CELLS:
            raise WireError(
                f"{name}: len(prompt) x {k} = {len(tokens) * k}, over the limit of "
                f"{MAX_SCORE_CELLS}"
            )
    return tokens


def check_topk_sample(req: s.SampleRequest, max_tokens: int) -> None:
    """Bound ``topk_sample_logprobs`` once ``max_tokens`` is known."""
    cells = req.num_samples * max_tokens * req.topk_sample_logprobs
    if cells > MAX_SCORE_CELLS:
        raise WireError(
            f"topk_sample_logprobs: num_samples x max_tokens x k = {cells}, over the limit of "
            f"{MAX_SCORE_CELLS}"
        )


def model_input_tokens(model_input: s.ModelInputJson, *, where: str = "prompt") -> list[int]:
    """Join the text chunks of a JSON ``ModelInput`` (sampling prompts, JSON datums)."""
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if not isinstance(chunk, s.EncodedTextChunkJson):
            raise _non_text_chunk(where, chunk.type)
        tokens.extend(chunk.tokens)
    if any(t < 0 or t > np.iinfo(np.int32).max for t in tokens):
        raise WireError(f"{where}: token ids must be between 0 and 2**31-1")
    return tokens


def _non_text_chunk(where: int | str, kind: str | None) -> WireError:
    label = f"data[{where}]" if isinstance(where, int) else where
    return WireError(
        f"{label}: {kind or 'empty'} chunks are not supported; this server serves text-only "
        "models, so send token chunks (ModelInput.from_ints)"
    )


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _unpack(buf: bytes, dtype: type[np.generic], where: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(buf) % itemsize:
        raise WireError(f"{where}: {len(buf)} bytes is not a whole number of {itemsize}-byte items")
    arr = np.frombuffer(buf, dtype=np.dtype(dtype).newbyteorder("<"))
    if dtype is np.int32 and arr.size and arr.min() < 0:
        raise WireError(f"{where}: token ids must not be negative")
    return arr


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


_PROTO_DTYPES: dict[int, tuple[np.dtype, np.dtype]] = {
    # proto dtype -> (dtype of the bytes, dtype handed to the engine)
    _proto.DTYPE_FLOAT32: (np.dtype("<f4"), np.dtype(np.float32)),
    _proto.DTYPE_INT64: (np.dtype("<i8"), np.dtype(np.int64)),
    _proto.DTYPE_INT32: (np.dtype("<i4"), np.dtype(np.int64)),
    _proto.DTYPE_BFLOAT16: (np.dtype("<u2"), np.dtype(np.float32)),
}


def _tensor_from_proto(msg: Any, where: str) -> np.ndarray:
    if msg.dtype not in _PROTO_DTYPES:
        raise WireError(f"{where}: unknown dtype {msg.dtype}")
    raw_dtype, dtype = _PROTO_DTYPES[msg.dtype]

    def values_of(buf: bytes) -> np.ndarray:
        if len(buf) % raw_dtype.itemsize:
            raise WireError(f"{where}: byte length {len(buf)} is not a multiple of {raw_dtype}")
        arr = np.frombuffer(buf, dtype=raw_dtype)
        if msg.dtype == _proto.DTYPE_BFLOAT16:
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(dtype)

    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        return _dense_from_csr(
            values_of(csr.values),
            _index_array(csr.crow_indices, where, "crow"),
            _index_array(csr.col_indices, where, "col"),
            shape,
            where,
        )
    return _shaped(values_of(msg.dense), shape, where)


def _index_array(buf: bytes, where: str, name: str) -> np.ndarray:
    if len(buf) % 8:
        raise WireError(f"{where}: sparse {name} indices are not int64 bytes")
    return np.frombuffer(buf, dtype="<i8").astype(np.int64)


def tensor_from_json(td: s.TensorDataJson, where: str) -> np.ndarray:
    """A JSON ``TensorData`` as a dense numpy array (sparse CSR expanded with zeros)."""
    if any(v is None for v in td.data):
        raise WireError(f"{where}: data must be numbers (null found)")
    dtype = np.dtype(np.float32) if td.dtype == "float32" else np.dtype(np.int64)
    if td.dtype == "int64" and any(isinstance(v, float) and not v.is_integer() for v in td.data):
        raise WireError(f"{where}: int64 data holds a fraction")
    try:
        values = np.asarray(td.data, dtype=dtype).reshape(-1)
        if td.sparse_crow_indices is None and td.sparse_col_indices is None:
            return _shaped(values, list(td.shape) if td.shape is not None else [], where)
        if td.sparse_crow_indices is None or td.sparse_col_indices is None:
            raise WireError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
        crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(td.sparse_col_indices, dtype=np.int64)
    except OverflowError:
        raise WireError(f"{where}: a value does not fit in {td.dtype}") from None
    return _dense_from_csr(values, crow, col, list(td.shape or []), where)


def _shaped(values: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    # No shape means one-dimensional, as the SDK infers it.
    if not shape:
        return values
    if any(d < 0 for d in shape) or math.prod(shape) != values.size:
        raise WireError(f"{where}: shape {shape} does not hold {values.size} values")
    return values.reshape(shape)


def _dense_from_csr(
    values: np.ndarray,
    crow: np.ndarray,
    col: np.ndarray,
    shape: list[int],
    where: str,
    *,
    fill: float = 0,
) -> np.ndarray:
    """Expand CSR like ``torch.sparse_csr_tensor(...).to_dense()``, checking the same
    invariants torch checks, so a bad index is a user error rather than a crash. Unlisted
    cells hold ``fill``."""
    if len(shape) != 2 or shape[0] < 0 or shape[1] < 0:
        raise WireError(f"{where}: a sparse tensor needs a two-dimensional shape, got {shape}")
    rows, cols = shape
    # The shape is the client's word; bound what it makes us allocate.
    if rows * cols > MAX_DENSE_ELEMENTS:
        raise WireError(
            f"{where}: sparse shape {shape} expands past {MAX_DENSE_ELEMENTS} elements", status=413
        )
    nnz = values.size
    if crow.size != rows + 1 or (crow.size and (crow[0] != 0 or crow[-1] != nnz)):
        raise WireError(f"{where}: crow indices must have {rows + 1} entries from 0 to {nnz}")
    if col.size != nnz:
        raise WireError(f"{where}: {col.size} column indices for {nnz} values")
    counts = np.diff(crow)
    if (counts < 0).any():
        raise WireError(f"{where}: crow indices must not decrease")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise WireError(f"{where}: column index out of range 0..{cols - 1}")
    row_of = np.repeat(np.arange(rows), counts)
    same_row = row_of[1:] == row_of[:-1]
    if (col[1:][same_row] <= col[:-1][same_row]).any():
        raise WireError(f"{where}: column indices must increase within each row")
    dense = np.full((rows, cols), fill, dtype=values.dtype)
    dense[row_of, col] = values
    return dense


def _check_batch(batch: ForwardBackwardBatch) -> None:
    if batch.loss_fn not in LOSS_FNS:
        raise WireError(
            f"unknown loss_fn {batch.loss_fn!r}; expected one of {', '.join(sorted(LOSS_FNS))}"
        )
    if not batch.model_id:
        raise WireError("model_id is required")
    # seq 0 of a model is its creating load_weights; training requests count from 1.
    if batch.seq_id < 1:
        raise WireError(f"seq_id must be 1 or more, got {batch.seq_id}")
    if not batch.data:
        raise WireError("no data: send at least one datum")
    required = REQUIRED_INPUTS[batch.loss_fn]
    for i, datum in enumerate(batch.data):
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


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncodedBody:
    content: bytes
    content_type: str


def _as_numpy(value: Any, where: str) -> np.ndarray:
    # torch tensors without importing torch: anything with .detach() is one.
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype.kind == "f":
        return arr.astype(np.float32, copy=False)
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64, copy=False)
    raise ValueError(f"{where}: cannot send dtype {arr.dtype}")


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
        {name: _as_numpy(v, f"loss_fn_outputs[{i}][{name!r}]") for name, v in out.items()}
        for i, out in enumerate(loss_fn_outputs)
    ]
    names = list(outputs[0]) if outputs else []
    for i, out in enumerate(outputs):
        if sorted(out) != sorted(names):
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(out)}, expected {names}")
    if not protobuf:
        body = s.ForwardBackwardOutputJson(
            loss_fn_output_type=loss_fn_output_type,
            loss_fn_outputs=[{n: _tensor_json(a) for n, a in out.items()} for out in outputs],
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


def _tensor_json(arr: np.ndarray) -> s.TensorDataJson:
    flat = arr.reshape(-1)
    data: list[float | int | None]
    if arr.dtype.kind == "f":
        data = [s.finite_or_none(v) for v in flat.tolist()]
    else:
        data = flat.tolist()
    return s.TensorDataJson(
        data=data,
        dtype="float32" if arr.dtype.kind == "f" else "int64",
        shape=list(np.atleast_1d(arr).shape),
    )


TopkRow = Sequence[tuple[int, float]] | None


@dataclass
class SampledSequenceOut:
    """One sampled sequence. ``sequence_id`` goes out in JSON only: the SDK takes ids from
    the ``sample_sequence_ids`` of the ``/asample`` reply, in sequence order."""

    tokens: Sequence[int]
    stop_reason: Literal["stop", "length"]
    logprobs: Sequence[float] | None = None
    sequence_id: str | None = None
    topk_logprobs: Sequence[TopkRow] | None = None


# Filler of a top-k matrix where a position has fewer than k entries (SDK: MASK_LOGPROB).
TOPK_MASK_TOKEN = 0
TOPK_MASK_LOGPROB = -99999.0


def _topk_proto(rows: Sequence[TopkRow], target: Any) -> None:
    # k == 0 reads back as "not requested", so all-empty rows still get one masked column.
    k = max((len(r) for r in rows if r), default=0) or (1 if rows else 0)
    ids = np.full((len(rows), k), TOPK_MASK_TOKEN, dtype="<i4")
    lps = np.full((len(rows), k), TOPK_MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row or ()):
            ids[i, j] = tok
            lps[i, j] = lp
    target.length = len(rows)
    target.k = k
    target.token_ids = ids.tobytes()
    target.logprobs = lps.tobytes()


def _topk_json(rows: Sequence[TopkRow] | None) -> list[list[tuple[int, float]] | None] | None:
    if rows is None:
        return None
    return [None if not r else [(int(t), float(lp)) for t, lp in r] for r in rows]


@dataclass
class TensorOut:
    """A tensor of a sampling answer: dense ``data`` of ``shape``, or the values of the
    cells a CSR layout lists (``csr`` = crow, col indices)."""

    data: np.ndarray
    shape: list[int]
    csr: tuple[list[int], list[int]] | None = None

    def proto(self, target: Any) -> None:
        is_float = self.data.dtype.kind == "f"
        target.dtype = _proto.DTYPE_FLOAT32 if is_float else _proto.DTYPE_INT64
        raw = np.ascontiguousarray(self.data, dtype="<f4" if is_float else "<i8").tobytes()
        target.shape.extend(self.shape)
        if self.csr is None:
            target.dense = raw
        else:
            target.sparse_csr.values = raw
            target.sparse_csr.crow_indices = np.asarray(self.csr[0], dtype="<i8").tobytes()
            target.sparse_csr.col_indices = np.asarray(self.csr[1], dtype="<i8").tobytes()

    def json(self) -> s.TensorDataJson:
        is_float = self.data.dtype.kind == "f"
        flat = self.data.reshape(-1).tolist()
        return s.TensorDataJson(
            data=[s.finite_or_none(v) for v in flat] if is_float else flat,
            dtype="float32" if is_float else "int64",
            shape=self.shape,
            sparse_crow_indices=None if self.csr is None else self.csr[0],
            sparse_col_indices=None if self.csr is None else self.csr[1],
        )


def encode_sample_response(
    sequences: Sequence[SampledSequenceOut],
    *,
    protobuf: bool,
    prompt_logprobs: Sequence[float | None] | np.ndarray | None = None,
    topk_prompt_logprobs: Sequence[TopkRow] | None = None,
    target_prompt_logprobs: TensorOut | None = None,
    prompt_alt_tokens: tuple[TensorOut, TensorOut] | None = None,
) -> EncodedBody:
    """Encode a sampling result. ``prompt_logprobs`` has one entry per prompt token, None
    (or NaN) where undefined, position 0 always; it goes out as NaN in protobuf and null in
    JSON, which the SDK turns back into None. ``target_prompt_logprobs`` answers in the
    request's layout; ``prompt_alt_tokens`` is (tokens, logprobs)."""
    for i, seq in enumerate(sequences):
        if seq.stop_reason not in ("stop", "length"):
            raise ValueError(f"sequences[{i}]: stop_reason must be 'stop' or 'length'")
        if seq.logprobs is not None and len(seq.logprobs) != len(seq.tokens):
            raise ValueError(
                f"sequences[{i}]: {len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens"
            )
        if seq.topk_logprobs is not None and len(seq.topk_logprobs) != len(seq.tokens):
            raise ValueError(f"sequences[{i}]: one top-k list per token is required")
    prompt_lp: np.ndarray | None = None
    if prompt_logprobs is not None:
        prompt_lp = np.array(
            [math.nan if v is None else v for v in prompt_logprobs], dtype=np.float32
        )
    if not protobuf:
        body = s.SampleResponseJson(
            sequences=[
                s.SampledSequenceJson(
                    stop_reason=seq.stop_reason,
                    tokens=[int(t) for t in seq.tokens],
                    logprobs=None if seq.logprobs is None else [float(v) for v in seq.logprobs],
                    sequence_id=seq.sequence_id,
                    topk_logprobs=_topk_json(seq.topk_logprobs),
                )
                for seq in sequences
            ],
            prompt_logprobs=None
            if prompt_lp is None
            else [s.finite_or_none(v) for v in prompt_lp.tolist()],
            topk_prompt_logprobs=_topk_json(topk_prompt_logprobs),
            target_prompt_logprobs=(
                None if target_prompt_logprobs is None else target_prompt_logprobs.json()
            ),
            prompt_alt_tokens=(
                None
                if prompt_alt_tokens is None
                else s.PromptAltTokensJson(
                    tokens=prompt_alt_tokens[0].json(), logprobs=prompt_alt_tokens[1].json()
                )
            ),
        )
        return EncodedBody(body.model_dump_json().encode(), JSON)

    msg = _proto.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = (
            _proto.STOP_REASON_STOP if seq.stop_reason == "stop" else _proto.STOP_REASON_LENGTH
        )
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _topk_proto(seq.topk_logprobs, out.topk_sampled_logprobs)
    if prompt_lp is not None:
        msg.prompt_logprobs = prompt_lp.astype("<f4").tobytes()
    if topk_prompt_logprobs is not None:
        _topk_proto(topk_prompt_logprobs, msg.topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        target_prompt_logprobs.proto(msg.target_prompt_logprobs)
    if prompt_alt_tokens is not None:
        prompt_alt_tokens[0].proto(msg.prompt_alt_tokens.tokens)
        prompt_alt_tokens[1].proto(msg.prompt_alt_tokens.logprobs)
    return EncodedBody(msg.SerializeToString(), PROTOBUF)


# --------------------------------------------------------------------------- futures


@dataclass(frozen=True)
class Reply:
    """An HTTP status and a JSON body, for the views to send as they are."""

    status: int
    body: dict[str, Any]

    def json(self) -> bytes:
        return json.dumps(self.body).encode()


def future_created(
    request_id: str,
    *,
    model_id: str | None = None,
    sample_sequence_ids: Sequence[str] | None = None,
) -> Reply:
    """The immediate answer of every future-returning call."""
    body = s.UntypedAPIFuture(
        request_id=request_id,
        model_id=model_id,
        sample_sequence_ids=None if sample_sequence_ids is None else list(sample_sequence_ids),
    )
    return Reply(200, body.model_dump(exclude_none=True))


def try_again(
    request_id: str,
    queue_state: s.QueueState = "active",
    queue_state_reason: str | None = None,
) -> Reply:
    """A poll of a pending future. 408 makes the SDK re-poll at once without a warning
    (a 200 ``try_again`` works too but logs a warning on every poll)."""
    body = s.TryAgainResponse(
        request_id=request_id, queue_state=queue_state, queue_state_reason=queue_state_reason
    )
    return Reply(408, body.model_dump(exclude_none=True))


def request_failed(error: str, category: s.ErrorCategory = "user") -> Reply:
    """A finished future that failed: 200 with ``{error, category}``; the SDK raises
    ``RequestFailedError`` with the message (category ``user`` marks the caller's fault)."""
    return Reply(200, s.RequestFailedResponse(error=error, category=category).model_dump())


def expired(request_id: str) -> Reply:
    """A future the server no longer holds. 410 makes the SDK resubmit the original request
    where it can (sampling); elsewhere it surfaces as an error."""
    return Reply(410, {"detail": f"request {request_id} expired or is unknown"})


def sampling_backpressure(retry_after_s: float = 1.0) -> Reply:
    """The answer to an ``/asample`` that carries ``X-Tinker-Sampling-Backpressure: 1`` while
    the sampler queue is full: the SDK pauses all sampling of its session for 1 to 5 s and
    sends the same request again."""
    return Reply(429, {"detail": f"sampler busy, retry in {retry_after_s:g} s"})


# --------------------------------------------------------------------------- id conventions


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id the SDK assumes for a model created by ``load_weights`` (service_client.py);
    use it for ``create_model`` too, so one rule names every training model."""
    return f"{session_id}:train:{model_seq_id}"


CheckpointKind = Literal["training", "sampler", "external"]
_PATH_SEGMENTS: dict[str, CheckpointKind] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


def tinker_path(training_run_id: str, kind: CheckpointKind, name: str) -> str:
    """``tinker://<run>/<weights|sampler_weights|external_weights>/<name>``; the SDK parses
    it by splitting on "/" into exactly three parts, so neither id may contain "/"."""
    if "/" in training_run_id or "/" in name or not name:
        raise ValueError("training run id and checkpoint name must be non-empty and '/'-free")
    segment = next(seg for seg, k in _PATH_SEGMENTS.items() if k == kind)
    return f"tinker://{training_run_id}/{segment}/{name}"


def parse_tinker_path(path: str) -> tuple[str, CheckpointKind, str]:
    """(training_run_id, kind, name) of a tinker path, as the SDK parses it."""
    if not path.startswith("tinker://"):
        raise WireError(f"invalid tinker path {path!r}: must start with tinker://")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in _PATH_SEGMENTS or not parts[0] or not parts[2]:
        raise WireError(
            f"invalid tinker path {path!r}: expected tinker://<run>/"
            "<weights|sampler_weights|external_weights>/<name>"
        )
    return parts[0], _PATH_SEGMENTS[parts[1]], parts[2]
