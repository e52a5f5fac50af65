"""``POST /api/v1/jobs/{id}/sample``: quick generations from a finished job's adapter.

This runs in the web process, which is acceptable only because every request is bounded:
at most ``MAX_SAMPLE_TOKENS`` new tokens, ``MAX_SAMPLES`` samples and a prompt that fits the
base model's context; one generation at a time per process (a lock), the base model loaded
once per process and the ``MAX_CACHED_ADAPTERS`` most recently used adapters kept
registered on it. Anything heavier belongs on a GPU worker (the primitives API).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from environments.renderer import Renderer
from training import peft_io

from . import artifacts
from .adapters import load_peft_adapter
from .engines import engine_for, policy_from_spec
from .models import BaseModel, Job
from .spec import JobSpec, SpecError, parse_spec

if TYPE_CHECKING:
    from training.engine import Engine

MAX_SAMPLE_TOKENS = 256
MAX_SAMPLES = 8
MAX_CACHED_ADAPTERS = 4

_LOCK = threading.Lock()
# (job id, adapter file mtime) -> (policy id, the engine holding it), in LRU order.
_ADAPTERS: OrderedDict[tuple[str, int], tuple[str, Engine]] = OrderedDict()


class NoAdapter(Exception):
    """The job has no final adapter to sample from (not finished, failed, or full weights)."""


class BadSampleRequest(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


def _policy_for(job: Job, spec: JobSpec, engine: Engine, adapter: Path) -> str:
    """The registered policy holding the job's adapter, loaded on first use."""
    # The file's mtime is part of the key: a re-exported adapter is loaded again.
    key = (str(job.pk), peft_io.weights_path(adapter).stat().st_mtime_ns)
    cached = _ADAPTERS.get(key)
    if cached is not None and cached[0] in engine.policies:
        _ADAPTERS.move_to_end(key)
        return cached[0]
    policy_id = f"sample-{job.pk}-{key[1]}"
    policy = policy_from_spec(engine, spec, policy_id=policy_id)
    try:
        load_peft_adapter(policy, adapter)
    except Exception:
        engine.remove_policy(policy_id)
        raise
    _ADAPTERS[key] = (policy_id, engine)
    while len(_ADAPTERS) > MAX_CACHED_ADAPTERS:
        _, (old_id, old_engine) = _ADAPTERS.popitem(last=False)
        if old_id in old_engine.policies:
            old_engine.remove_policy(old_id)
    return policy_id


def sample_from_job(
    job: Job,
    *,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    max_tokens: int,
    temperature: float,
    n: int,
    seed: int | None,
) -> list[dict[str, Any]]:
    """Generate `n` continuations of the prompt (raw text) or of the chat (rendered with the
    base model's chat template, stopping at the end of the assistant turn)."""
    # Lazy: these import torch, which the web process loads only once a sample is asked for.
    from training.sampler import SampleRequest, sample
    from training.types import SamplingParams

    adapter = artifacts.adapter_dir(job.pk)
    if adapter is None:
        raise NoAdapter(f"job {job.pk} has no final adapter (state {job.state})")
    try:
        spec = parse_spec(job.spec)
    except SpecError as exc:
        raise NoAdapter(f"job {job.pk} has an unreadable spec: {exc}") from exc
    model = BaseModel.objects.filter(name=spec.base_model, enabled=True).first()
    if model is None:
        raise NoAdapter(f"base model {spec.base_model!r} is not registered or is disabled")
    with _LOCK:
        engine = engine_for(model.resolved_path())
        renderer = Renderer(engine.tokenizer)
        if messages is not None:
            tokens = renderer.prompt_tokens(messages)  # type: ignore[arg-type]
            stop_ids = tuple(renderer.stop_token_ids())
        else:
            tokens = renderer.encode(str(prompt))
            stop_ids = ()
        field = "messages" if messages is not None else "prompt"
        if not tokens:
            raise BadSampleRequest(field, "renders to no tokens")
        if len(tokens) + max_tokens > model.max_context:
            raise BadSampleRequest(
                field,
                f"{len(tokens)} prompt tokens + max_tokens {max_tokens} exceed the context of "
                f"{model.max_context} tokens of base model {model.name!r}",
            )
        policy_id = _policy_for(job, spec, engine, adapter)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=stop_ids
        )
        out = sample(engine, [SampleRequest(tokens, params, n, policy_id, None)])[0]
        return [
            {
                "text": renderer.action_text(seq.tokens)
                if messages is not None
                else renderer.decode(seq.tokens),
                "tokens": seq.tokens,
                "stop_reason": seq.stop_reason,
            }
            for seq in out
        ]
