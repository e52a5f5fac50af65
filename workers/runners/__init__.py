"""Job runners, chosen by the JobSpec's ``(method, runner)`` in ``runner_for`` and nowhere else.

A runner is a callable ``run(ctx: JobContext) -> None``. It reads the parsed spec from
``ctx.job_spec``, does the job's work step by step, calls ``ctx.heartbeat(step)`` and
``ctx.log_metrics(step, {...})`` each step (the context buffers metrics for up to a second;
``ctx.flush_metrics()`` before a checkpoint) and returns early as soon as ``ctx.cancelled()``
is True. Returning normally means success; raising means failure (the exception becomes the
job's error message). The task around it owns every state transition and the GPU lease.

Built in: ``smoke``, ``rl`` and ``sft`` on the native engine (a spec's default ``runner``),
``rl`` and ``sft`` on verl. Another module adds a pair with ``register``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from jobs.spec import JobSpec
from workers.runners.base import JobCancelled, JobContext, LeaseLost, MemberLost

__all__ = [
    "JobCancelled",
    "JobContext",
    "LeaseLost",
    "MemberLost",
    "Runner",
    "UnknownMethod",
    "available",
    "register",
    "runner_for",
]

Runner = Callable[[JobContext], None]

# (method, runner) -> "module:function", imported on first use so a worker that never runs
# RL jobs never imports the training engine (torch) and one without verl never needs it.
BUILTIN: dict[tuple[str, str], str] = {
    ("smoke", "native"): "workers.runners.smoke:run",
    ("rl", "native"): "workers.runners.native:run",
    ("sft", "native"): "workers.runners.native:run",
    ("rl", "verl"): "workers.runners.verl:run",
    ("sft", "verl"): "workers.runners.verl:run",
}

_registry: dict[tuple[str, str], Runner | str] = dict(BUILTIN)


class UnknownMethod(LookupError):
    def __init__(self, method: str, runner: str | None = None) -> None:
        self.method = method
        self.runner = runner
        known = ", ".join(available()) or "none"
        if runner is not None and any(m == method for m, _ in _registry):
            what = f"runner {runner!r} for method {method!r}"
        else:
            what = f"runner for method {method!r}"
        super().__init__(f"no {what} (available: {known})")


def register(method: str, runner: Runner | str, *, engine: str = "native") -> None:
    """Make ``runner`` (a callable or a "module:function" path) run jobs of ``method`` whose
    spec names ``engine`` as its ``runner``."""
    if not method or not isinstance(method, str):
        raise ValueError("a runner needs a method name")
    if isinstance(runner, str) and ":" not in runner:
        raise ValueError(f"runner path must look like 'package.module:function', got {runner!r}")
    _registry[(method, engine)] = runner


def available() -> list[str]:
    return sorted({method for method, _ in _registry})


def _load(key: tuple[str, str]) -> Runner:
    target = _registry[key]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module_name), attr)
        _registry[key] = target
    return target


def runner_for(spec: JobSpec) -> Runner:
    """The runner of a job: the one place that chooses by (method, runner)."""
    key = (spec.method, spec.runner)
    if key not in _registry:
        raise UnknownMethod(spec.method, spec.runner)
    return _load(key)
