"""The sampling requests of the model worker: one generation batch across adapters, and the
prompt scoring (prompt logprobs, top-k, target logprobs, alternative draws) some ask for."""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from typing import Any

import numpy as np
import torch

from tinker_api import futures, wire
from tinker_api.worker.datums import prompt_images
from tinker_api.worker.requests import Op, RequestError
from tinker_api.worker.sampler_cache import SamplerCache
from training.engine import Engine
from training.policy import Policy
from training.sampler import generation
from training.scoring import PromptScoring, score_prompts
from training.types import SamplingParams

log = logging.getLogger(__name__)


# A request of a batch: its op, its rows, the adapter key they use and its prompt.
Owner = tuple[Op, list[int], str | None, list[int]]


class SampleBatch:
    """A generation batch in progress: ``advance`` runs its next forward; the worker runs
    the chat batch's steps between them, so that streams do not stall for a whole batch."""

    def __init__(
        self,
        handler: SamplingHandler,
        owners: list[Owner],
        op_images: dict[int, tuple[Any, ...]],
        steps: Generator[None, None, list[Any]],
    ) -> None:
        self.handler = handler
        self.owners = owners
        self.op_images = op_images
        self.steps = steps
        self.ops = [op for op, *_ in owners]
        self.keys = {key for _op, _rows, key, _prompt in owners if key is not None}

    def advance(self) -> bool:
        """Run the batch's next forward; True once it has ended (answered or failed)."""
        try:
            try:
                next(self.steps)
                return False
            except StopIteration as done:
                self.handler.finish(self.owners, self.op_images, done.value)
        except Exception as exc:
            log.exception("sampling batch failed")
            self.fail(f"{type(exc).__name__}: {exc}")
            return True
        futures.samples_answered(self.handler.base, len(self.ops))
        return True

    def fail(self, reason: str) -> None:
        """End every request of the batch not answered yet with ``reason``."""
        self.steps.close()
        for op in self.ops:
            futures.fail(op.rid, reason, "server")
        futures.samples_answered(self.handler.base, len(self.ops))


