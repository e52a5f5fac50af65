"""Tokens and tensors as the SDK encodes them, in both directions.

Tokens travel as int32 bytes, floats as float32 bytes; a tensor is dense or sparse CSR, in
protobuf (``tinker/proto/request_conv.py``) or JSON (``TensorData``). Decoding checks what
torch would check, so a bad index is the caller's error rather than a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinker_api import _proto
from tinker_api import schemas as s
from tinker_api.wire.images import WireImage, image_chunk
from tinker_api.wire.media import WireError

# A sparse input's dense shape is bounded separately: few bytes can name a huge shape.
MAX_DENSE_ELEMENTS = 1 << 26


def model_input_tokens(model_input: s.ModelInputJson, *, where: str = "prompt") -> list[int]:
    """Join the text chunks of a JSON ``ModelInput`` that holds no image."""
    tokens, images = model_input_parts(model_input, where=where)
    if images:
        raise WireError(f"{where}: image chunks are not accepted here")
    return tokens


def model_input_parts(
    model_input: s.ModelInputJson, *, where: str = "prompt"
) -> tuple[list[int], list[WireImage]]:
    """The text tokens of a JSON ``ModelInput`` and its images (each placed after the text
    tokens before it; `wire.images.expand` puts their placeholders in)."""
    tokens: list[int] = []
    images: list[WireImage] = []
    for i, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, s.EncodedTextChunkJson):
            tokens.extend(chunk.tokens)
        elif isinstance(chunk, (s.ImageChunkJson, s.ImageAssetPointerChunkJson)):
            pointer = isinstance(chunk, s.ImageAssetPointerChunkJson)
            try:
                images.append(image_chunk(i, len(tokens), chunk, pointer=pointer))
            except WireError as exc:
                raise WireError(f"{where}.{exc}") from None
        else:
            raise non_text_chunk(where, chunk.type)
    if any(t < 0 or t > np.iinfo(np.int32).max for t in tokens):
        raise WireError(f"{where}: token ids must be between 0 and 2**31-1")
    return tokens, images


def non_text_chunk(where: int | str, kind: str | None) -> WireError:
    label = f"data[{where}]" if isinstance(where, int) else where
    return WireError(
        f"{label}: {kind or 'empty'} chunks are not supported; send token chunks "
        "(ModelInput.from_ints) and, for a vision-language model, image chunks"
    )


def unpack(buf: bytes, dtype: type[np.generic], where: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(buf) % itemsize:
        raise WireError(f"{where}: {len(buf)} bytes is not a whole number of {itemsize}-byte items")
    arr = np.frombuffer(buf, dtype=np.dtype(dtype).newbyteorder("<"))
    if dtype is np.int32 and arr.size and arr.min() < 0:
        raise WireError(f"{where}: token ids must not be negative")
    return arr


_PROTO_DTYPES: dict[int, tuple[np.dtype, np.dtype]] = {
    # proto dtype -> (dtype of the bytes, dtype handed to the engine)
    _proto.DTYPE_FLOAT32: (np.dtype("<f4"), np.dtype(np.float32)),
    _proto.DTYPE_INT64: (np.dtype("<i8"), np.dtype(np.int64)),
    _proto.DTYPE_INT32: (np.dtype("<i4"), np.dtype(np.int64)),
    _proto.DTYPE_BFLOAT16: (np.dtype("<u2"), np.dtype(np.float32)),
}


def tensor_from_proto(msg: Any, where: str) -> np.ndarray:
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
        return dense_from_csr(
            values_of(csr.values),
            _index_array(csr.crow_indices, where, "crow"),
            _index_array(csr.col_indices, where, "col"),
            shape,
            where,
        )
    return shaped(values_of(msg.dense), shape, where)


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
            return shaped(values, list(td.shape) if td.shape is not None else [], where)
        if td.sparse_crow_indices is None or td.sparse_col_indices is None:
            raise WireError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
        crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(td.sparse_col_indices, dtype=np.int64)
    except OverflowError:
        raise WireError(f"{where}: a value does not fit in {td.dtype}") from None
    return dense_from_csr(values, crow, col, list(td.shape or []), where)


def shaped(values: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    # No shape means one-dimensional, as the SDK infers it.
    if not shape:
        return values
    if any(d < 0 for d in shape) or math.prod(shape) != values.size:
        raise WireError(f"{where}: shape {shape} does not hold {values.size} values")
    return values.reshape(shape)


def dense_from_csr(
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


def as_numpy(value: Any, where: str) -> np.ndarray:
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


def tensor_json(arr: np.ndarray) -> s.TensorDataJson:
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
