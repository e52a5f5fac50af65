"""The engines a GPU worker keeps loaded, and the policy a JobSpec describes.

Loading a base model is the slowest part of a short job, so an engine stays loaded for the
life of the worker process and every job it runs on that base model reuses it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.spec import JobSpec

if TYPE_CHECKING:
    from training.engine import Engine
    from training.policy import Policy

__all__ = ["engine_for", "policy_from_spec"]

# Key: (model directory, device); device None lets the engine pick (CUDA when present).
_ENGINES: dict[tuple[str, str | None], Engine] = {}
_LOCK = threading.Lock()


def engine_for(path: Path | str, device: str | None = None) -> Engine:
    """The process's engine for the base model at `path` on `device`, loaded on first use."""
    # Lazy: the worker imports its runners at start, before it knows it will run a job.
    from training.engine import Engine

    key = (str(path), device)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine(path, device=device)
            _ENGINES[key] = engine
        return engine


def policy_from_spec(engine: Engine, spec: JobSpec, *, policy_id: str) -> Policy:
    """A fresh policy on `engine` shaped as `spec` trains it (LoRA rank and targets, or every
    weight), seeded by the spec; a saved state or adapter of that job loads into it."""
    return engine.create_policy(
        rank=spec.lora.rank,
        alpha=spec.lora.alpha,
        target_modules=spec.lora.target_modules,
        seed=spec.seed,
        full_finetune=spec.full_finetune,
        policy_id=policy_id,
    )
