"""Wire datums as engine datums: StableReinforce's recorded logprobs, padded loss inputs."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from tinker_api import futures, wire
from tinker_api.images import resolve_pointer
from tinker_api.worker.requests import RequestError
from training import vision
from training.engine import Engine
from training.types import Datum


def stable_inputs(d: wire.WireDatum, i: int, team: str) -> dict[str, np.ndarray]:
    """StableReinforce's view of a datum: ``logprobs`` replaced on sampled positions by what
    the server recorded when it sampled them, and ``mask`` = the sampled positions (times a
    client mask), from the datum's ``loss_fn_input_spans``."""
    n = len(d.tokens)
    spans = d.loss_fn_input_spans or []
    if sum(sp.length for sp in spans) != n:
        raise RequestError(f"data[{i}].loss_fn_input_spans: lengths must add up to {n}")
    targets = d.loss_fn_inputs["target_tokens"]
    advantages = d.loss_fn_inputs["advantages"]
    logprobs = d.loss_fn_inputs["logprobs"].astype(np.float32).copy()
    mask = np.zeros(n, dtype=np.float32)
    pos = 0
    for sp in spans:
        if sp.kind == "sampled" and sp.length:
            rec = futures.stability(team, sp.sequence_id)
            if rec is None:
                raise RequestError(
                    f"data[{i}]: no stability info for sequence {sp.sequence_id!r} (unknown, "
                    "expired or sampled without record_stability_info=True)"
                )
            end = sp.offset + sp.length
            if end > len(rec["tokens"]):
                raise RequestError(
                    f"data[{i}]: span [{sp.offset}, {end}) of sequence {sp.sequence_id!r} "
                    f"exceeds its {len(rec['tokens'])} sampled tokens"
                )
            if list(targets[pos : pos + sp.length]) != rec["tokens"][sp.offset : end]:
                raise RequestError(
                    f"data[{i}]: targets at positions {pos}..{pos + sp.length - 1} are not the "
                    f"tokens sequence {sp.sequence_id!r} sampled there"
                )
            logprobs[pos : pos + sp.length] = rec["logprobs"][sp.offset : end]
            mask[pos : pos + sp.length] = 1.0
        pos += sp.length
    if np.any((advantages != 0) & (mask == 0)):
        raise RequestError(
            f"data[{i}]: stable_reinforce accepts nonzero advantages only on sampled tokens "
            "(positions its loss_fn_input_spans name as SampledProvenanceSpan)"
        )
    if "mask" in d.loss_fn_inputs:
        mask = mask * d.loss_fn_inputs["mask"].astype(np.float32)
    return {**d.loss_fn_inputs, "logprobs": logprobs, "mask": mask}


def expand_images(
    batch: wire.ForwardBackwardBatch, engine: Engine
) -> list[tuple[vision.ImageInput, ...]]:
    """Each datum's image placeholders put in its tokens as the engine's image processor
    counts them (a client's ``expected_tokens`` that differs is a WireError naming the chunk);
    the processed images of each datum."""
    processed: dict[int, vision.ImageInput] = {}

    def count(image: wire.WireImage, where: str) -> int:
        resolve_pointer(image, where)
        assert image.data is not None
        inp = engine.encode_image(image.data)
        processed[id(image)] = inp
        return inp.tokens

    spec = vision.spec_of(engine.model)
    usable = engine.processor is not None and spec is not None
    wire.expand_images(
        batch, count if usable else None, spec.image_token_id if spec is not None else None
    )
    return [tuple(processed[id(image)] for image in d.images) for d in batch.data]


def prompt_images(fields: dict[str, Any], engine: Engine) -> tuple[vision.ImageInput, ...]:
    """The processed images of a queued sampling op (``images``: base64 data and the
    positions the web process counted for each)."""
    out = []
    for entry in fields.get("images") or []:
        image = engine.encode_image(base64.b64decode(entry["data"]))
        if image.tokens != int(entry["tokens"]):
            raise RequestError(
                f"prompt.chunks[{entry['chunk']}]: the image processor gives {image.tokens} "
                f"tokens, the request was laid out with {entry['tokens']}"
            )
        out.append(image)
    return tuple(out)


def to_datums(
    batch: wire.ForwardBackwardBatch,
    team: str = "",
    images: list[tuple[vision.ImageInput, ...]] | None = None,
) -> list[Datum]:
    """A decoded batch as engine datums (tensors), each input one value per position."""
    out = []
    for i, d in enumerate(batch.data):
        inputs = {}
        raw = d.loss_fn_inputs
        if batch.loss_fn == "stable_reinforce":
            raw = stable_inputs(d, i, team)
        for name, arr in raw.items():
            if arr.ndim != 1:
                raise RequestError(
                    f"data[{i}].loss_fn_inputs[{name!r}]: only one value per position is "
                    f"supported, got shape {list(arr.shape)}"
                )
            inputs[name] = torch.from_numpy(np.ascontiguousarray(arr))
        try:
            out.append(
                Datum(
                    model_input=torch.tensor(d.tokens, dtype=torch.long),
                    loss_fn_inputs=inputs,
                    images=images[i] if images is not None else (),
                )
            )
        except ValueError as exc:
            raise RequestError(f"data[{i}]: {exc}") from exc
    return out


def pad_inputs(datums: list[Datum]) -> None:
    """Give every datum the same loss input names (zeros where absent): one engine call
    collates them together, and each request's loss reads only its own names."""
    names = set().union(*(d.loss_fn_inputs for d in datums))
    for d in datums:
        for name in names - set(d.loss_fn_inputs):
            dtype = torch.long if name == "target_tokens" else torch.float32
            # An absent mask means "every token counts": a batch mate's mask must not
            # zero this datum's loss.
            fill = torch.ones if name == "mask" else torch.zeros
            d.loss_fn_inputs[name] = fill(d.length, dtype=dtype)