class SamplingHandler:
    def __init__(
        self, base: str, engine: Engine, policies: Mapping[str, Policy], samplers: SamplerCache
    ) -> None:
        self.base = base
        self.engine = engine
        self.policies = policies
        self.samplers = samplers

    def run(self, ops: list[Op]) -> None:
        """``ops`` as one batch, run to its end (see ``start``)."""
        batch = self.start(ops)
        while batch is not None and not batch.advance():
            pass

    def start(self, ops: list[Op]) -> SampleBatch | None:
        """Every sample request read so far, as one multi-adapter generation batch that
        ``SampleBatch.advance`` runs a step at a time; a request that cannot run fails alone.
        None when none can."""
        rows_prompts: list[list[int]] = []
        rows_params: list[Any] = []
        rows_keys: list[str | None] = []
        rows_index: list[int] = []
        rows_eos: list[bool] = []
        rows_topk: list[int] = []
        rows_images: list[tuple[Any, ...]] = []
        owners: list[Owner] = []
        op_images: dict[int, tuple[Any, ...]] = {}
        for op in ops:
            f = op.fields
            try:
                key = self.samplers.key(f["target"], self.policies)
                sp = f["params"]
                params = SamplingParams(
                    max_tokens=int(sp["max_tokens"]),
                    temperature=float(sp["temperature"]),
                    top_p=float(sp["top_p"]),
                    top_k=max(0, int(sp["top_k"])),
                    seed=sp.get("seed"),
                    stop=tuple(sp.get("stop_strings") or ()),
                    stop_token_ids=tuple(sp.get("stop_ids") or ()),
                )
                prompt = [int(t) for t in f["prompt"]]
                self._check_vocabulary(prompt, f.get("targets"))
                pictures = prompt_images(f, self.engine)
            except (RequestError, ValueError, KeyError) as exc:
                futures.fail(op.rid, str(exc), "user")
                futures.samples_answered(self.base, 1)
                continue
            rows = []
            for j in range(int(f["n"])):
                rows.append(len(rows_prompts))
                rows_prompts.append(prompt)
                rows_params.append(params)
                rows_keys.append(key)
                rows_index.append(j)
                rows_eos.append(bool(sp.get("stop_on_eos", True)))
                rows_topk.append(int(sp.get("topk") or 0))
                rows_images.append(pictures)
            op_images[id(op)] = pictures
            owners.append((op, rows, key, prompt))
        if not owners:
            return None
        steps = generation(
            self.engine.model,
            self.engine.tokenizer,
            rows_prompts,
            rows_params,
            adapters=rows_keys,
            host=self.engine.host,
            sample_indices=rows_index,
            stop_on_eos=rows_eos,
            topk_logprobs=rows_topk,
            images=rows_images if any(rows_images) else None,
        )
        return SampleBatch(self, owners, op_images, steps)

    def finish(
        self, owners: list[Owner], op_images: dict[int, tuple[Any, ...]], seqs: list[Any]
    ) -> None:
        """Score the prompts that ask for it and answer every request of a finished batch."""
        scored = self._score_prompts(owners, op_images)
        for op, rows, _key, _prompt in owners:
            if op.fields.get("record"):
                team = str((futures.get(op.rid) or {}).get("team", ""))
                for j, i in enumerate(rows):
                    futures.record_stability(
                        team, f"{op.rid}:{j}", list(seqs[i].tokens), list(seqs[i].logprobs)
                    )
            out = [
                wire.SampledSequenceOut(
                    tokens=seqs[i].tokens,
                    stop_reason=seqs[i].stop_reason,
                    logprobs=seqs[i].logprobs,
                    topk_logprobs=seqs[i].topk_logprobs,
                )
                for i in rows
            ]
            extra = scored.get(id(op), {})
            proto = wire.encode_sample_response(out, protobuf=True, **extra)
            plain = wire.encode_sample_response(out, protobuf=False, **extra)
            futures.complete(op.rid, json_body=plain.content, proto_body=proto.content)

    def _check_vocabulary(self, prompt: list[int], targets: list[list[int]] | None) -> None:
        """Token ids beyond the vocabulary fail their own request, not the whole batch."""
        model_config: Any = self.engine.model.config
        vocab = int(model_config.get_text_config().vocab_size)
        for where, ids in (("prompt", prompt), ("target_prompt_logprobs", targets or [])):
            flat = np.asarray(ids, dtype=np.int64).reshape(-1)
            if flat.size and int(flat.max()) >= vocab:
                raise RequestError(
                    f"{where}: token id {int(flat.max())} is outside the vocabulary [0, {vocab})"
                )

    def _score_prompts(
        self,
        owners: list[Owner],
        op_images: dict[int, tuple[Any, ...]],
    ) -> dict[int, dict[str, Any]]:
        """One forward over the prompts of the requests that ask for prompt logprobs, top-k
        prompt logprobs, target logprobs or alternative draws; per request (by ``id(op)``),
        the keyword arguments of ``wire.encode_sample_response``."""
        wants: list[tuple[Op, wire.PromptTargets | None]] = []
        scorings: list[PromptScoring] = []
        for op, _rows, key, prompt in owners:
            f = op.fields
            targets = None
            if f.get("targets") is not None:
                csr = f.get("targets_csr")
                targets = wire.PromptTargets(
                    ids=np.asarray(f["targets"], dtype=np.int64).reshape(len(prompt) - 1, -1),
                    csr=None if csr is None else (list(csr[0]), list(csr[1])),
                )
            scoring = PromptScoring(
                tokens=prompt,
                adapter=key,
                logprobs=bool(f.get("prompt_logprobs")),
                topk=int(f.get("topk_prompt") or 0),
                last_n=f.get("last_n"),
                targets=None if targets is None else torch.from_numpy(targets.ids),
                alt_k=int(f.get("alt_k") or 0),
                temperature=float(f["params"]["temperature"]),
                seed=f["params"].get("seed"),
                images=op_images.get(id(op), ()),
            )
            if scoring.logprobs or scoring.topk or scoring.alt_k or targets is not None:
                wants.append((op, targets))
                scorings.append(scoring)
        if not scorings:
            return {}
        results = score_prompts(self.engine.model, scorings, host=self.engine.host)
        out: dict[int, dict[str, Any]] = {}
        for (op, targets), scoring, res in zip(wants, scorings, results, strict=True):
            extra: dict[str, Any] = {}
            if scoring.logprobs:
                extra["prompt_logprobs"] = res.logprobs
            if scoring.topk:
                extra["topk_prompt_logprobs"] = res.topk
            if targets is not None and res.target_logprobs is not None:
                data, csr = targets.answer(res.target_logprobs.numpy())
                extra["target_prompt_logprobs"] = wire.TensorOut(
                    data=data, shape=list(targets.ids.shape), csr=csr
                )
            if res.alt_tokens is not None and res.alt_logprobs is not None:
                shape = list(res.alt_tokens.shape)
                extra["prompt_alt_tokens"] = (
                    wire.TensorOut(data=res.alt_tokens.numpy().astype(np.int64), shape=shape),
                    wire.TensorOut(data=res.alt_logprobs.numpy().astype(np.float32), shape=shape),
                )
            out[id(op)] = extra
        return out
