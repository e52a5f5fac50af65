"""The Tinker sample requests of the model worker: their rows (decoded in the shared
continuous batch), their answers, and the prompt scoring (prompt logprobs, top-k, target
logprobs, alternative draws) some ask for."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinker_api import futures, wire
from tinker_api.worker.datums import prompt_images
from tinker_api.worker.requests import Op, RequestError
from tinker_api.worker.sampler_cache import SamplerCache
from training.continuous import Row, StepToken
from training.engine import Engine
from training.policy import Policy
from training.scoring import PromptScoring, score_prompts
from training.types import SampledSequence, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SampleRun:
    """A sample request in the shared decode batch: its rows' tokens as they come."""

    op: Op
    key: str | None
    prompt: list[int]
    images: tuple[Any, ...]
    rows: list[SampledSequence]
    left: int
    ended: bool = False


class SamplingHandler:
    """The Tinker sample requests of the model worker. Their rows decode in the chat
    handler's continuous batch (``ChatHandler`` admits them and steps them beside the
    OpenAI-style requests, one forward for both), so a rollout neither stalls a stream nor
    waits for one; this handler turns a request into rows and its finished rows into the
    answer."""

    def __init__(
        self, base: str, engine: Engine, policies: Mapping[str, Policy], samplers: SamplerCache
    ) -> None:
        self.base = base
        self.engine = engine
        self.policies = policies
        self.samplers = samplers
        # Row id (``StepToken.row``) -> the request and which of its samples it is.
        self.owner: dict[int, tuple[SampleRun, int]] = {}

    @property
    def busy(self) -> bool:
        return bool(self.owner)

    def row_teams(self) -> Counter[int | None]:
        return Counter(run.op.team for run, _i in self.owner.values())

    def keys_in_use(self) -> set[str]:
        return {run.key for run, _i in self.owner.values() if run.key is not None}

    def prepare(self, op: Op) -> tuple[SampleRun, list[Row]]:
        """The rows of ``op``; RequestError or ValueError for a request that cannot run."""
        f = op.fields
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
        n = int(f["n"])
        rows = [
            Row(
                prompt,
                params,
                key,
                sample_index=j,
                stop_on_eos=bool(sp.get("stop_on_eos", True)),
                topk=int(sp.get("topk") or 0),
                images=pictures,
            )
            for j in range(n)
        ]
        run = SampleRun(
            op=op,
            key=key,
            prompt=prompt,
            images=pictures,
            rows=[SampledSequence([], [], "length", [] if row.topk else None) for row in rows],
            left=n,
        )
        return run, rows

    def joined(self, run: SampleRun, idents: list[int]) -> None:
        self.owner.update((ident, (run, j)) for j, ident in enumerate(idents))

    def on_step(self, steps: list[StepToken]) -> list[SampleRun]:
        """Record the tokens ``steps`` drew for sample rows; the requests they finished."""
        done: list[SampleRun] = []
        for step in steps:
            run, j = self.owner[step.row]
            seq = run.rows[j]
            seq.tokens.append(step.token)
            seq.logprobs.append(step.logprob)
            if seq.topk_logprobs is not None:
                seq.topk_logprobs.append(list(step.topk or []))
            if step.finished:
                del self.owner[step.row]
                seq.stop_reason = "stop" if step.stopped else "length"
                run.left -= 1
                if not run.left:
                    done.append(run)
        return done

    def runs_of(self, idents: set[int]) -> list[SampleRun]:
        """The requests of the rows ``idents``."""
        runs = {id(self.owner[i][0]): self.owner[i][0] for i in idents if i in self.owner}
        return list(runs.values())

    def fail(self, runs: list[SampleRun], reason: str, kind: str) -> set[int]:
        """End ``runs`` with an error; the rows of theirs the batch must drop."""
        ended = [run for run in runs if not run.ended]
        for run in ended:
            run.ended = True
            futures.fail(run.op.rid, reason, kind)
        if ended:
            futures.samples_answered(self.base, len(ended))
        rows = {i for i, (run, _j) in self.owner.items() if run.ended}
        for i in rows:
            del self.owner[i]
        return rows

    def fail_all(self, reason: str) -> None:
        self.fail(self.runs_of(set(self.owner)), reason, "server")

    def finish(self, runs: list[SampleRun]) -> None:
        """Score the prompts that ask for it and answer the finished requests ``runs``."""
        try:
            scored = self._score_prompts(runs)
        except Exception as exc:
            log.exception("prompt scoring failed")
            self.fail(runs, f"{type(exc).__name__}: {exc}", "server")
            return
        for run in runs:
            run.ended = True
            op, seqs = run.op, run.rows
            if op.fields.get("record"):
                team = str((futures.get(op.rid) or {}).get("team", ""))
                for j, seq in enumerate(seqs):
                    futures.record_stability(
                        team, f"{op.rid}:{j}", list(seq.tokens), list(seq.logprobs)
                    )
            out = [
                wire.SampledSequenceOut(
                    tokens=seq.tokens,
                    stop_reason=seq.stop_reason,
                    logprobs=seq.logprobs,
                    topk_logprobs=seq.topk_logprobs,
                )
                for seq in seqs
            ]
            extra = scored.get(id(op), {})
            proto = wire.encode_sample_response(out, protobuf=True, **extra)
            plain = wire.encode_sample_response(out, protobuf=False, **extra)
            futures.complete(op.rid, json_body=plain.content, proto_body=proto.content)
        futures.samples_answered(self.base, len(runs))

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

    def _score_prompts(self, runs: list[SampleRun]) -> dict[int, dict[str, Any]]:
        """One forward over the prompts of the requests that ask for prompt logprobs, top-k
        prompt logprobs, target logprobs or alternative draws; per request (by ``id(op)``),
        the keyword arguments of ``wire.encode_sample_response``."""
        wants: list[tuple[Op, wire.PromptTargets | None]] = []
        scorings: list[PromptScoring] = []
        for run in runs:
            op, prompt, f = run.op, run.prompt, run.op.fields
            targets = None
            if f.get("targets") is not None:
                csr = f.get("targets_csr")
                targets = wire.PromptTargets(
                    ids=np.asarray(f["targets"], dtype=np.int64).reshape(len(prompt) - 1, -1),
                    csr=None if csr is None else (list(csr[0]), list(csr[1])),
                )
            scoring = PromptScoring(
                tokens=prompt,
                adapter=run.key,
                logprobs=bool(f.get("prompt_logprobs")),
                topk=int(f.get("topk_prompt") or 0),
                last_n=f.get("last_n"),
                targets=None if targets is None else torch.from_numpy(targets.ids),
                alt_k=int(f.get("alt_k") or 0),
                temperature=float(f["params"]["temperature"]),
                seed=f["params"].get("seed"),
                images=run.images,
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
