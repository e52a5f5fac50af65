"""What every runner reads before it trains: the base model's directory and the env's rows.

Both runners (native and verl) resolve the same inputs from a parsed JobSpec, so a job trains
and evaluates on the same rows whichever engine runs it.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from environments.datasets import load_rows
from jobs.datasets import resolve_dataset_ref
from jobs.models import BaseModel
from jobs.spec import JobSpec

__all__ = ["Rows", "base_model_path", "dataset_rows", "eval_job_rows", "split_holdout"]

Rows = list[dict[str, Any]]

_TRAIN_SPLIT = re.compile(r"^(builtin:.+)_train$")


def base_model_path(spec: JobSpec) -> Path:
    """The directory of the spec's base model on this worker.

    The registry's limits (rank, context) were checked once, at submission
    (``jobs.services.submit_job``); here only what can change on a worker is checked.
    """
    model = BaseModel.objects.filter(name=spec.base_model, enabled=True).first()
    if model is None:
        raise LookupError(f"base model {spec.base_model!r} is not registered or is disabled")
    path = model.resolved_path()
    if not path.is_dir():
        raise FileNotFoundError(
            f"base model {spec.base_model!r}: no model directory at {path} on this worker"
        )
    return path


def split_holdout(rows: Rows, n_eval: int, seed: int) -> tuple[Rows, Rows]:
    """(train, eval) for a dataset without a test split: a seeded fifth at most is held out."""
    k = min(n_eval, len(rows) // 5)
    if k < 1:
        return rows, []
    order = list(range(len(rows)))
    random.Random(seed + 7919).shuffle(order)
    held = set(order[:k])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in order[:k]]


def dataset_rows(spec: JobSpec) -> tuple[Rows | None, Rows | None]:
    """(training rows, evaluation rows); None for generator environments."""
    if spec.dataset is None:
        return None, None
    env = str(spec.env)
    rows = load_rows(resolve_dataset_ref(spec.dataset), env)
    match = _TRAIN_SPLIT.match(spec.dataset)
    if match:
        try:
            # A built-in training split has a test split next to it.
            return rows, load_rows(resolve_dataset_ref(match.group(1) + "_test"), env)
        except LookupError:
            pass
    if not spec.eval_every:
        return rows, []
    return split_holdout(rows, spec.eval_examples, spec.seed)


def eval_job_rows(spec: JobSpec) -> Rows | None:
    """An eval job's prompts: by default exactly those a training run of this spec evaluates
    on (`dataset_rows` with evaluation on), so the numbers of both compare."""
    assert spec.eval is not None
    if spec.dataset is None:
        return None
    if spec.eval.split == "all":
        return load_rows(resolve_dataset_ref(spec.dataset), str(spec.env))
    return dataset_rows(spec.model_copy(update={"eval_every": 1}))[1]
