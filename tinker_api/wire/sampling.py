"""``/asample``: the checks on a sampling request and the encoding of its answer.

A prompt logprob that is undefined (position 0) goes out as NaN in protobuf and null in JSON;
top-k matrices are padded with the SDK's mask values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tinker_api import _proto
from tinker_api import schemas as s
from tinker_api.wire.images import WireImage, expand
from tinker_api.wire.media import JSON, PROTOBUF, EncodedBody, WireError
from tinker_api.wire.tensors import TensorOut, dense_from_csr, model_input_parts, shaped

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
        ids = shaped(values, shape, where)
    elif td.sparse_crow_indices is None or td.sparse_col_indices is None:
        raise WireError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
    else:
        crow = [int(v) for v in td.sparse_crow_indices]
        col = [int(v) for v in td.sparse_col_indices]
        crow_arr, col_arr = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
        ids = dense_from_csr(values, crow_arr, col_arr, shape, where, fill=-1)
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


def sample_prompt(
    req: s.SampleRequest,
    count: Callable[[WireImage], int] | None = None,
    image_token_id: int | None = None,
) -> tuple[list[int], list[WireImage]]:
    """The prompt tokens of an ``/asample`` request (each image's placeholders in place) and
    its images, after the checks the SDK makes on its side (``sampling_client.py``) and the
    bounds on what one request may ask for. `count` gives an image's positions (None: the
    base model takes no images)."""
    tokens, images = model_input_parts(req.prompt)
    if images:
        if count is None or image_token_id is None:
            raise WireError(
                f"prompt.chunks[{images[0].chunk}]: an image chunk, but the base model takes "
                "no images (it is a text-only model)"
            )
        tokens = expand(tokens, images, count, image_token_id, "prompt")
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
    return tokens, images


def check_topk_sample(req: s.SampleRequest, max_tokens: int) -> None:
    """Bound ``topk_sample_logprobs`` once ``max_tokens`` is known."""
    cells = req.num_samples * max_tokens * req.topk_sample_logprobs
    if cells > MAX_SCORE_CELLS:
        raise WireError(
            f"topk_sample_logprobs: num_samples x max_tokens x k = {cells}, over the limit of "
            f"{MAX_SCORE_CELLS}"
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
